"""The built-in character-level tokenizer of the embedded default (no downloaded files).

Ids 0-2 are the special tokens ``<pad> </s> <unk>``, then one token per byte (256), so every
character of ASCII text is exactly one token and nothing is ever unknown. There is no BOS
token (as in Qwen models).

The pipeline is the one ``Qwen2Tokenizer`` builds (NFC, the Qwen split regex, byte-level
pre-tokenizer and decoder, BPE) with an empty merge list. That matters: the built-in model
is a Qwen2, and ``AutoTokenizer.from_pretrained`` on its output folder loads the tokenizer
through ``Qwen2Tokenizer``, which rebuilds the pipeline around the saved vocabulary; a
tokenizer of another shape (a plain character BPE, say) would lose its spaces on the way.
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from tokenizers.pre_tokenizers import ByteLevel
from transformers import PreTrainedTokenizerFast
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

SPECIAL_TOKENS = ("<pad>", "</s>", "<unk>")


def builtin_tokenizer() -> PreTrainedTokenizerFast:
    """Build the byte-level character tokenizer (same ids on every call)."""
    alphabet = sorted(ByteLevel.alphabet(), key=lambda ch: _byte_of(ch))
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + tuple(alphabet))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], continuing_subword_prefix="",
                                   end_of_word_suffix="", fuse_unk=False, byte_fallback=False))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        eos_token="</s>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )


def _byte_of(symbol: str) -> int:
    """The byte a byte-level symbol stands for (GPT-2's printable mapping, inverted)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1)
    )
    if ord(symbol) in printable:
        return ord(symbol)
    missing = [b for b in range(256) if b not in printable]
    return missing[ord(symbol) - 256]

"""The built-in character-level tokenizer of the embedded default (no downloaded files).

Ids 0-3 are the special tokens ``<pad> <s> </s> <unk>``, then newline and the 95 printable
ASCII characters, 100 tokens in all. Encoding with special tokens prepends ``<s>``; any other
character becomes ``<unk>``. It is a ``PreTrainedTokenizerFast``, so ``save_pretrained`` and
``AutoTokenizer.from_pretrained`` round-trip it like any Hugging Face tokenizer.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, processors
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")
CHARACTERS = ("\n", *(chr(code) for code in range(32, 127)))


def builtin_tokenizer() -> PreTrainedTokenizerFast:
    """Build the character-level tokenizer (same ids on every call)."""
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    # BPE without merges and without a pre-tokenizer splits text into single characters;
    # spaces and newlines stay ordinary tokens, so decoding is a plain concatenation (Fuse).
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    backend.decoder = decoders.Fuse()
    bos_id = vocab["<s>"]
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )

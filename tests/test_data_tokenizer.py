import pytest
import transformers
from transformers import AutoTokenizer

from lazytrain.data.synthetic import TIERS, make_split
from lazytrain.data.template import TEMPLATES
from lazytrain.data.tokenizer import SPECIAL_TOKENS, builtin_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return builtin_tokenizer()


def test_vocab_and_special_tokens(tokenizer):
    assert len(tokenizer) == len(SPECIAL_TOKENS) + 256
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (0, 1, 2)
    assert tokenizer.bos_token_id is None
    assert tokenizer("ab")["input_ids"] == tokenizer("ab", add_special_tokens=False)["input_ids"]


def test_one_token_per_ascii_character(tokenizer):
    text = "Q: 23  +\n45 ~"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)
    assert len(set(ids)) == len(set(text))


def test_non_ascii_is_bytes_not_unknown(tokenizer):
    ids = tokenizer("é", add_special_tokens=False)["input_ids"]
    assert len(ids) == 2 and tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == "é"


def _texts():
    records = [r for tier in TIERS for r in make_split("train", 50, tier=tier)]
    texts = [t for r in records for t in (r["query"], r["response"])]
    prompts = [TEMPLATES[name].prompt for name in ("alpaca", "compact")]
    return texts + prompts + [" leading and trailing spaces ", "", "\n\n", "a  b\t\tc\r\nd"]


def test_decode_encode_is_identity_on_the_data(tokenizer):
    for text in _texts():
        ids = tokenizer(text)["input_ids"]
        assert tokenizer.decode(ids, skip_special_tokens=True) == text


@pytest.mark.parametrize("with_model_config", [False, True], ids=["alone", "in-qwen2-model-folder"])
def test_save_pretrained_round_trip(tokenizer, tmp_path, with_model_config):
    """In a model folder, AutoTokenizer picks Qwen2Tokenizer from config.json: same ids."""
    tokenizer.save_pretrained(tmp_path)
    if with_model_config:
        config = transformers.Qwen2Config(vocab_size=len(tokenizer))
        config.architectures = ["Qwen2ForCausalLM"]
        config.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert (loaded.pad_token_id, loaded.eos_token_id) == (0, 1)
    for text in _texts():
        ids = tokenizer(text)["input_ids"]
        assert loaded(text)["input_ids"] == ids
        assert loaded.decode(ids, skip_special_tokens=True) == text

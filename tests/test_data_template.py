import json

import pytest

from lazytrain.data.formats import DataError, Sample
from lazytrain.data.template import TEMPLATE_FILE, TEMPLATES, PromptTemplate, get_template
from lazytrain.data.tokenizer import builtin_tokenizer

# MetaMath's PROMPT_DICT (train_math.py), verbatim.
METAMATH_NO_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:"
)
METAMATH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further "
    "context. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:"
)


@pytest.mark.parametrize(("template", "sample", "expected"), [
    ("alpaca", Sample(instruction="What is 2+3?", response="5"),
     METAMATH_NO_INPUT.format(instruction="What is 2+3?")),
    ("alpaca", Sample(instruction="Add.", input="2 and 3", response="5"),
     METAMATH_INPUT.format(instruction="Add.", input="2 and 3")),
    ("alpaca", Sample(instruction="Add.", response="5", system="Be brief."),
     "Be brief.\n\n" + METAMATH_NO_INPUT.format(instruction="Add.")),
    ("compact", Sample(instruction="What is 2+3?", response="5"), "Q: What is 2+3?\nA: "),
    ("compact", Sample(instruction="Add.", input="2 and 3", response="5"),
     "Q: Add.\n2 and 3\nA: "),
])
def test_render(template, sample, expected):
    assert get_template(template).render(sample) == expected


def test_template_without_input_variant_appends_the_input():
    template = PromptTemplate(name="mine", prompt="<{instruction}>")
    assert template.render(Sample(instruction="a", input="b", response="")) == "<a\n\nb>"


def test_literal_braces():
    template = PromptTemplate(name="braces", prompt="{{x}} {instruction}")
    assert template.render(Sample(instruction="a", response="")) == "{x} a"


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_save_load_round_trip(tmp_path, name):
    path = TEMPLATES[name].save(tmp_path)
    assert path.name == TEMPLATE_FILE
    assert json.loads(path.read_text())["name"] == name
    assert PromptTemplate.load(tmp_path) == TEMPLATES[name]


def test_load_errors(tmp_path):
    with pytest.raises(DataError, match=f"no {TEMPLATE_FILE} in"):
        PromptTemplate.load(tmp_path)
    (tmp_path / TEMPLATE_FILE).write_text('{"name": "x", "colour": "red"}')
    with pytest.raises(DataError, match="not a valid prompt template"):
        PromptTemplate.load(tmp_path)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"prompt": "no placeholder"},
     r"uses placeholders \[\]; it must use exactly \['instruction'\]"),
    ({"prompt": "{question}"}, r"uses placeholders \['question'\]"),
    ({"prompt": "{instruction"}, "literal braces"),
    ({"prompt": "{instruction}", "prompt_with_input": "{instruction}"}, "prompt_with_input"),
    ({"prompt": "{instruction}", "system": "no system"}, "system"),
    ({"prompt": "{instruction}", "chat": True}, "leave prompt and prompt_with_input empty"),
])
def test_invalid_templates(kwargs, message):
    with pytest.raises(DataError, match=message):
        PromptTemplate(name="bad", **kwargs)


def test_unknown_template_name():
    with pytest.raises(DataError, match="choose one of"):
        get_template("vicuna")


def test_chat_needs_a_chat_template():
    tokenizer = builtin_tokenizer()
    with pytest.raises(DataError, match="has none"):
        get_template("chat").render(Sample(instruction="q", response="r"), tokenizer)
    with pytest.raises(DataError, match="no tokenizer"):
        get_template("chat").render(Sample(instruction="q", response="r"))


def test_chat_uses_the_tokenizer_chat_template():
    tokenizer = builtin_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    chat = get_template("chat")
    sample = Sample(instruction="q", input="i", response="r", system="s")
    assert chat.render(sample, tokenizer) == "<system>s\n<user>q\n\ni\n<assistant>"
    assert not chat.add_special_tokens and get_template("alpaca").add_special_tokens

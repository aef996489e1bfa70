"""Prompt templates: how a `Sample` becomes the text the model is conditioned on.

The training target is always the sample's response followed by the tokenizer's eos token,
appended to the rendered prompt with nothing in between. That is MetaMath's convention
(``train_math.py``, inherited from Stanford Alpaca: ``source + target`` with the prompt ending
in ``"### Response:"`` and the target ``response + eos``), so ``alpaca`` puts no space or
newline after ``"### Response:"``; a template that wants a separator ends its prompt with it,
as ``compact`` does (``"A: "``). Prompt and response are tokenized separately and the ids
concatenated, so evaluation, which tokenizes the prompt alone, conditions on exactly the ids
training did.

A template is saved next to the model (``lazytrain_template.json``) so evaluation renders
prompts the way training did.
"""

from __future__ import annotations

import json
import string
from dataclasses import asdict, dataclass
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from lazytrain.data.formats import DataError, Sample

TEMPLATE_FILE = "lazytrain_template.json"

_ALPACA_HEAD = "Below is an instruction that describes a task"
_ALPACA_TAIL = "Write a response that appropriately completes the request."


@dataclass(frozen=True, kw_only=True, slots=True)
class PromptTemplate:
    """Format strings (``str.format`` syntax; write a literal brace as ``{{``) or ``chat``."""

    name: str
    prompt: str = ""
    """Prompt of a sample without input; uses ``{instruction}``."""
    prompt_with_input: str = ""
    """Prompt of a sample with a non-empty input; uses ``{instruction}`` and ``{input}``.
    Empty: ``prompt`` is used with the input appended to the instruction after a blank line."""
    system: str = "{system}\n\n"
    """Prepended to the prompt when the sample has a system prompt; uses ``{system}``."""
    chat: bool = False
    """Render with the tokenizer's own chat template (``apply_chat_template``) instead."""

    def __post_init__(self) -> None:
        if self.chat:
            if self.prompt or self.prompt_with_input:
                raise DataError(f"template {self.name!r}: a chat template takes its format from "
                                "the tokenizer; leave prompt and prompt_with_input empty")
            return
        _check_fields(self.name, "prompt", self.prompt, {"instruction"})
        if self.prompt_with_input:
            _check_fields(self.name, "prompt_with_input", self.prompt_with_input,
                          {"instruction", "input"})
        _check_fields(self.name, "system", self.system, {"system"})

    @property
    def add_special_tokens(self) -> bool:
        """Whether to let the tokenizer add its special tokens (bos) when encoding the prompt.

        A rendered chat template already holds them as text."""
        return not self.chat

    def render(self, sample: Sample, tokenizer: PreTrainedTokenizerBase | None = None) -> str:
        """The prompt text of ``sample``; the response follows it directly."""
        if self.chat:
            return self._render_chat(sample, tokenizer)
        if sample.input and self.prompt_with_input:
            text = self.prompt_with_input.format(instruction=sample.instruction, input=sample.input)
        elif sample.input:
            text = self.prompt.format(instruction=f"{sample.instruction}\n\n{sample.input}")
        else:
            text = self.prompt.format(instruction=sample.instruction)
        if sample.system is not None:
            text = self.system.format(system=sample.system) + text
        return text

    def _render_chat(self, sample: Sample, tokenizer: PreTrainedTokenizerBase | None) -> str:
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise DataError(
                f"template {self.name!r} uses the tokenizer's chat template, and "
                f"{type(tokenizer).__name__ if tokenizer else 'no tokenizer'} has none; "
                "use template 'alpaca' or 'compact', or a tokenizer with a chat_template"
            )
        user = f"{sample.instruction}\n\n{sample.input}" if sample.input else sample.instruction
        messages = [{"role": "user", "content": user}]
        if sample.system is not None:
            messages.insert(0, {"role": "system", "content": sample.system})
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> PromptTemplate:
        return cls(**data)

    def save(self, directory: str | Path) -> Path:
        """Write ``lazytrain_template.json`` into ``directory``; return its path."""
        path = Path(directory) / TEMPLATE_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")
        return path

    @classmethod
    def load(cls, directory: str | Path) -> PromptTemplate:
        """Read the template saved by `save` in ``directory``."""
        path = Path(directory) / TEMPLATE_FILE
        if not path.exists():
            raise DataError(f"no {TEMPLATE_FILE} in {directory}; pass the template by name "
                            f"(one of {sorted(TEMPLATES)}) or a model folder LazyTrain saved")
        try:
            return cls.from_dict(json.loads(path.read_text(encoding="utf-8")))
        except (json.JSONDecodeError, TypeError) as e:
            raise DataError(f"{path}: not a valid prompt template ({e})") from None


def _check_fields(name: str, field: str, text: str, expected: set[str]) -> None:
    try:
        found = {f for _, f, _, _ in string.Formatter().parse(text) if f is not None}
    except ValueError as e:
        raise DataError(f"template {name!r} {field}: {e}; write literal braces as {{{{ }}}}"
                        ) from None
    if found != expected:
        raise DataError(f"template {name!r} {field} uses placeholders {sorted(found)}; "
                        f"it must use exactly {sorted(expected)}")


TEMPLATES = {
    template.name: template
    for template in (
        PromptTemplate(
            name="alpaca",
            prompt=f"{_ALPACA_HEAD}. {_ALPACA_TAIL}\n\n### Instruction:\n{{instruction}}\n\n"
            "### Response:",
            prompt_with_input=f"{_ALPACA_HEAD}, paired with an input that provides further "
            f"context. {_ALPACA_TAIL}\n\n### Instruction:\n{{instruction}}\n\n"
            "### Input:\n{input}\n\n### Response:",
        ),
        PromptTemplate(
            name="compact",
            prompt="Q: {instruction}\nA: ",
            prompt_with_input="Q: {instruction}\n{input}\nA: ",
        ),
        PromptTemplate(name="chat", chat=True),
    )
}
"""Built-in templates: ``alpaca`` (MetaMath's, the default for real models), ``compact``
(short, for the built-in character-level model) and ``chat`` (the tokenizer's own)."""


def get_template(name: str) -> PromptTemplate:
    """A built-in template by name."""
    if name not in TEMPLATES:
        raise DataError(f"unknown prompt template {name!r}; choose one of {sorted(TEMPLATES)} "
                        f"or load a saved {TEMPLATE_FILE}")
    return TEMPLATES[name]

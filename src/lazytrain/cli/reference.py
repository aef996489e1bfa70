"""The configuration reference, generated from `lazytrain.config`'s own docstrings.

Each section's class docstring says what the section is for, and the string literal under each
field is that key's documentation (as torchtitan's configs do). ``lazytrain config`` prints the
reference as Markdown (``docs/configuration.md`` is that output), and ``lazytrain train --help``
lists every key with its default and the first sentence of its documentation.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import json
import math
import re
import textwrap
import types
import typing
from typing import Literal

import yaml

from lazytrain.config import SECTIONS

REFERENCE_PATH = "docs/configuration.md"

_INTRO = """\
# Configuration reference

Every key LazyTrain reads, with its default. Set keys in a YAML file of sections:

```yaml
training:
  steps: 500
memory:
  gpu_gb: 40
```

or on the command line as `section.key=value`, after the file if there is one
(`lazytrain train my.yaml training.steps=500 memory.gpu_gb=40`; the command line wins). A value
is read as YAML: `[a, b]` is a list, `null` leaves a key unset (its automatic choice). An unknown
key or a value of the wrong type is an error that names the key.

This page is generated from the docstrings in `src/lazytrain/config.py` by
`lazytrain config --write docs/configuration.md`: edit those, not this page
(`tests/test_config_reference.py` checks that it is current).
"""


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of the dataclass ``cls`` (and of its dataclass bases),
    read from the source."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        for node, after in itertools.pairwise(body):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)):
                docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def section_doc(cls: type) -> str:
    """The class docstring of a config section (a dataclass without one gets a generated
    signature as ``__doc__``, which is not documentation)."""
    doc = cls.__dict__.get("__doc__") or ""
    return "" if doc.startswith(cls.__name__ + "(") else inspect.cleandoc(doc)


def type_text(hint: object) -> str:
    """A type as a user writes its values: ``int``, ``auto | bf16 | fp32``, ``float or null``."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        text = " or ".join(type_text(a) for a in options)
        return f"{text} or null" if len(options) < len(typing.get_args(hint)) else text
    if typing.get_origin(hint) is Literal:
        return " | ".join(str(choice) for choice in typing.get_args(hint))
    if typing.get_origin(hint) is tuple:
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            return f"list of {type_text(args[0])}"
        return f"list of {len(args)} {type_text(args[0])}"
    return getattr(hint, "__name__", str(hint))


def value_text(value: object) -> str:
    """``value`` as it is written in YAML or after ``section.key=``."""
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(value_text(v) for v in value) + "]"
    if isinstance(value, str) and not value.isprintable():
        return json.dumps(value)  # "\n" escaped: YAML reads JSON's double-quoted strings alike
    return yaml.safe_dump(value, default_flow_style=True, width=math.inf).removesuffix("\n...\n").strip()


def keys() -> list[tuple[str, str, str, str]]:
    """Every key as (``section.key``, type, default, documentation), in the config's order."""
    rows = []
    for section, cls in SECTIONS.items():
        docs, hints = field_docs(cls), typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            rows.append((f"{section}.{f.name}", type_text(hints[f.name]), value_text(f.default),
                         docs.get(f.name, "")))
    return rows


def reference_markdown() -> str:
    """The whole reference, as ``docs/configuration.md`` holds it."""
    out = [_INTRO]
    rows = keys()
    for section, cls in SECTIONS.items():
        out += [f"## {section}", ""]
        if section_doc(cls):
            out += [section_doc(cls), ""]
        for key, type_, default, doc in rows:
            if key.split(".")[0] == section:
                out += [f"### `{key}`", "", f"{type_}; default `{default}`", ""]
                out += [doc, ""] if doc else []
    return "\n".join(out).rstrip() + "\n"


def first_sentence(doc: str) -> str:
    """The first sentence of ``doc`` on one line (the whole of it when it has one)."""
    text = " ".join(doc.split()).replace("``", "`")
    match = re.search(r"(?<=\.)\s+(?=[A-Z0-9(`])", text)
    return text[: match.start()] if match else text


def help_listing(sections: tuple[str, ...] | None = None, width: int = 100) -> str:
    """Every key of ``sections`` (default: all) as ``section.key=default`` and the first
    sentence of its documentation (at most three lines): the epilog of ``lazytrain train --help``."""
    lines = []
    for key, _, default, doc in keys():
        if sections is None or key.split(".")[0] in sections:
            lines.append(f"  {key}={default}")
            lines += textwrap.wrap(first_sentence(doc), width, initial_indent=" " * 6, subsequent_indent=" " * 6,
                                   max_lines=3, placeholder=" ...", break_on_hyphens=False)
    return "\n".join(lines)

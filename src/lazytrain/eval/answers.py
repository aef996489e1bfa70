"""Final-answer extraction and exact match, MetaMath style.

The answer is what follows the last ``"The answer is:"`` (MetaMathQA) or ``"####"``
(GSM8K) on its line. Two answers match when both read as numbers and are equal as exact
fractions (``"1,000"`` = ``"1000"``, ``"2.50"`` = ``"2.5"``, ``"3/4"`` = ``"0.75"``,
``"$5"`` = ``"5"``); otherwise when their stripped texts are equal.
"""

from __future__ import annotations

import re
from collections import defaultdict
from fractions import Fraction

_MARKER = re.compile(r"the answer is:|####", re.IGNORECASE)
# A number as written in an answer: optional sign and currency, thousands separators,
# decimals, a simple fraction, or a percentage sign after it.
_NUMBER = re.compile(
    r"[-+]?\s*\$?\s*(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+)?(?:\s*/\s*\d+)?%?"
)
_LATEX_FRACTION = re.compile(r"^(-?)\\[dt]?frac\{(-?\d+)\}\{(-?\d+)\}$")
_BOXED = re.compile(r"^\\boxed\{(.*)\}\.?$")


def extract_answer(text: str) -> str | None:
    """The answer after the last marker, up to the end of its line, or None.

    A leading number is taken alone (``"42 apples."`` -> ``"42"``); other answers
    (``"\\frac{1}{2}"``, ``"(2, 3)"``) are kept whole, less a trailing period.
    """
    markers = list(_MARKER.finditer(text))
    if not markers:
        return None
    rest = text[markers[-1].end():].split("\n", 1)[0].strip().replace("\u2212", "-")
    rest = _BOXED.sub(r"\1", rest)
    number = _NUMBER.match(rest)
    if number and any(ch.isdigit() for ch in number.group()):
        return number.group().strip()
    rest = rest.rstrip(".").strip()
    return rest or None


def normalize_answer(answer: str | None) -> str | None:
    """A canonical form: numbers as integers, terminating decimals or ``p/q``; else the text."""
    if answer is None:
        return None
    text = answer.strip().replace("\u2212", "-").rstrip(".").strip()
    value = _as_number(text)
    if value is None:
        return text or None
    if value.denominator == 1:
        return str(value.numerator)
    denominator = value.denominator
    for factor in (2, 5):
        while denominator % factor == 0:
            denominator //= factor
    if denominator != 1:
        return f"{value.numerator}/{value.denominator}"
    # A terminating decimal: exact, without trailing zeros.
    digits = 0
    while (value * 10**digits).denominator != 1:
        digits += 1
    scaled = str(abs(value.numerator * 10**digits // value.denominator)).rjust(digits + 1, "0")
    return f"{'-' if value < 0 else ''}{scaled[:-digits]}.{scaled[-digits:]}"


def _as_number(text: str) -> Fraction | None:
    latex = _LATEX_FRACTION.match(text.replace(" ", ""))
    if latex:
        sign, numerator, denominator = latex.groups()
        text = f"{sign}{numerator}/{denominator}"
    cleaned = re.sub(r"[\s$%]", "", text).removeprefix("+")
    if "," in cleaned:
        if not re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", cleaned):
            return None  # a list or a pair, not a thousands separator
        cleaned = cleaned.replace(",", "")
    if not re.fullmatch(r"-?(\d+(\.\d+)?|\.\d+)(/-?\d+)?", cleaned):
        return None
    try:
        return Fraction(cleaned)
    except ZeroDivisionError:
        return None


def answers_match(pred: str | None, gold: str | None) -> bool:
    """Whether two extracted answers are the same (see the module docstring)."""
    pred, gold = normalize_answer(pred), normalize_answer(gold)
    return pred is not None and pred == gold


def exact_match_report(preds: list[str], golds: list[str],
                       types: list[str | None] | None = None) -> dict:
    """Exact match of generated texts against gold answers, overall and per type.

    ``preds`` are model outputs (the answer is extracted); each gold is a bare answer or a
    full response with a marker, whose answer is then extracted. Untyped samples count
    under ``"none"``.
    """
    types = types if types is not None else [None] * len(preds)
    if not len(preds) == len(golds) == len(types):
        raise ValueError(f"exact match needs one gold and type per prediction, got "
                         f"{len(preds)} predictions, {len(golds)} golds, {len(types)} types")
    if not preds:
        raise ValueError("exact match of no predictions; evaluate at least one sample")
    def zero() -> dict[str, int]:
        return {"n": 0, "correct": 0, "no_answer": 0}

    overall, per_type = zero(), defaultdict(zero)
    for pred, gold, kind in zip(preds, golds, types, strict=True):
        answer = extract_answer(pred)
        gold_answer = extract_answer(gold) if _MARKER.search(gold) else gold
        for count in (overall, per_type["none" if kind is None else kind]):
            count["n"] += 1
            count["correct"] += answers_match(answer, gold_answer)
            count["no_answer"] += answer is None
    return {**_rates(overall), "per_type": {k: _rates(v) for k, v in sorted(per_type.items())}}


def _rates(count: dict[str, int]) -> dict:
    return {**count, "accuracy": count["correct"] / count["n"],
            "no_answer_rate": count["no_answer"] / count["n"]}

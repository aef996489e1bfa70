"""Built-in synthetic arithmetic word problems in MetaMathQA form (the embedded default data).

Each record is ``{"query", "response", "type"}``: a short word problem, a step-by-step
response whose last line is ``"The answer is: N"``, and the tier name. Generation is
deterministic from ``(split, n, seed, tier, length_mix)``.

``length_mix="metamathqa"`` pads each record with filler sentences (before the question, and
as lines before the response's steps) to a MetaMathQA-like length: a log-normal spread of
characters (= tokens of the built-in tokenizer) with median ``MIX_MEDIAN_CHARS``, 40% of the
filler in the question and 60% in the response. The problems are the same as without it.

The ``train`` and ``heldout`` splits never share a problem: a problem's canonical arithmetic
(``"23+45"``, operands of commutative operations sorted) is hashed, and the hash alone puts it
in one split, whatever its wording or operand order, for every tier and seed. Sets mixed
together must use the same ``heldout_fraction``.
"""

from __future__ import annotations

import hashlib
import math
import operator
import random
from dataclasses import dataclass

from lazytrain.data.formats import DataError, Sample

SPLITS = ("train", "heldout")
MIN_OPERAND = 2

_NAMES = ("Tom", "Anna", "Sam", "Maria", "Ben", "Lily", "Omar", "Zoe")
_ITEMS = ("apples", "books", "marbles", "stickers", "coins", "pencils", "cards", "shells")

# Word templates per problem kind; {a} {b} {c} are the operands in the order the response
# uses them.
_WORDINGS = {
    "add": (
        "{name} has {a} {item} and buys {b} more. How many now?",
        "{name} had {a} {item} and found {b} more. How many in all?",
        "A box has {a} {item} and a bag {b}. How many in total?",
        "{name} read {a} pages, then {b} more. How many pages in all?",
        "What is {a} plus {b}?",
    ),
    "sub": (
        "{name} has {a} {item} and gives away {b}. How many are left?",
        "{name} had {a} {item} and lost {b}. How many {item} now?",
        "A shelf held {a} {item} and {b} were sold. How many remain?",
        "What is {a} minus {b}?",
    ),
    "mul": (
        "{name} buys {a} bags with {b} {item} each. How many {item}?",
        "There are {a} boxes of {b} {item}. How many {item} in all?",
        "What is {a} times {b}?",
    ),
    "add_sub": (
        "{name} has {a} {item}, buys {b} and gives away {c}. How many are left?",
        "A box had {a} {item}; {b} were added and {c} taken out. How many now?",
    ),
    "mul_add": (
        "{name} buys {a} packs of {b} {item} and finds {c} more. How many in all?",
        "What is {a} times {b} plus {c}?",
    ),
}
KINDS = tuple(_WORDINGS)
LENGTH_MIXES = ("short", "metamathqa")
MIX_MEDIAN_CHARS = 300
"""Median length of a ``metamathqa`` record, question and response together."""
MIX_SIGMA = 0.5
"""Log-normal sigma of the ``metamathqa`` lengths. Whole filler sentences overshoot the drawn
length a little: measured, the median record is ~350 characters, 90% are within 190-760 and
about 1% are past 1000 (a few hundred tokens, varied, like MetaMathQA)."""

_QUESTION_FILLER = (
    "{name} keeps the {item} in a box by the window.",
    "Some of the {item} are red and some are blue.",
    "It was a sunny afternoon after school.",
    "{name} likes to count things carefully.",
    "The {item} came from the market in town.",
    "Nobody else in the class had any {item} that day.",
    "{name} wrote every number down on a sheet of paper.",
    "A friend watched and asked a few questions.",
)
_RESPONSE_FILLER = (
    "Let us read the question again carefully.",
    "We write down each number that the question gives.",
    "{name} starts with some {item}, and the question says what changes.",
    "We work it out one step at a time.",
    "Each step uses the result of the step before it.",
    "We check that every number from the question is used.",
)


@dataclass(frozen=True, kw_only=True, slots=True)
class Tier:
    """A difficulty level: which kinds of problem, how large the numbers, how the steps read."""

    name: str
    kinds: tuple[str, ...]
    """Problem kinds, drawn uniformly: add | sub | mul | add_sub (a+b-c) | mul_add (a*b+c)."""
    min_operand: int = MIN_OPERAND
    """Smallest operand of additions and subtractions, and of the large factor of products."""
    max_operand: int = 99
    """Largest operand of additions and subtractions, and of the large factor of products."""
    max_factor: int = 9
    """Largest small factor of products (the smallest is 2)."""
    place_value: bool = False
    """Write an addition ``a + b`` as three steps: the tens (and above) of a and b, their
    units, then the two partial sums. Every step is then a one-digit fact, which the tiniest
    models learn in minutes; the direct ``a + b = c`` makes them carry in one token. A
    subtraction ``a - b`` likewise: the tens' difference, the units' (negative when b's units are
    larger), then the tens' difference plus or minus the units' magnitude."""

    def __post_init__(self) -> None:
        if not self.kinds or any(kind not in KINDS for kind in self.kinds):
            raise DataError(f"tier {self.name!r}: kinds {self.kinds} must be a non-empty "
                            f"selection of {KINDS}")
        if not MIN_OPERAND <= self.min_operand <= self.max_operand:
            raise DataError(f"tier {self.name!r}: need {MIN_OPERAND} <= min_operand <= "
                            f"max_operand, got {self.min_operand} and {self.max_operand}")
        if self.max_factor < MIN_OPERAND:
            raise DataError(f"tier {self.name!r}: max_factor must be >= {MIN_OPERAND}, "
                            f"got {self.max_factor}")


TIERS = {
    tier.name: tier
    for tier in (
        Tier(name="add2", kinds=("add",), min_operand=10, place_value=True),
        Tier(name="addsub", kinds=("add", "sub")),
        Tier(name="mul", kinds=("mul",), max_operand=999),
        Tier(name="multi", kinds=("add_sub", "mul_add")),
        Tier(name="addsub2", kinds=("add", "sub"), min_operand=10, place_value=True),
    )
}
"""Built-in tiers. ``add2``, sums of two two-digit numbers worked out by place value, is the
default: a 2-4 layer character-level model learns it in minutes on a CPU, and it still has
to read the numbers out of varied wordings, add digits and carry. ``addsub2`` is ``add2`` with
subtractions of two-digit numbers in the same place-value form, half of its problems: a task to
fine-tune an ``add2`` model on that shares its format (``addsub``'s direct answers, on the same
wordings, replace the place-value steps and erase what the model learned)."""


# Per kind: the operator of the first step and of the second step (None: one step).
_OPERATORS = {"add": ("+", None), "sub": ("-", None), "mul": ("*", None),
              "add_sub": ("+", "-"), "mul_add": ("*", "+")}
_APPLY = {"+": operator.add, "-": operator.sub, "*": operator.mul}


@dataclass(frozen=True, slots=True)
class _Problem:
    kind: str
    operands: tuple[int, ...]

    def key(self) -> str:
        """The canonical arithmetic, equal for every wording and commutative reordering."""
        first, second = _OPERATORS[self.kind]
        a, b, *rest = self.operands
        if first != "-":
            a, b = sorted((a, b))
        return f"{a}{first}{b}" if second is None else f"({a}{first}{b}){second}{rest[0]}"

    def steps(self, place_value: bool) -> tuple[list[str], int]:
        """The response's equation lines and the answer."""
        first, second = _OPERATORS[self.kind]
        a, b, *rest = self.operands
        value = _APPLY[first](a, b)
        if self.kind == "add" and place_value:
            tens, units = a // 10 * 10 + b // 10 * 10, a % 10 + b % 10
            lines = [f"{a // 10 * 10} + {b // 10 * 10} = {tens}", f"{a % 10} + {b % 10} = {units}",
                     f"{tens} + {units} = {value}"]
        elif self.kind == "sub" and place_value:
            tens, units = a // 10 * 10 - b // 10 * 10, a % 10 - b % 10
            lines = [f"{a // 10 * 10} - {b // 10 * 10} = {tens}", f"{a % 10} - {b % 10} = {units}",
                     f"{tens} {'+' if units >= 0 else '-'} {abs(units)} = {value}"]
        else:
            lines = [f"{a} {first} {b} = {value}"]
        if second is not None:
            result = _APPLY[second](value, rest[0])
            lines.append(f"{value} {second} {rest[0]} = {result}")
            value = result
        return lines, value


def _draw(rng: random.Random, tier: Tier) -> _Problem:
    kind = rng.choice(tier.kinds)

    def operand() -> int:
        return rng.randint(tier.min_operand, tier.max_operand)

    def factor() -> int:
        return rng.randint(MIN_OPERAND, tier.max_factor)

    if kind == "add":
        return _Problem(kind, (operand(), operand()))
    if kind == "sub":
        a, b = operand(), operand()
        return _Problem(kind, (max(a, b), min(a, b)))
    if kind == "mul":
        return _Problem(kind, (factor(), operand()))
    if kind == "add_sub":
        a, b = operand(), operand()
        return _Problem(kind, (a, b, rng.randint(1, a + b)))
    return _Problem(kind, (factor(), operand(), operand()))


def split_of(key: str, heldout_fraction: float) -> str:
    """The split a canonical problem belongs to, from a hash of it alone."""
    digest = hashlib.sha256(key.encode()).digest()
    return "heldout" if int.from_bytes(digest[:8], "big") / 2**64 < heldout_fraction else "train"


def _record(problem: _Problem, rng: random.Random, tier: Tier, filler: random.Random | None) -> dict:
    wording = rng.choice(_WORDINGS[problem.kind])
    a, b, *rest = problem.operands
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    query = wording.format(name=name, item=item, a=a, b=b, c=rest[0] if rest else "")
    lines, answer = problem.steps(tier.place_value)
    response = "\n".join([*lines, f"The answer is: {answer}"])
    if filler is not None:  # a MetaMathQA-like length (its own stream: the problems stay the same)
        extra = max(0, round(filler.lognormvariate(math.log(MIX_MEDIAN_CHARS), MIX_SIGMA))
                    - len(query) - len(response))
        before = _filler(filler, round(0.4 * extra), _QUESTION_FILLER, name, item)
        steps = _filler(filler, extra - round(0.4 * extra), _RESPONSE_FILLER, name, item)
        query = f"{before} {query}" if before else query
        response = f"{steps}\n{response}" if steps else response
    return {"query": query, "response": response, "type": tier.name}


def _filler(rng: random.Random, chars: int, sentences: tuple[str, ...], name: str, item: str) -> str:
    """Sentences drawn from ``sentences`` until they hold about ``chars`` characters."""
    text = ""
    while len(text) < chars:
        text = f"{text} {rng.choice(sentences).format(name=name, item=item)}".lstrip()
    return text


def make_split(split: str, n: int, seed: int = 0, tier: str | Tier = "add2",
               heldout_fraction: float = 0.2, length_mix: str = "short") -> list[dict]:
    """``n`` MetaMathQA-style records of ``split`` (train | heldout).

    ``train`` draws problems with replacement; ``heldout`` gives ``n`` distinct problems, so
    its accuracy is over ``n`` different sums. ``length_mix``: short | metamathqa (see the
    module docstring).
    """
    if split not in SPLITS:
        raise DataError(f"synthetic split {split!r} is not one of {SPLITS}")
    if length_mix not in LENGTH_MIXES:
        raise DataError(f"synthetic length_mix {length_mix!r} is not one of {LENGTH_MIXES}")
    if n < 1:
        raise DataError(f"synthetic set size must be >= 1, got {n}")
    if not 0.0 < heldout_fraction < 1.0:
        raise DataError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
    if isinstance(tier, str):
        if tier not in TIERS:
            raise DataError(f"unknown synthetic tier {tier!r}; choose one of {sorted(TIERS)}")
        tier = TIERS[tier]
    rng = random.Random(f"lazytrain-synthetic|{tier.name}|{split}|{seed}")
    filler = (random.Random(f"lazytrain-synthetic-length|{tier.name}|{split}|{seed}")
              if length_mix == "metamathqa" else None)
    records: list[dict] = []
    seen: set[str] = set()
    # Enough draws to find n distinct heldout problems whenever the tier has them; a small
    # tier asked for more than it holds stops here instead of looping forever.
    for _ in range(int(50 * n / heldout_fraction) + 100_000):
        problem = _draw(rng, tier)
        key = problem.key()
        if split_of(key, heldout_fraction) != split or (split == "heldout" and key in seen):
            continue
        seen.add(key)
        records.append(_record(problem, rng, tier, filler))
        if len(records) == n:
            return records
    raise DataError(f"tier {tier.name!r} has only about {len(records)} distinct heldout problems, "
                    f"{n} were asked for; ask for fewer or use a tier with larger numbers")


def make_samples(split: str, n: int, seed: int = 0, tier: str | Tier = "add2",
                 heldout_fraction: float = 0.2, length_mix: str = "short") -> list[Sample]:
    """`make_split` as `Sample` s, ready for tokenization."""
    return [Sample(instruction=r["query"], response=r["response"], type=r["type"])
            for r in make_split(split, n, seed, tier, heldout_fraction, length_mix)]

import re

import pytest

from lazytrain.data.dataset import tokenize_samples
from lazytrain.data.formats import DataError, Sample
from lazytrain.data.synthetic import TIERS, Tier, make_samples, make_split, split_of
from lazytrain.data.template import get_template
from lazytrain.data.tokenizer import builtin_tokenizer

_EQUATION = re.compile(r"^(\d+) ([-+*]) (\d+) = (-?\d+)$")
_OPS = {"+": int.__add__, "-": int.__sub__, "*": int.__mul__}


def _read(record: dict) -> tuple[str, int]:
    """The problem's canonical arithmetic (commutative operands sorted) and its answer,
    read from the query's numbers and the response's operators."""
    operands = [int(n) for n in re.findall(r"\d+", record["query"])]
    *lines, _ = record["response"].split("\n")
    first = _EQUATION.match(lines[0]).group(2)
    a, b, *rest = operands
    value = _OPS[first](a, b)
    if first != "-":
        a, b = sorted((a, b))
    key = f"{a}{first}{b}"
    if rest:
        second = _EQUATION.match(lines[-1]).group(2)
        value = _OPS[second](value, rest[0])
        key = f"({key}){second}{rest[0]}"
    return key, value


@pytest.mark.parametrize("tier", sorted(TIERS))
def test_records_are_metamathqa_with_correct_arithmetic(tier):
    for record in make_split("train", 300, seed=1, tier=tier):
        assert set(record) == {"query", "response", "type"}
        assert record["type"] == tier
        assert len(record["query"]) < 80 and len(record["response"]) < 60
        *lines, last = record["response"].split("\n")
        for line in lines:
            a, op, b, result = _EQUATION.match(line).groups()
            assert _OPS[op](int(a), int(b)) == int(result)
        _, answer = _read(record)
        assert answer >= 0 and int(lines[-1].split(" = ")[1]) == answer
        assert last == f"The answer is: {answer}"


def test_default_tier_works_by_place_value():
    record = make_split("train", 1)[0]
    a, b = (int(n) for n in re.findall(r"\d+", record["query"]))
    tens, units = a // 10 * 10 + b // 10 * 10, a % 10 + b % 10
    assert record["response"] == (f"{a // 10 * 10} + {b // 10 * 10} = {tens}\n"
                                  f"{a % 10} + {b % 10} = {units}\n{tens} + {units} = {a + b}\n"
                                  f"The answer is: {a + b}")
    assert all(10 <= int(n) <= 99 for r in make_split("train", 500)
               for n in re.findall(r"\d+", r["query"]))


def test_addsub2_subtracts_by_place_value_in_add2s_form():
    records = make_split("train", 400, seed=2, tier="addsub2")
    subs = [r for r in records if r["response"].split("\n")[0].split()[1] == "-"]
    adds = [r for r in records if r not in subs]
    assert 120 < len(subs) < 280 and all(len(r["response"].split("\n")) == 4 for r in records)
    borrowed = 0
    for r in subs:
        a, b = sorted((int(n) for n in re.findall(r"\d+", r["query"])), reverse=True)
        units = a % 10 - b % 10
        borrowed += units < 0
        last = f"{a // 10 * 10 - b // 10 * 10} {'+' if units >= 0 else '-'} {abs(units)} = {a - b}"
        assert r["response"] == (f"{a // 10 * 10} - {b // 10 * 10} = {a // 10 * 10 - b // 10 * 10}\n"
                                 f"{a % 10} - {b % 10} = {units}\n{last}\nThe answer is: {a - b}")
    assert borrowed > 30  # both forms of the last step occur
    # its additions are in add2's own place-value form
    for r in adds:
        a, b = (int(n) for n in re.findall(r"\d+", r["query"]))
        tens, units = a // 10 * 10 + b // 10 * 10, a % 10 + b % 10
        assert r["response"] == (f"{a // 10 * 10} + {b // 10 * 10} = {tens}\n{a % 10} + {b % 10} = {units}\n"
                                 f"{tens} + {units} = {a + b}\nThe answer is: {a + b}")


@pytest.mark.parametrize("tier", sorted(TIERS))
def test_deterministic_from_seed(tier):
    assert make_split("train", 50, seed=3, tier=tier) == make_split("train", 50, seed=3, tier=tier)
    assert make_split("train", 50, seed=3, tier=tier) != make_split("train", 50, seed=4, tier=tier)


@pytest.mark.parametrize("tier", sorted(TIERS))
def test_train_and_heldout_never_share_a_problem(tier):
    train = {_read(r)[0] for seed in (0, 1)
             for r in make_split("train", 2000, seed=seed, tier=tier)}
    heldout = [_read(r)[0] for r in make_split("heldout", 300, tier=tier)]
    assert not train & set(heldout)
    assert len(set(heldout)) == len(heldout), "heldout problems are distinct"
    assert all(split_of(key, 0.2) == "heldout" for key in heldout)


def test_same_problem_any_wording_or_order_same_split():
    assert split_of("23+45", 0.2) == split_of("23+45", 0.2)
    records = make_split("train", 3000, tier="add2") + make_split("heldout", 500, tier="add2")
    by_problem: dict[str, set[str]] = {}
    for r in records:
        by_problem.setdefault(_read(r)[0], set()).add(r["query"])
    assert any(len(queries) > 1 for queries in by_problem.values()), "several wordings occur"


def test_heldout_fraction_is_roughly_respected():
    keys = [f"{a}+{b}" for a in range(10, 100) for b in range(a, 100)]
    share = sum(split_of(k, 0.2) == "heldout" for k in keys) / len(keys)
    assert 0.17 < share < 0.23


def test_custom_tier_and_samples():
    tier = Tier(name="add3", kinds=("add",), max_operand=999)
    samples = make_samples("heldout", 20, tier=tier)
    assert all(isinstance(s, Sample) and s.type == "add3" for s in samples)
    assert any(len(s.response.split(" ")[0]) == 3 for s in samples)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"split": "test", "n": 5}, "not one of"),
    ({"split": "train", "n": 0}, ">= 1"),
    ({"split": "train", "n": 5, "tier": "nope"}, "unknown synthetic tier"),
    ({"split": "train", "n": 5, "heldout_fraction": 1.0}, "heldout_fraction"),
    ({"split": "heldout", "n": 500, "tier": Tier(name="tiny", kinds=("add",), max_operand=9)},
     "distinct heldout problems"),
])
def test_bad_requests(kwargs, message):
    with pytest.raises(DataError, match=message):
        make_split(**kwargs)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"kinds": ("div",)}, "kinds"),
    ({"kinds": ()}, "kinds"),
    ({"kinds": ("add",), "min_operand": 1}, "min_operand"),
    ({"kinds": ("add",), "min_operand": 50, "max_operand": 40}, "min_operand"),
    ({"kinds": ("mul",), "max_factor": 1}, "max_factor"),
])
def test_bad_tier(kwargs, message):
    with pytest.raises(DataError, match=message):
        Tier(name="x", **kwargs)


@pytest.mark.parametrize("tier", sorted(TIERS))
def test_fits_the_default_max_seq_len_with_the_compact_template(tier):
    dataset = tokenize_samples(make_samples("train", 2000, tier=tier), builtin_tokenizer(),
                               get_template("compact"), max_seq_len=128)
    assert dataset.report.truncated == 0 and dataset.report.longest <= 128


@pytest.mark.parametrize("tier", ["add2", "multi"])
def test_metamathqa_length_mix_keeps_the_problems_and_spreads_the_lengths(tier):
    short = make_split("train", 1000, seed=2, tier=tier)
    mixed = make_split("train", 1000, seed=2, tier=tier, length_mix="metamathqa")
    for s, m in zip(short, mixed):  # the same problem and steps; the filler has no digits
        assert m["response"].endswith(s["response"])
        assert _read({"query": m["query"], "response": s["response"]}) == _read(s)
    lengths = sorted(len(r["query"]) + len(r["response"]) for r in mixed)
    # a few hundred tokens of the built-in tokenizer (one a character), varied
    assert 300 <= lengths[500] <= 400 and lengths[50] < 220 and lengths[950] > 650
    assert sum(n > 1024 for n in lengths) < 30
    assert make_split("train", 50, seed=2, tier=tier, length_mix="metamathqa") == mixed[:50]
    with pytest.raises(DataError, match="length_mix"):
        make_split("train", 5, length_mix="long")

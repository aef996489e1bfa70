import pytest

from lazytrain.eval.answers import (
    answers_match,
    exact_match_report,
    extract_answer,
    normalize_answer,
)


@pytest.mark.parametrize(("text", "answer"), [
    ("23 + 45 = 68\nThe answer is: 68", "68"),
    ("The answer is: 68</s>", "68"),
    ("The answer is: -5", "-5"),
    ("The answer is: \u22125", "-5"),
    ("The answer is: 1,000", "1,000"),
    ("The answer is: 1,000, which is a lot", "1,000"),
    ("The answer is: 3/4", "3/4"),
    ("The answer is: 2.50.", "2.50"),
    ("The answer is: $12.", "$12"),
    ("The answer is: 42 apples.\nMore text", "42"),
    ("The answer is: 7 The answer is: 8", "8"),
    ("The answer is: 7\nThe answer is: 9\n", "9"),
    ("the ANSWER is:12", "12"),
    ("Natalia sold 48/2 = 24 clips.\n#### 72", "72"),
    ("#### 1,234", "1,234"),
    ("The answer is: \\frac{1}{2}.", "\\frac{1}{2}"),
    ("The answer is: \\boxed{17}.", "17"),
    ("The answer is: (2, 3)", "(2, 3)"),
    ("The answer is: B.", "B"),
    ("The answer is 68", None),  # MetaMath's marker has the colon
    ("68", None),
    ("", None),
    ("The answer is:\n68", None),
    ("The answer is:   ", None),
])
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


@pytest.mark.parametrize(("answer", "normal"), [
    ("68", "68"), ("068", "68"), ("+7", "7"), ("-5", "-5"), ("-0", "0"),
    ("1,000", "1000"), ("1,234,567.5", "1234567.5"), ("$1,000.00", "1000"),
    ("2.50", "2.5"), ("2.0", "2"), ("12.00", "12"), (".5", "0.5"), ("-0.25", "-0.25"),
    ("3/4", "0.75"), ("6/8", "0.75"), ("1/3", "1/3"), ("-2/6", "-1/3"), ("4/2", "2"),
    ("\\frac{3}{4}", "0.75"), ("-\\frac{1}{3}", "-1/3"), ("50%", "50"),
    ("3/0", "3/0"), ("1,00", "1,00"), ("(2, 3)", "(2, 3)"), ("x = 5.", "x = 5"),
    ("", None), ("  ", None), (None, None),
])
def test_normalize_answer(answer, normal):
    assert normalize_answer(answer) == normal


@pytest.mark.parametrize(("pred", "gold", "match"), [
    ("68", "68", True), ("1,000", "1000", True), ("2.50", "2.5", True), ("3/4", "0.75", True),
    ("$5", "5", True), ("-5", "5", False), ("68", "86", False), ("B", "B", True),
    ("b", "B", False), (None, "5", False), (None, None, False), ("0.333", "1/3", False),
])
def test_answers_match(pred, gold, match):
    assert answers_match(pred, gold) is match


def test_exact_match_report():
    preds = ["The answer is: 5", "The answer is: 1,000.", "I don't know", "The answer is: 7.0",
             "#### 3"]
    golds = ["5", "1000", "4", "x = 7\nThe answer is: 7", "4"]
    types = ["add", "add", "sub", None, "sub"]
    report = exact_match_report(preds, golds, types)
    assert (report["n"], report["correct"], report["no_answer"]) == (5, 3, 1)
    assert report["accuracy"] == pytest.approx(0.6) and report["no_answer_rate"] == 0.2
    assert report["per_type"] == {
        "add": {"n": 2, "correct": 2, "no_answer": 0, "accuracy": 1.0, "no_answer_rate": 0.0},
        "none": {"n": 1, "correct": 1, "no_answer": 0, "accuracy": 1.0, "no_answer_rate": 0.0},
        "sub": {"n": 2, "correct": 0, "no_answer": 1, "accuracy": 0.0, "no_answer_rate": 0.5},
    }
    assert exact_match_report(preds[:1], golds[:1])["per_type"] == {
        "none": {"n": 1, "correct": 1, "no_answer": 0, "accuracy": 1.0, "no_answer_rate": 0.0}}


@pytest.mark.parametrize(("preds", "golds", "types", "message"), [
    (["a"], ["a", "b"], None, "1 predictions, 2 golds"),
    (["a"], ["a"], [None, None], "2 types"),
    ([], [], None, "no predictions"),
])
def test_exact_match_report_errors(preds, golds, types, message):
    with pytest.raises(ValueError, match=message):
        exact_match_report(preds, golds, types)

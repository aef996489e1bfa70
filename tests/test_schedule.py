"""The learning-rate schedule, pinned to values worked out by hand: linear warm-up, cosine decay
to optimizer.min_lr_ratio * lr, the floor after the last step, and constant."""

from __future__ import annotations

import math

import pytest

from lazytrain.train.schedule import learning_rate


def test_warmup_then_cosine_to_the_floor():
    # 10 steps, 2 of warm-up, floor 0.25 * 1e-3: the cosine runs over steps 2..10
    def lr(step: int) -> float:
        return learning_rate(step, 10, 1e-3, warmup_steps=2, schedule="cosine", min_lr_ratio=0.25)

    assert [lr(0), lr(1)] == [5e-4, 1e-3]  # (step + 1) / warmup of the peak
    assert lr(2) == 1e-3  # the decay starts at the peak
    # a quarter of the way: floor + (peak - floor) * (1 + cos(pi / 4)) / 2
    assert lr(4) == pytest.approx(2.5e-4 + 7.5e-4 * (1 + math.sqrt(0.5)) / 2, rel=1e-12)
    assert lr(6) == pytest.approx(6.25e-4, rel=1e-12)  # half way: the mean of peak and floor
    assert lr(8) == pytest.approx(2.5e-4 + 7.5e-4 * (1 - math.sqrt(0.5)) / 2, rel=1e-12)
    assert [lr(10), lr(11), lr(50)] == [2.5e-4] * 3  # the floor, and it stays there


def test_floor_of_zero_and_no_warmup():
    def lr(step: int) -> float:
        return learning_rate(step, 10, 1e-3, warmup_steps=0, schedule="cosine", min_lr_ratio=0.0)

    assert lr(0) == 1e-3
    assert lr(5) == pytest.approx(5e-4, rel=1e-12)
    assert lr(10) == pytest.approx(0.0, abs=1e-18)


def test_constant_after_warmup_ignores_the_floor():
    def lr(step: int) -> float:
        return learning_rate(step, 10, 1e-3, warmup_steps=4, schedule="constant", min_lr_ratio=0.25)

    assert [lr(s) for s in range(4)] == [2.5e-4, 5e-4, 7.5e-4, 1e-3]
    assert [lr(4), lr(9), lr(20)] == [1e-3] * 3


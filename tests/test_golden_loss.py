"""The built-in default's first steps against a committed loss curve: any change to the data,
model, executor or optimizer math shows here. To rewrite the curve after an intended change:
``python tests/golden_loss.py`` (this test never writes it)."""

from __future__ import annotations

import pytest
from golden_loss import STEPS, first_losses, read_golden


def test_builtin_default_first_steps_match_the_golden_curve(tmp_path):
    golden = read_golden()
    assert len(golden) == STEPS
    assert first_losses(tmp_path / "run") == pytest.approx(golden, rel=1e-4)
    assert golden[-1] < golden[0] * 0.8  # the curve itself learns

"""The built-in default's first steps against a committed loss curve (as torchtitan keeps in
``tests/assets/losses``): any change to the data, model, executor or optimizer math shows here.

To regenerate after an intended change: ``LAZYTRAIN_WRITE_GOLDEN=1 python -m pytest
tests/test_golden_loss.py`` and commit the file with the reason.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lazytrain.config import load_config
from lazytrain.train.trainer import Trainer

GOLDEN = Path(__file__).parent / "assets" / "losses" / "builtin_default.txt"
STEPS = 25


def test_builtin_default_first_steps_match_the_golden_curve(tmp_path):
    # the default run (training.steps of schedule), stopped after its first STEPS steps
    trainer = Trainer(load_config(None, [f"training.output_dir={tmp_path}", "training.progress=false"]))
    trainer.setup()
    trainer._step_start = 0.0
    losses = [trainer.train_step(next(trainer.batches))["loss"] for _ in range(STEPS)]
    trainer.updater.finish()
    if os.environ.get("LAZYTRAIN_WRITE_GOLDEN"):
        GOLDEN.write_text("".join(f"{step + 1} {loss:.6f}\n" for step, loss in enumerate(losses)))
    golden = [float(line.split()[1]) for line in GOLDEN.read_text().splitlines()]
    assert len(golden) == STEPS
    assert losses == pytest.approx(golden, rel=1e-4)
    assert golden[-1] < golden[0] * 0.8  # the curve itself learns

"""The built-in default's first losses, and the command that rewrites their committed curve
(``tests/assets/losses``, as torchtitan keeps one). After an intended change to the data, model,
executor or optimizer math:

    python tests/golden_loss.py

then commit the file with the reason. Writing is this script's alone: the test only compares.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

GOLDEN = Path(__file__).parent / "assets" / "losses" / "builtin_default.txt"
STEPS = 25


def first_losses(out_dir: Path) -> list[float]:
    """The losses of the default run's (training.steps of its schedule) first ``STEPS`` steps."""
    from lazytrain.config import load_config
    from lazytrain.train.trainer import Trainer

    trainer = Trainer(load_config(None, [f"training.output_dir={out_dir}", "training.progress=false"]))
    trainer.setup()
    trainer._step_start = 0.0
    losses = [trainer.train_step(next(trainer.batches))["loss"] for _ in range(STEPS)]
    trainer.updater.finish()
    return losses


def read_golden() -> list[float]:
    return [float(line.split()[1]) for line in GOLDEN.read_text().splitlines()]


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        losses = first_losses(Path(tmp) / "run")
    GOLDEN.write_text("".join(f"{step + 1} {loss:.6f}\n" for step, loss in enumerate(losses)))
    print(f"wrote {GOLDEN}: {losses[0]:.6f} -> {losses[-1]:.6f} over {STEPS} steps")


if __name__ == "__main__":
    main()

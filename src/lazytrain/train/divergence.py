"""Steps skipped for a non-finite loss or gradient, and when that becomes a diverged run."""

from __future__ import annotations

import logging

from lazytrain.errors import LazyTrainError

log = logging.getLogger(__name__)


class DivergedError(LazyTrainError, ArithmeticError):
    """Too many consecutive steps with a non-finite loss or gradient."""


class SkipCounter:
    """A skipped step touches no state; ``limit`` of them in a row stop the run."""

    def __init__(self, limit: int):
        self.limit = limit
        self.total = 0
        self.in_a_row = 0

    def update(self, skipped: bool) -> None:
        self.total += skipped
        self.in_a_row = self.in_a_row + 1 if skipped else 0

    @property
    def diverged(self) -> bool:
        return self.in_a_row >= self.limit

    def report(self, record: dict, lr: float, max_grad_norm: float, checkpoint: str | None) -> None:
        """Log the skipped step of ``record``; raise `DivergedError` once the run diverged.
        ``checkpoint`` names the checkpoint that survives (None: none was written, so there is
        nothing to resume and the advice is to train again with other settings)."""
        log.warning("step %d skipped: loss %s, grad_norm %s (%d in a row, the run stops at %d)",
                    record["step"], record["loss"], record["grad_norm"], self.in_a_row, self.limit)
        if not self.diverged:
            return
        clip = (f"lower training.max_grad_norm (now {max_grad_norm:g})" if max_grad_norm
                else "clip gradients (training.max_grad_norm=1.0; it is 0, off)")
        if checkpoint is None:
            kept = "no checkpoint was written"
            then = ("train again with training.overwrite=true (the folder holds this run's metrics; there is "
                    "no checkpoint to resume from)")
        else:
            kept = f"the last checkpoint, {checkpoint}, is kept"
            then = "resume from it with training.resume=true, or train again with training.overwrite=true"
        raise DivergedError(
            f"{self.in_a_row} consecutive steps (to step {record['step']}) had a non-finite loss or "
            f"gradient (last: loss {record['loss']}, grad_norm {record['grad_norm']}); the run diverged "
            f"at optimizer.lr={lr:g}: {kept} and the model was not written. Lower optimizer.lr (e.g. "
            f"optimizer.lr={lr / 10:g}) or {clip}, then {then}"
        )

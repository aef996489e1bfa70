"""Learning-rate schedule: linear warmup, then cosine decay or constant."""

from __future__ import annotations

import math


def learning_rate(step: int, total_steps: int, peak: float, warmup_steps: int, schedule: str,
                  min_lr_ratio: float) -> float:
    """LR of optimizer step ``step`` (0-based)."""
    if warmup_steps > 0 and step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    if schedule == "constant":
        return peak
    decay_steps = max(total_steps - warmup_steps, 1)
    progress = min(max(step - warmup_steps, 0) / decay_steps, 1.0)
    floor = peak * min_lr_ratio
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

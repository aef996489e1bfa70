"""The CPU optimizer from its config section: the one place that maps ``optimizer.kind`` to a class."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from lazytrain.config import QUANTIZED_KINDS
from lazytrain.optim.base import HostOptimizer

if TYPE_CHECKING:
    from lazytrain.config import OptimizerConfig


def fp32_state_groups(config: OptimizerConfig, num_groups: int) -> tuple[int, ...]:
    """Groups whose states stay fp32 under hybrid8bit or hybrid4bit: the embedding (first) and final
    (last) ones."""
    return (0, num_groups - 1) if config.fp32_embedding_states else ()


def state_bytes_per_param(config: OptimizerConfig, numels: list[int]) -> float:
    """Host bytes of optimizer state per parameter, for groups of ``numels`` elements."""
    from lazytrain.memory.budget import optimizer_bytes_per_param

    return optimizer_bytes_per_param(config.kind, numels, fp32_state_groups(config, len(numels)))


def describe(optimizer: HostOptimizer) -> str:
    """What a cost table's ``optimizer_ns_per_param`` was timed on: the kind, and for 8-bit
    states how sqrt(v) is rounded (``hybrid8bit/stochastic``: ~28% more CPU time)."""
    kind = optimizer.state_dict()["kind"]
    rounding = getattr(optimizer, "rounding", None)
    return f"{kind}/{rounding}" if rounding else kind


def describe_config(config: OptimizerConfig, rounding: str) -> tuple[str, int | None]:
    """`describe` of the optimizer `make_optimizer` makes from ``config`` and ``rounding``, and
    the elements per piece of its GPU step (`HostOptimizer.device_step_chunk`), without making
    one (8-bit states load the C++ kernel, a minute when it is built)."""
    if config.kind == "hybrid4bit":
        from lazytrain.optim.hybrid4bit import PIECE_4BIT

        return f"hybrid4bit/{rounding}", PIECE_4BIT.chunk()
    if config.kind != "hybrid8bit":
        return config.kind, None
    from lazytrain.optim.hybrid8bit import PIECE_8BIT

    return f"hybrid8bit/{rounding}", PIECE_8BIT.chunk()


def make_optimizer(
    config: OptimizerConfig, masters: list[torch.Tensor], decay_numel: list[int],
    group_numels: list[int] | None = None, group_offsets: list[int] | None = None, seed: int = 0,
    rounding: str | None = None,
) -> HostOptimizer:
    """The optimizer of ``config.kind`` over the flat fp32 master groups; ``group_numels`` are
    the whole groups' sizes when the masters are a data-parallel rank's shards, and
    ``group_offsets`` where those shards start; ``seed`` keys stochastic rounding; ``rounding``:
    ``Config.state_rounding()`` (``config.state_rounding`` when that is not auto)."""
    rounding = rounding or config.state_rounding
    if rounding == "auto" and config.kind in QUANTIZED_KINDS:
        raise ValueError("optimizer.state_rounding=auto depends on the model (Config.state_rounding); "
                         "pass rounding=config.state_rounding() or set nearest / stochastic")
    if config.kind in QUANTIZED_KINDS:
        from lazytrain.optim.hybrid4bit import Hybrid4bitAdamW
        from lazytrain.optim.hybrid8bit import Hybrid8bitAdamW

        kind = Hybrid8bitAdamW if config.kind == "hybrid8bit" else Hybrid4bitAdamW
        return kind(masters, decay_numel, config,
                    fp32_groups=fp32_state_groups(config, len(masters)), group_numels=group_numels,
                    group_offsets=group_offsets, rounding=rounding, seed=seed)
    from lazytrain.optim.adamw import FusedAdamW

    return FusedAdamW(masters, decay_numel, config, seed=seed)

"""Per-rank checkpoint files of a data-parallel run, and the world-size check on resume.

Every rank writes its own shard of the fp32 masters and of the optimizer state into the
one checkpoint folder (which must be on a filesystem all hosts see); rank 0 writes the
shared ``state.json`` (step, data position) with the world size. A checkpoint is resumed
with the world size it was written with: the shards are element ranges that depend on it.
"""

from __future__ import annotations

from pathlib import Path

from lazytrain.errors import LazyTrainError


class CheckpointError(LazyTrainError, ValueError):
    pass


def shard_file_names(rank: int, world_size: int) -> tuple[str, str]:
    """The masters and optimizer-state files of ``rank`` (the single-process names at world size 1)."""
    if world_size == 1:
        return "masters.safetensors", "optimizer.pt"
    suffix = f"rank{rank:05d}-of-{world_size:05d}"
    return f"masters-{suffix}.safetensors", f"optimizer-{suffix}.pt"


def check_world_size(state: dict, world_size: int, ckpt: Path) -> None:
    saved = int(state.get("world_size", 1))
    if saved != world_size:
        raise CheckpointError(
            f"checkpoint {ckpt} holds the shards of {saved} ranks, this run has {world_size}; "
            f"resume with {saved} ranks (torchrun --nproc-per-node/--nnodes), or start a new "
            "training.output_dir"
        )

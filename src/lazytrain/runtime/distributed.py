"""Data parallelism on torch.distributed: who this process is, and the collectives a step needs.

``torchrun`` starts one process per GPU and sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE`` and ``GROUP_RANK`` (the host's index); the process group starts from
those (``env://``), NCCL on CUDA and gloo on the CPU. Every rank runs the single-GPU step on
its slice of the global batch; what changes (DESIGN.md section 5):

- the loss of each rank is its sum over target tokens divided by the *global* target count
  (one all-reduce of two integers per step), so the ranks' gradients sum to exactly the
  single-process gradient of the global batch;
- each group's flat gradient is reduce-scattered on the device before it crosses PCIe, so
  a rank brings back only its shard (gloo: all-reduce and slice, since ``reduce_scatter`` is
  not implemented by gloo on every torch version this package supports);
- the loss and the squared gradient norm are summed across ranks, so clipping is exact;
- the CPU optimizer's per-group exchange (``publish_group``) runs on a separate gloo group
  from a worker thread, so its collectives never interleave with the step's.
"""

from __future__ import annotations

import logging
import os
import uuid
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from lazytrain.errors import LazyTrainError
from lazytrain.memory.shard import ShardedHostStore, shard_range

if TYPE_CHECKING:
    from lazytrain.data.dataset import Batch

log = logging.getLogger(__name__)


class DistributedError(LazyTrainError, RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class RankInfo:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int

    @property
    def is_main(self) -> bool:
        """Rank 0 writes logs, metrics, the config and the HF model folder."""
        return self.rank == 0

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.local_world_size

    def node_of(self, rank: int) -> int:
        """The host of ``rank`` (torchrun numbers ranks host by host)."""
        return rank // self.local_world_size


def rank_info_from_env() -> RankInfo | None:
    """The torchrun environment of this process, or None when it was not launched by one."""
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        return None
    try:
        world = int(os.environ["WORLD_SIZE"])
        rank = int(os.environ["RANK"])
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        node = int(os.environ.get("GROUP_RANK", rank // max(local_world, 1)))
    except ValueError as error:
        raise DistributedError(f"torchrun environment is not numeric ({error}); launch with torchrun") from None
    if world < 1 or not 0 <= rank < world or not 0 <= local_rank < local_world or world % local_world:
        raise DistributedError(
            f"inconsistent torchrun environment: RANK={rank} WORLD_SIZE={world} LOCAL_RANK={local_rank} "
            f"LOCAL_WORLD_SIZE={local_world} (every host must run the same --nproc-per-node)"
        )
    return RankInfo(rank, world, local_rank, local_world, node)


def local_batch_size(global_batch: int, world_size: int) -> int:
    if global_batch % world_size:
        raise DistributedError(
            f"training.batch_size={global_batch} (the global batch) does not split over {world_size} "
            f"ranks; use a multiple of {world_size}"
        )
    return global_batch // world_size


class DataParallel:
    """The process group of a torchrun launch and the collectives of one data-parallel step."""

    def __init__(self, info: RankInfo, device: torch.device):
        self.info = info
        self.device = device
        if not dist.is_initialized():
            backend = "nccl" if device.type == "cuda" else "gloo"
            kwargs = {"device_id": device} if device.type == "cuda" else {}
            dist.init_process_group(backend, init_method="env://", **kwargs)
        if dist.get_world_size() != info.world_size or dist.get_rank() != info.rank:
            raise DistributedError("the process group does not match RANK/WORLD_SIZE of the environment")
        self.backend = dist.get_backend()
        # host-side synchronisation (the optimizer's per-group exchange, barriers around files):
        # its own group, so a worker thread's collectives never interleave with the step's
        self.cpu_group = dist.new_group(backend="gloo")
        # the step's host-side integers (token counts): known on the CPU, so summed there,
        # without a device round trip; a group of their own for the same reason
        self.count_group = dist.new_group(backend="gloo")
        name = [uuid.uuid4().hex[:12] if info.rank == 0 else None]
        dist.broadcast_object_list(name, src=0, group=self.cpu_group)
        self.run_id: str = name[0]
        if info.local_world_size > 1:
            # the host's ranks share its cores: each one's optimizer and intra-op pool gets its
            # part (torchrun would leave each rank one thread: OMP_NUM_THREADS=1)
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
            torch.set_num_threads(max(1, cores // info.local_world_size))

    @property
    def world_size(self) -> int:
        return self.info.world_size

    @property
    def rank(self) -> int:
        return self.info.rank

    def barrier(self) -> None:
        dist.barrier(group=self.cpu_group)

    def all_agree(self, ok: bool) -> bool:
        """Whether ``ok`` on every rank (a barrier that also tells each rank whether another
        failed: a rank that raises alone would leave the others in the next collective)."""
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return bool(flag.item())

    def sum_counts(self, values: list[int]) -> list[int]:
        """Integers summed over ranks (the global token counts of a step)."""
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, group=self.count_group)
        return [int(v) for v in t]

    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed over ranks, in place (a device tensor with NCCL)."""
        if self.backend == "nccl":
            dist.all_reduce(tensor)
            return tensor
        host = tensor.cpu()
        dist.all_reduce(host)
        tensor.copy_(host)
        return tensor

    def reduce_scatter(self, flat: torch.Tensor) -> tuple[torch.Tensor, dist.Work | None]:
        """This rank's chunk of ``flat`` summed over ranks; ``flat`` holds ``world_size`` equal chunks.

        With NCCL the collective is asynchronous: the returned work must be waited on (on the
        stream that reads the chunk) before the chunk is read.
        """
        world, rank = self.info.world_size, self.info.rank
        chunk = flat.numel() // world
        if world == 1:
            return flat, None
        if self.backend == "nccl":
            out = torch.empty(chunk, dtype=flat.dtype, device=flat.device)
            work = dist.reduce_scatter_tensor(out, flat, async_op=True)
            return out, work
        dist.all_reduce(flat)
        return flat[rank * chunk : (rank + 1) * chunk], None

    def all_gather_cpu(self, chunk: torch.Tensor) -> torch.Tensor:
        """Every rank's equal-sized CPU ``chunk``, concatenated in rank order (host-side group)."""
        out = torch.empty(chunk.numel() * self.info.world_size, dtype=chunk.dtype)
        parts = list(out.chunk(self.info.world_size))
        dist.all_gather(parts, chunk.contiguous(), group=self.cpu_group)
        return out

    def publish(self, store: ShardedHostStore, group: int) -> None:
        """After this rank wrote its updated shard of ``group`` into its host's weights: make
        every rank's shard of it visible to this host's ranks (called by each rank's optimizer
        thread, group by group, so the next forward of a layer waits only for that layer).

        On one host the arena is shared, so a barrier is enough. Across hosts the shards are
        all-gathered and each remote shard is written by one local rank, then a barrier.
        """
        info = self.info
        if info.num_nodes > 1:
            own = store.ranges[group]
            chunk = torch.zeros(own.chunk, dtype=store.dtype)
            chunk[: own.numel] = store.weight_shard(group)
            gathered = self.all_gather_cpu(chunk)
            weights = store.weights[group]
            for q in range(info.world_size):
                if info.node_of(q) == info.node_rank or q % info.local_world_size != info.local_rank:
                    continue
                r = shard_range(weights.numel(), info.world_size, q)
                weights[r.start : r.stop] = gathered[q * r.chunk : q * r.chunk + r.numel]
        self.barrier()

    def local_rows(self, batch: Batch) -> Batch:
        """This rank's rows of a global ``Batch`` (rank r takes rows r*B/N .. (r+1)*B/N)."""
        rows = local_batch_size(batch.input_ids.shape[0], self.info.world_size)
        lo, hi = self.info.rank * rows, (self.info.rank + 1) * rows
        mask = batch.attention_mask[lo:hi]
        labels = batch.labels[lo:hi]
        return replace(
            batch,
            input_ids=batch.input_ids[lo:hi],
            labels=labels,
            attention_mask=mask,
            num_tokens=int(mask.sum()),
            num_target_tokens=int((labels[:, 1:] != -100).sum()),  # -100: no loss (as the executor reads it)
            indices=batch.indices[lo:hi],
            position_ids=None if batch.position_ids is None else batch.position_ids[lo:hi],
            document_ids=None if batch.document_ids is None else batch.document_ids[lo:hi],
        )

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

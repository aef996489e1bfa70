"""Host state of one data-parallel rank: the host's shared weights, this rank's 1/N of the rest.

With N ranks (torchrun, one per GPU) the bf16 streaming weights exist once per host, in one
arena that every local rank maps (a file in ``shm_dir`` that local rank 0 creates and
unlinks once everyone has mapped it, so nothing is left behind), each rank page-locking it
with cudaHostRegister. The fp32 masters, the gradient buffers and (through the optimizer,
which only ever sees the shard masters) the optimizer states are split by element range of
each group's flat buffer: rank r owns ``[r * chunk, (r + 1) * chunk)`` where ``chunk`` is
the group size over N rounded up to ``SHARD_ALIGN`` elements. That alignment is the 8-bit
optimizer's block size, so a shard's blocks are exactly the unsharded run's blocks and the
8-bit states quantise identically; it also gives every rank an equal chunk, which is what
the reduce-scatter of the padded flat gradient needs.

The class offers what the executor and the optimizer updater use of ``HostStore``
(``weights``, ``grads``, ``masters``, ``dtype``, ``layouts``, ``num_params``, ``set_param``,
``sync_weights_from_masters``, ``bytes``), with ``grads`` and ``masters`` holding shards.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from lazytrain.memory.host_store import (
    HostBytes,
    HostGradients,
    HostMemoryError,
    check_part,
    host_memory_total,
    pin_in_place,
)
from lazytrain.model.adapter import GroupLayout

SHARD_ALIGN = 128
"""Shard boundaries fall on multiples of this many elements (the 8-bit block, ``optim.quant.BLOCK``)."""


@dataclass(frozen=True, slots=True)
class ShardRange:
    """Rank's elements ``[start, stop)`` of a group; every rank's chunk is ``chunk`` long (padded)."""

    start: int
    stop: int
    chunk: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


def shard_range(numel: int, world_size: int, rank: int, align: int = SHARD_ALIGN) -> ShardRange:
    chunk = -(-numel // world_size)
    chunk = -(-chunk // align) * align
    start = min(rank * chunk, numel)
    return ShardRange(start, min(start + chunk, numel), chunk)


def shard_decay_numel(decay_numel: int, r: ShardRange) -> int:
    """Elements of shard ``r`` that take weight decay (a group's decayed elements come first)."""
    return min(max(decay_numel - r.start, 0), r.numel)


class SharedArena:
    """``numel`` elements of ``dtype`` that all ranks of a host map at once.

    With one local rank it is private memory. Otherwise local rank 0 creates ``path``, every
    rank maps it between two calls of ``barrier`` (which must synchronise the host's ranks),
    and local rank 0 unlinks it: the mappings keep the memory until the last rank exits.
    """

    def __init__(
        self, path: Path, numel: int, dtype: torch.dtype, local_rank: int, local_world_size: int,
        barrier: Callable[[], None],
    ):
        self.path = path
        nbytes = numel * dtype.itemsize
        self.nbytes = nbytes
        self._map: mmap.mmap | None = None
        if local_world_size == 1:
            self.tensor = torch.empty(numel, dtype=dtype)
            return
        if local_rank == 0:
            free = os.statvfs(path.parent)
            if free.f_bavail * free.f_frsize < nbytes:
                raise HostMemoryError(
                    f"shared weights: {nbytes / 2**30:.1f} GiB are needed in {path.parent}, "
                    f"{free.f_bavail * free.f_frsize / 2**30:.1f} GiB are free there; enlarge it "
                    "(docker: --shm-size) or set memory.shm_dir to a larger tmpfs"
                )
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.ftruncate(fd, max(nbytes, 1))
            os.close(fd)
        barrier()
        try:
            fd = os.open(path, os.O_RDWR)
            try:
                self._map = mmap.mmap(fd, max(nbytes, 1), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
        finally:
            barrier()
            if local_rank == 0:
                path.unlink()
        self.tensor = torch.frombuffer(self._map, dtype=dtype, count=numel)


class ShardedHostStore(HostGradients):
    """Shared streaming weights plus this rank's shards of masters and gradients (``defer_grads``:
    the gradient shards wait for `allocate_grads`, as `HostStore`'s buffers)."""

    def __init__(
        self,
        layouts: list[GroupLayout],
        dtype: torch.dtype,
        *,
        rank: int,
        world_size: int,
        local_rank: int,
        local_world_size: int,
        arena_path: Path,
        barrier: Callable[[], None],
        pin: bool = True,
        optimizer_bytes_per_param: float = 8.0,
        host_limit_bytes: int | None = None,
        defer_grads: bool = False,
    ):
        self.layouts = layouts
        self.dtype = dtype
        self.rank, self.world_size = rank, world_size
        self.local_rank, self.local_world_size = local_rank, local_world_size
        sizes = [g.numel for g in layouts]
        self.num_params = sum(sizes)
        self.ranges = [shard_range(n, world_size, rank) for n in sizes]
        owned = sum(r.numel for r in self.ranges)
        esize = dtype.itemsize
        # what this host holds: one weight copy, and each local rank's shards (~1/N each)
        host_need = self.num_params * esize + local_world_size * owned * (4 + esize + optimizer_bytes_per_param)
        limit = host_limit_bytes or int(host_memory_total() * 0.95)
        if host_need > limit:
            raise HostMemoryError(
                f"host memory: {local_world_size} ranks on this host need {host_need / 2**30:.1f} GiB "
                f"(one weight copy {self.num_params * esize / 2**30:.1f}, and per rank a 1/{world_size} "
                f"shard of masters, gradients and optimizer state), {limit / 2**30:.1f} GiB is usable; "
                "use optimizer.kind=hybrid8bit, more hosts, or a smaller model"
            )
        self.arena = SharedArena(arena_path, self.num_params, dtype, local_rank, local_world_size, barrier)
        self.pinned_bytes = 0
        if pin and pin_in_place(self.arena.tensor):
            self.pinned_bytes += self.arena.tensor.numel() * self.arena.tensor.element_size()
        self.weights: list[torch.Tensor] = []
        offset = 0
        for n in sizes:
            self.weights.append(self.arena.tensor[offset : offset + n])
            offset += n
        self._init_grads([r.numel for r in self.ranges], pin, defer_grads)
        self.masters = [torch.empty(r.numel, dtype=torch.float32) for r in self.ranges]
        self.master_mode = "fp32"  # a rank's masters are fp32 shards
        self.split_master = self.weights_are_masters = False
        self.carried: dict[str, torch.Tensor] = {}
        self.build_seconds: dict[str, float] = {}
        """Seconds the build took per phase (`model.build.build_model` and the session fill it)."""
        """Checkpoint tensors outside the trained model (a vision tower), as in `HostStore`."""

    @property
    def pinned(self) -> bool:
        return self.pinned_bytes > 0

    def weight_shard(self, group: int) -> torch.Tensor:
        """This rank's elements of ``group``'s shared weights (where its optimizer writes)."""
        r = self.ranges[group]
        return self.weights[group][r.start : r.stop]

    def set_param(self, group: int, name: str, value: torch.Tensor, start: int = 0) -> None:
        """Write one parameter (or its part from element ``start`` on, as `HostStore.set_param`):
        this rank's part into its master shard; local rank 0 also writes the whole of ``value``
        into the shared weights (every rank calls this with the same values)."""
        layout = self.layouts[group]
        for p in layout.params:
            if p.name != name:
                continue
            check_part(layout, p, value, start)
            flat = value.reshape(-1).to(device="cpu", dtype=torch.float32)
            first = p.offset + start
            r = self.ranges[group]
            lo, hi = max(first, r.start), min(first + flat.numel(), r.stop)
            if lo < hi:
                self.masters[group][lo - r.start : hi - r.start].copy_(flat[lo - first : hi - first])
            if self.local_rank == 0:
                self.weights[group][first : first + flat.numel()].copy_(flat)
            return
        raise KeyError(f"{layout.hf_prefix}{name} is not a parameter of group {layout.name}")

    def master_fp32(self, group: int) -> torch.Tensor:
        """This rank's fp32 shard of ``group``'s master."""
        return self.masters[group]

    def sync_weights_from_masters(self, group: int) -> None:
        """This rank's shard of the shared weights from its masters (the other shards are
        their owners' to write)."""
        self.weight_shard(group).copy_(self.masters[group])

    def bytes(self, optimizer_state_bytes: int = 0) -> HostBytes:
        """This rank's host bytes; the shared weights count 1/local_world_size to each rank."""
        return HostBytes(
            weights=self.arena.nbytes // self.local_world_size,
            masters=sum(m.numel() * 4 for m in self.masters),
            grads=self._grad_bytes(),
            optimizer=optimizer_state_bytes,
            pinned=self.pinned_bytes,
            num_params=self.num_params,
        )

"""Host memory for the whole model: pinned streaming weights, fp32 masters, pinned gradients.

Per parameter group (see ``model.adapter``) there is one flat weight buffer in the compute dtype
(what crosses PCIe), one flat master, and one flat gradient buffer in the compute dtype (what
comes back), unless the plan holds that group's gradient on the GPU (`LayerPlan.grad`): those
come home through a small pinned ring instead (`GRAD_RING_SLOTS`). The gradient buffers can wait
for the first plan (``defer_grads``, `HostStore.allocate_grads`), which is made after the store
exists (the profiler times layers on it). The master's form is ``master`` (``memory.master``,
``optim/master.py``): ``fp32``; ``split`` (bf16 compute only): the streamed bf16 weight is its
high half and an int16 remainder its low half (``optim/split.py``), 2 bytes per parameter
instead of 4, reconstructed exactly by the optimizers; ``bf16`` (bf16 compute only): the
streamed weight is the master, 0 bytes more, updated with stochastic rounding (not exact).
`master_fp32` and `load_master_fp32` give and take the fp32 master in every form (checkpoints,
exports): exact for fp32 and split, for bf16 the weight widened, and a loaded fp32 value rounded
to the nearest bf16. Weights and gradients are views into two large arenas that are
pinned once (page-locked in place, so the allocator's power-of-two rounding never applies),
which is what makes every H2D/D2H copy asynchronous and full speed.
"""

from __future__ import annotations

import itertools
import logging
import os
import weakref
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from lazytrain.errors import LazyTrainError
from lazytrain.model.adapter import GroupLayout, ParamSlot, UnsupportedModelError
from lazytrain.optim.master import MASTER_BYTES, MASTER_MODES, Bf16Master, Master
from lazytrain.optim.split import SplitMaster

log = logging.getLogger(__name__)


class HostMemoryError(LazyTrainError, MemoryError):
    pass


def host_memory_total() -> int:
    """Bytes of RAM this process may use: MemTotal, or the cgroup limit if lower."""
    total = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    total = int(line.split()[1]) * 1024
    except OSError:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                raw = f.read().strip()
        except OSError:
            continue
        if raw.isdigit() and 0 < int(raw) < total:
            total = int(raw)
    return total


def pin_in_place(t: torch.Tensor, owner: torch.Tensor | None = None) -> bool:
    """Page-lock ``t``'s memory with cudaHostRegister (no copy, no rounding: torch's pinned
    allocator would round each allocation up to a power of two). Unregistered when ``owner``
    (default: ``t``'s base, or ``t``) is freed, so the address can be pinned again: ``owner``
    must be the Python tensor that lives as long as the memory is copied from or to. ``t``
    must not share a page with another pinned range. False (nothing done) without CUDA.

    The owner is explicit because a tensor's Python object can die while its memory is still
    used: a dtype view (``x.view(torch.bfloat16)``) keeps the storage but not ``x._base``, so
    a finalizer on the base fired as soon as `memory.nvme.aligned_empty` returned such a view,
    and every activation-store buffer ran unpinned: 7.7 GB/s to the GPU and 14.6 back, against
    52-53 for pinned memory however it was allocated or touched
    (`bench/results/pinned_copy_2026-12-01.md`), and a Qwen2.5-7B step with 40 GB of host-tier
    activations took 14.5 s where 6.6 s was planned.
    """
    if not torch.cuda.is_available() or t.numel() == 0:
        return False
    if not t.is_contiguous():
        raise ValueError("pin_in_place needs a contiguous tensor (it page-locks one address range)")
    cudart = torch.cuda.cudart()
    nbytes = t.numel() * t.element_size()
    err = cudart.cudaHostRegister(t.data_ptr(), nbytes, 0)
    code = int(err) if not isinstance(err, tuple) else int(err[0])
    if code != 0:
        raise HostMemoryError(
            f"pinning {nbytes / 2**30:.1f} GiB of host memory failed (cudaHostRegister error "
            f"{code}); the memlock limit (`ulimit -l`, or the container's) may be too low: raise "
            "it, or set memory.pin=false (transfers then run at pageable speed)"
        )
    if owner is None:
        owner = t if t._base is None else t._base
    # not at exit: the process's memory goes anyway, and unpinning 100 GB takes seconds
    weakref.finalize(owner, cudart.cudaHostUnregister, t.data_ptr()).atexit = False
    return True


def host_memory_available() -> int | None:
    """What can be allocated without swapping: the machine's MemAvailable, or within a cgroup
    limit (a container) what the limit leaves, if less (its usage less its inactive file
    pages, which the kernel reclaims first); None if unknown."""
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        pass
    group = _cgroup_available()
    if group is not None:
        available = group if available is None else min(available, group)
    return available


def _cgroup_available(root: str = "/sys/fs/cgroup") -> int | None:
    """``memory.max`` less ``memory.current`` plus ``inactive_file`` (cgroup v2), or None
    without a limit."""
    try:
        with open(f"{root}/memory.max") as f:
            limit = f.read().strip()
        with open(f"{root}/memory.current") as f:
            current = int(f.read().strip())
        inactive = 0
        with open(f"{root}/memory.stat") as f:
            for line in f:
                if line.startswith("inactive_file "):
                    inactive = int(line.split()[1])
    except (OSError, ValueError):
        return None
    if not limit.isdigit():  # "max": no limit
        return None
    return max(int(limit) - current + inactive, 0)


HOST_RESERVE_FRACTION = 0.05
HOST_RESERVE_MIN = 4 * 2**30
"""Host memory left out of the default budget: the process itself (torch, CUDA context,
Python), the page cache, other processes. 5% of RAM, at least 4 GiB."""

HOST_HEADROOM_FRACTION = 0.04
HOST_HEADROOM_MIN = 4 * 2**30
"""Host memory the plan leaves free *now* (`activation_room`): what the process may still grow
by while it trains (batches, Python objects, the CUDA host allocator's cache) and what the
kernel needs beside page-locked memory (its page tables, the GPU driver's mappings). On the
H200 machine (135.1 GB) a run whose plan filled the 5% reserve's budget was killed by the
kernel at 132.5 GB resident (2026-12-03). 4% of RAM, at least 4 GiB."""

HOST_FLOOR_BYTES = 2 * 2**30
"""What a new pinned buffer must leave available (`check_available`); below it the kernel's
out-of-memory killer is near, which stops the process without a word (and a host whose memory
fills can stop answering)."""


def host_headroom() -> int:
    total = host_memory_total()
    return max(int(total * HOST_HEADROOM_FRACTION), HOST_HEADROOM_MIN)


def activation_room(state_bytes: int, limit: int | None = None, ranks: int = 1, staging: int = 0,
                    pending: int = 0) -> int:
    """Host bytes one process may pin for activations: its share of what the budget (``limit``,
    default `default_host_limit`) leaves after its ``state_bytes`` of model state, and no more
    than its share of what the machine has available now less `host_headroom`, less its
    ``staging`` buffers (the NVMe tier's, pinned when the step runs). ``ranks``: the
    processes on this host that train together (data parallel), each planning its own
    activations. The second bound counts what the budget's
    components do not: the processes' own memory (torch, the CUDA context, the data), other
    processes, the kernel. Called once every rank's model state is allocated, so the
    available memory no longer includes it; ``pending``: the bytes of ``state_bytes`` not
    allocated yet (all of it before the store is built, ``lazytrain plan``; the gradient buffers
    a first plan will allocate), which come off the available memory too."""
    room = (limit or default_host_limit()) // ranks - state_bytes
    available = host_memory_available()
    if available is not None:
        room = min(room, (available - host_headroom()) // ranks - pending)
    return max(room - staging, 0)


def check_available(nbytes: int, what: str) -> None:
    """Raise `HostMemoryError` if allocating ``nbytes`` more would leave less than
    `HOST_FLOOR_BYTES` available on the machine (checked before a new pinned buffer)."""
    available = host_memory_available()
    if available is None or available - nbytes >= HOST_FLOOR_BYTES:
        return
    raise HostMemoryError(
        f"host memory: {what} needs {nbytes / 2**30:.2f} GiB more, and the machine has "
        f"{available / 2**30:.2f} GiB available (keeping {HOST_FLOOR_BYTES / 2**30:.0f} GiB free so the "
        "kernel does not kill the process): lower memory.host_limit_gb so the plan puts fewer "
        "activations on the host, free memory held by other processes, or set memory.nvme_dir")


def default_host_limit() -> int:
    """The host bytes LazyTrain plans for without ``memory.host_limit_gb``: RAM (or the cgroup
    limit) minus the reserve."""
    total = host_memory_total()
    return max(total - max(int(total * HOST_RESERVE_FRACTION), HOST_RESERVE_MIN), total // 2)


def master_bytes(master: str) -> int:
    """Host bytes per parameter of a master of form ``master`` beside the streamed weight: fp32
    4, split 2 (the remainder), bf16 0 (the weight is the master)."""
    if master not in MASTER_BYTES:
        raise ValueError(f"master form {master!r} is not one of {list(MASTER_MODES)} (memory.master)")
    return MASTER_BYTES[master]


GRAD_RING_SLOTS = 2
"""Pinned host slots through which the gradients the plan holds on the GPU (`LayerPlan.grad`)
come home, one layer at a time in the update order, for the CPU worker's step
(`runtime.update`). Two: the CPU step of one layer reads one slot while the next layer's
gradient is copied into the other, and a copy at PCIe speed (2 bytes per parameter at tens of
GB/s) is much shorter than the CPU step of the same layer (which reads and writes its master and
states, 4-8 bytes per parameter, on a few cores), so a third slot would add pinned bytes and hide
nothing more. Each slot is the size of the largest such layer's gradient."""


def grad_ring_bytes(largest_numel: int, dtype: torch.dtype) -> int:
    """Pinned bytes of the gradient ring for held gradients of at most ``largest_numel``
    elements of ``dtype`` (0: none held)."""
    return GRAD_RING_SLOTS * largest_numel * dtype.itemsize


@dataclass(slots=True)
class HostBytes:
    weights: int
    masters: int
    """fp32 masters, with a split master their int16 remainders, with a bf16 master nothing."""
    grads: int
    """The host gradient buffers and the pinned ring that brings GPU-held gradients home."""
    optimizer: int
    pinned: int
    num_params: int

    @property
    def total(self) -> int:
        return self.weights + self.masters + self.grads + self.optimizer

    def per_param(self) -> dict[str, float]:
        n = max(self.num_params, 1)
        return {
            "weights": self.weights / n,
            "masters": self.masters / n,
            "grads": self.grads / n,
            "optimizer": self.optimizer / n,
            "total": self.total / n,
        }

    @classmethod
    def predict(
        cls, num_params: int, dtype: torch.dtype, master: str, optimizer_bytes_per_param: float,
        host_grad_numel: int | None = None, ring_numel: int = 0,
    ) -> HostBytes:
        """What a `HostStore` of ``num_params``, masters of form ``master`` (fp32, split or bf16)
        and its optimizer will hold. ``host_grad_numel``: the elements of the groups with a host
        gradient buffer (default: every group's, as when no gradient is held on the GPU);
        ``ring_numel``: the largest gradient held on the GPU (its ring, `grad_ring_bytes`; 0:
        none)."""
        esize = dtype.itemsize
        grads = (num_params if host_grad_numel is None else host_grad_numel) * esize
        grads += grad_ring_bytes(ring_numel, dtype)
        return cls(
            weights=num_params * esize,
            masters=num_params * master_bytes(master),
            grads=grads,
            optimizer=int(num_params * optimizer_bytes_per_param),
            pinned=num_params * esize + grads,
            num_params=num_params,
        )

    def describe(self) -> str:
        gib = 2**30
        return (
            f"weights {self.weights / gib:.2f}, masters {self.masters / gib:.2f}, gradients "
            f"{self.grads / gib:.2f}, optimizer {self.optimizer / gib:.2f} GiB "
            f"({self.total / max(self.num_params, 1):.2f} B/param)"
        )


class HostGradients:
    """The host gradient buffers of a store (`HostStore`; a data-parallel rank's
    `ShardedHostStore`, whose buffers are its shards): one pinned arena for the groups that
    get a buffer, and the pinned ring that brings the others' gradients, held on the GPU by the
    plan (`LayerPlan.grad`), home for the CPU step."""

    dtype: torch.dtype
    pinned_bytes: int

    def _init_grads(self, sizes: list[int], pin: bool, defer: bool) -> None:
        """``sizes``: each group's gradient elements; ``defer``: no buffer until `allocate_grads`."""
        self._grad_sizes = list(sizes)
        self._pin = pin
        self.grads: list[torch.Tensor | None] = [None] * len(sizes)
        """Per group, its pinned host gradient buffer; None for a group without one (its
        gradient held on the GPU: `host_grad_groups`), and for every group until
        `allocate_grads`."""
        self.host_grad_groups: frozenset[int] | None = None
        """The groups with a host gradient buffer (None: not allocated yet, ``defer_grads``). A
        plan may hold any group's gradient on the GPU, but may send to the host only these
        (`Executor` raises `PlanError` otherwise): the planner's re-plans keep to them."""
        self._grad_arena: torch.Tensor | None = None
        self._ring: list[torch.Tensor] = []
        self._ring_pinned = False
        if not defer:
            self.allocate_grads(range(len(sizes)))

    @property
    def grad_sizes(self) -> list[int]:
        """Each group's gradient elements (this process's: a rank's shard under data parallel)."""
        return list(self._grad_sizes)

    def allocate_grads(self, groups: Iterable[int]) -> None:
        """Give ``groups`` (group indices) their pinned host gradient buffers, views of one arena
        sized for them only, once; the others' gradients can only be held on the GPU, so the
        ring that brings them home is pinned now too, sized for the largest of them
        (`grad_ring`)."""
        sizes = self._grad_sizes
        groups = frozenset(groups)
        if self.host_grad_groups is not None:
            raise ValueError(f"the host gradient buffers are allocated already (groups "
                             f"{sorted(self.host_grad_groups)}); allocate_grads is called once")
        bad = sorted(g for g in groups if not 0 <= g < len(sizes))
        if bad:
            raise ValueError(f"groups {bad} do not exist: this model has groups 0..{len(sizes) - 1}")
        arena = torch.empty(sum(sizes[g] for g in groups), dtype=self.dtype)
        if self._pin and pin_in_place(arena):
            self.pinned_bytes += arena.numel() * arena.element_size()
        else:
            # resident now (pinning does it otherwise): the memory available when a plan is
            # made (`activation_room`) must not still count the gradients' pages
            arena.zero_()
        offset = 0
        for g in sorted(groups):
            self.grads[g] = arena[offset : offset + sizes[g]]
            offset += sizes[g]
        self._grad_arena, self.host_grad_groups = arena, groups
        held = [sizes[g] for g in range(len(sizes)) if g not in groups]
        if held:
            self.grad_ring(max(held))

    def grad_ring(self, numel: int) -> list[torch.Tensor]:
        """The `GRAD_RING_SLOTS` pinned slots (``numel`` elements each, of one arena) that bring
        gradients held on the GPU home (`runtime.update`); made, or made larger, at the first
        call that needs it. Not to be called while an update still reads the slots."""
        if not self._ring or self._ring[0].numel() < numel:
            if self._ring_pinned:
                self.pinned_bytes -= self.ring_bytes  # unpinned when the old arena goes
            self._ring = []
            arena = torch.empty(GRAD_RING_SLOTS * numel, dtype=self.dtype)
            self._ring_pinned = self._pin and pin_in_place(arena)
            if self._ring_pinned:
                self.pinned_bytes += arena.numel() * arena.element_size()
            self._ring = list(arena.view(GRAD_RING_SLOTS, numel).unbind())
        return [slot[:numel] for slot in self._ring]

    @property
    def ring_bytes(self) -> int:
        """Bytes of the gradient ring now (0 until a gradient held on the GPU needs it)."""
        return sum(slot.numel() * slot.element_size() for slot in self._ring)

    def _grad_bytes(self) -> int:
        """The gradient buffers' bytes (before `allocate_grads`, every group's: the most a plan
        can ask for) and the ring's."""
        arena = self._grad_arena
        numel = arena.numel() if arena is not None else sum(self._grad_sizes)
        return numel * self.dtype.itemsize + self.ring_bytes


def check_part(layout: GroupLayout, param: ParamSlot, value: torch.Tensor, start: int) -> None:
    """``value`` is ``param`` whole (``start`` 0, its shape) or a part inside it from ``start``."""
    if start == 0 and value.numel() == param.numel:
        if tuple(value.shape) != param.shape:
            raise UnsupportedModelError(
                f"{layout.hf_prefix}{param.name}: shape {tuple(value.shape)} in the checkpoint, "
                f"{param.shape} in the model config")
    elif start < 0 or start + value.numel() > param.numel:
        raise UnsupportedModelError(
            f"{layout.hf_prefix}{param.name}: a part of shape {tuple(value.shape)} at element {start} in the "
            f"checkpoint does not fit its shape {param.shape} in the model config")


class HostStore(HostGradients):
    """Flat per-group host buffers for weights, fp32 masters and gradients.

    ``defer_grads``: no gradient buffer until `allocate_grads` names the groups that get one
    (the trainer, once the first plan is known: the groups whose gradients it does not hold on
    the GPU); meanwhile `bytes` counts every group's, the most a plan can ask for."""

    def __init__(
        self,
        layouts: list[GroupLayout],
        dtype: torch.dtype,
        pin: bool = True,
        optimizer_bytes_per_param: float = 8.0,
        host_limit_bytes: int | None = None,
        master: str = "fp32",
        defer_grads: bool = False,
    ):
        master_bytes(master)  # a known form, or a clear error
        if master != "fp32" and dtype != torch.bfloat16:
            raise ValueError(f"a {master} master needs bf16 streamed weights, got {dtype}")
        self.layouts = layouts
        self.dtype = dtype
        self.master_mode = master
        """fp32, split or bf16: the form of every group's master."""
        sizes = [g.numel for g in layouts]
        total = sum(sizes)
        # with deferred buffers the least a plan can ask: every decoder layer's gradient held on
        # the GPU (groups 1 .. n-2, as `budget.HostSettings.holding_layer_grads`), so a model that
        # fits only so is not refused before its first plan is made
        least = ({"host_grad_numel": sizes[0] + sizes[-1], "ring_numel": max(sizes[1:-1])}
                 if defer_grads and len(sizes) > 2 else {})
        need = HostBytes.predict(total, dtype, master, optimizer_bytes_per_param, **least)
        limit = host_limit_bytes or default_host_limit()
        if need.total > limit:
            raise HostMemoryError(
                f"host memory: the model needs {need.total / 2**30:.1f} GiB ({need.describe()}), "
                f"{limit / 2**30:.1f} GiB is usable; use optimizer.kind=hybrid8bit or hybrid4bit (about 2 or 1 "
                "B/param of state instead of 8), memory.master=split (bf16, exact) or bf16 (not exact), "
                "memory.gradients=auto (exact), or a smaller model"
            )
        self._weight_arena = torch.empty(total, dtype=dtype)
        self.pinned_bytes = 0
        if pin and pin_in_place(self._weight_arena):
            self.pinned_bytes += self._weight_arena.numel() * self._weight_arena.element_size()
        self.weights: list[torch.Tensor] = []
        offset = 0
        for n in sizes:
            self.weights.append(self._weight_arena[offset : offset + n])
            offset += n
        self._init_grads(sizes, pin, defer_grads)
        self.masters: list[Master]
        if master == "bf16":
            self.masters = [Bf16Master(w) for w in self.weights]
        elif master == "split":
            self._remainder_arena = torch.empty(total, dtype=torch.int16)
            self.masters = [
                SplitMaster(w, self._remainder_arena[off : off + n])
                for w, off, n in zip(self.weights, itertools.accumulate(sizes, initial=0), sizes)
            ]
        else:
            self.masters = [torch.empty(n, dtype=torch.float32) for n in sizes]
        self.num_params = total
        self._pinned_masters: set[int] = set()
        self.carried: dict[str, torch.Tensor] = {}
        self.build_seconds: dict[str, float] = {}
        """Seconds the build took per phase (`model.build.build_model` and the session fill it)."""
        """Checkpoint tensors outside the trained model (a vision tower), by HF name: loaded
        and saved unchanged, never streamed or stepped."""

    def pin_masters(self, groups: Iterable[int]) -> None:
        """Page-lock the masters of ``groups`` in place (split masters: the whole remainder
        arena, once; bf16 masters are the weights, pinned already), for a GPU step that copies
        them in and out asynchronously (`Plan.device_steps`); nothing without CUDA or with
        ``pin=False``."""
        if not self._pin or self.master_mode == "bf16":
            return
        for group in groups:
            if group in self._pinned_masters:
                continue
            if self.master_mode == "split":
                if pin_in_place(self._remainder_arena):
                    self.pinned_bytes += self._remainder_arena.numel() * self._remainder_arena.element_size()
                self._pinned_masters.update(range(len(self.masters)))
                return
            master = self.masters[group]
            if pin_in_place(master):
                self.pinned_bytes += master.numel() * master.element_size()
            self._pinned_masters.add(group)

    @property
    def pinned(self) -> bool:
        return self.pinned_bytes > 0

    @property
    def split_master(self) -> bool:
        return self.master_mode == "split"

    @property
    def weights_are_masters(self) -> bool:
        """The streamed weights hold the masters (split: their high halves; bf16: all of them), so
        a step writes them with the master and nothing else may."""
        return self.master_mode != "fp32"

    def set_param(self, group: int, name: str, value: torch.Tensor, start: int = 0) -> None:
        """Write one parameter (any dtype/device) into the master and the streaming weights; with
        ``start``, ``value`` is the part of it from that element on (one expert of a stacked
        tensor: `GroupLayout.hf_file_pieces`)."""
        layout = self.layouts[group]
        for p in layout.params:
            if p.name == name:
                check_part(layout, p, value, start)
                lo = p.offset + start
                hi = lo + value.numel()
                master = self.masters[group]
                if isinstance(master, SplitMaster):
                    SplitMaster(master.weight[lo:hi], master.remainder[lo:hi]).assign(value)
                    return
                if isinstance(master, Bf16Master):
                    Bf16Master(master.weight[lo:hi]).assign(value)
                    return
                master[lo:hi].copy_(value.reshape(-1))
                self.weights[group][lo:hi].copy_(master[lo:hi])
                return
        raise KeyError(f"{layout.hf_prefix}{name} is not a parameter of group {layout.name}")

    def sync_weights_from_masters(self, group: int) -> None:
        """Streamed weights from the fp32 master (a split master's weight already is one half, a
        bf16 master's the whole)."""
        master = self.masters[group]
        if isinstance(master, torch.Tensor):
            self.weights[group].copy_(master)

    def master_fp32(self, group: int) -> torch.Tensor:
        """The fp32 master of ``group``: the master itself (not to be written), or a new tensor:
        a split master's halves joined (exact), a bf16 master widened (exact: it is its value)."""
        master = self.masters[group]
        return master if isinstance(master, torch.Tensor) else master.fp32()

    def load_master_fp32(self, group: int, value: torch.Tensor) -> None:
        """Set ``group``'s master to the flat fp32 ``value`` and its streamed weights with it (a
        bf16 master: ``value`` rounded to the nearest bf16)."""
        master = self.masters[group]
        if value.numel() != master.numel() or value.dtype != torch.float32:
            raise ValueError(
                f"group {group}: master of {master.numel()} fp32 elements, got {value.dtype} "
                f"with {value.numel()}"
            )
        if isinstance(master, torch.Tensor):
            master.copy_(value.reshape(-1))
            self.weights[group].copy_(master)
        else:
            master.assign(value)

    def bytes(self, optimizer_state_bytes: int = 0) -> HostBytes:
        """What the store holds (its gradient buffers, before `allocate_grads`, counted for every
        group: the most a plan can ask for) and its optimizer's ``optimizer_state_bytes``."""
        w = self._weight_arena.numel() * self._weight_arena.element_size()
        g = self._grad_bytes()
        return HostBytes(
            weights=w,
            masters=self.num_params * master_bytes(self.master_mode),
            grads=g,
            optimizer=optimizer_state_bytes,
            pinned=self.pinned_bytes,
            num_params=self.num_params,
        )

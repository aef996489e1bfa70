"""Host memory for the whole model: pinned streaming weights, fp32 masters, pinned gradients.

Per parameter group (see ``model.adapter``) there is one flat weight buffer in the compute
dtype (what crosses PCIe), one flat fp32 master, and one flat gradient buffer in the compute
dtype (what comes back). Weights and gradients are views into two large arenas that are
pinned once (page-locked in place, so the allocator's power-of-two rounding never applies),
which is what makes every H2D/D2H copy asynchronous and full speed.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from lazytrain.errors import LazyTrainError
from lazytrain.model.adapter import GroupLayout, UnsupportedModelError

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


def _pin_in_place(t: torch.Tensor) -> bool:
    """Page-lock ``t``'s memory with cudaHostRegister (no copy, no rounding)."""
    if not torch.cuda.is_available() or t.numel() == 0:
        return False
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
    return True


@dataclass(slots=True)
class HostBytes:
    weights: int
    masters: int
    grads: int
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


class HostStore:
    """Flat per-group host buffers for weights, fp32 masters and gradients."""

    def __init__(
        self,
        layouts: list[GroupLayout],
        dtype: torch.dtype,
        pin: bool = True,
        optimizer_bytes_per_param: float = 8.0,
        host_limit_bytes: int | None = None,
    ):
        self.layouts = layouts
        self.dtype = dtype
        sizes = [g.numel for g in layouts]
        total = sum(sizes)
        esize = torch.empty((), dtype=dtype).element_size()
        need = total * (2 * esize + 4) + int(total * optimizer_bytes_per_param)
        limit = host_limit_bytes or int(host_memory_total() * 0.95)
        if need > limit:
            raise HostMemoryError(
                f"host memory: the model needs {need / 2**30:.1f} GiB (weights {total * esize / 2**30:.1f}, "
                f"fp32 masters {total * 4 / 2**30:.1f}, gradients {total * esize / 2**30:.1f}, optimizer "
                f"{total * optimizer_bytes_per_param / 2**30:.1f}), {limit / 2**30:.1f} GiB is usable; "
                "use optimizer.kind=hybrid8bit (about 2 B/param of state instead of 8), or a smaller model"
            )
        self._weight_arena = torch.empty(total, dtype=dtype)
        self._grad_arena = torch.empty(total, dtype=dtype)
        self.pinned_bytes = 0
        if pin:
            for arena in (self._weight_arena, self._grad_arena):
                if _pin_in_place(arena):
                    self.pinned_bytes += arena.numel() * arena.element_size()
        self.weights: list[torch.Tensor] = []
        self.grads: list[torch.Tensor] = []
        offset = 0
        for n in sizes:
            self.weights.append(self._weight_arena[offset : offset + n])
            self.grads.append(self._grad_arena[offset : offset + n])
            offset += n
        self.masters = [torch.empty(n, dtype=torch.float32) for n in sizes]
        self.num_params = total

    @property
    def pinned(self) -> bool:
        return self.pinned_bytes > 0

    def set_param(self, group: int, name: str, value: torch.Tensor) -> None:
        """Write one parameter (any dtype/device) into the master and the streaming weights."""
        layout = self.layouts[group]
        for p in layout.params:
            if p.name == name:
                if tuple(value.shape) != p.shape:
                    raise UnsupportedModelError(
                        f"{layout.hf_prefix}{name}: shape {tuple(value.shape)} in the checkpoint, "
                        f"{p.shape} in the model config"
                    )
                master = self.masters[group][p.offset : p.offset + p.numel]
                master.copy_(value.reshape(-1))
                self.weights[group][p.offset : p.offset + p.numel].copy_(master)
                return
        raise KeyError(f"{layout.hf_prefix}{name} is not a parameter of group {layout.name}")

    def sync_weights_from_masters(self, group: int) -> None:
        self.weights[group].copy_(self.masters[group])

    def bytes(self, optimizer_state_bytes: int = 0) -> HostBytes:
        w = self._weight_arena.numel() * self._weight_arena.element_size()
        g = self._grad_arena.numel() * self._grad_arena.element_size()
        return HostBytes(
            weights=w,
            masters=sum(m.numel() * 4 for m in self.masters),
            grads=g,
            optimizer=optimizer_state_bytes,
            pinned=self.pinned_bytes,
            num_params=self.num_params,
        )

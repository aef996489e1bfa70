"""The master weights in their three forms, and the load and store every optimizer step uses.

``memory.master`` chooses, per run, what holds the value AdamW updates:

* ``fp32``: a flat fp32 tensor, 4 B per parameter beside the streamed weight. Exact.
* ``split``: the streamed bf16 weight plus an int16 remainder (`SplitMaster`, ``split.py``),
  2 B per parameter. Exact: the fp32 master is rebuilt bit for bit in every step.
* ``bf16``: the streamed bf16 weight alone (`Bf16Master`), 0 B per parameter. Not exact: the
  step computes the new value in fp32, as for the others, and rounds it to one of its two
  bf16 neighbours stochastically (`stochastic_bf16`), so that updates smaller than half a
  bf16 ulp (2**-9 to 2**-8 of the weight; AdamW's updates are about lr, so at lr 1e-5 those
  of every weight above 0.005 in magnitude) move the weight on average instead of being
  rounded away; each rounding adds noise of up to an ulp, which
  an fp32 master does not have. What that costs in accuracy is measured, not claimed here.

The rounding draws from a hash of (seed, group, step, element index in the group), as the
8-bit states' stochastic rounding does (``quant.rounding_uniforms``), but under a key of its
own (``quant.weight_rounding_key``) so the weight's and the state's draws are independent:
runs repeat exactly, resume exactly, and a data-parallel shard draws what the whole group would.

`master_chunk` and `store_master_chunk` are the torch path's load and store of a piece of any
form (the C++ kernels' are ``load_master`` / ``store_master`` in ``csrc/master.h``, one code
for the 8-bit and the 4-bit kernel); an optimizer step of any state format calls them and
needs to know nothing else about the forms.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lazytrain.optim.quant import rounding_bits
from lazytrain.optim.split import SplitMaster, _to_int16

MASTER_MODES = ("fp32", "split", "bf16")
"""How a run holds its masters (``memory.master`` resolved)."""

MASTER_BYTES = {"fp32": 4, "split": 2, "bf16": 0}
"""Host bytes per parameter of the master beside the streamed weight, by mode."""

_QUIET_NAN = 0x7FC0


def stochastic_bf16_bits(x: torch.Tensor, key: int | torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The bf16 bits (as int16) of fp32 ``x`` rounded stochastically: 16 random bits ``r`` (the
    top of ``quant.rounding_bits(key, index)``, ``index`` the elements' int64 indices in their
    group) are added to x's bits and the sum cut to its high half. So x moves to its bf16
    neighbour away from zero with probability (low 16 bits of x) / 2**16, which is exactly
    (|x| - |toward|) / (|away| - |toward|) (float32 values between two bf16 neighbours are
    evenly spaced): the expected result is x. A bf16 value (low bits 0) stays put, infinities
    stay, NaN becomes the quiet NaN (as torch's cast), a value past the largest bf16 may round
    to infinity. The C++ kernels compute the same bits (``bf16_stochastic``, ``csrc/master.h``)."""
    bits = x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    high = ((bits + (rounding_bits(key, index) >> 16)) >> 16) & 0xFFFF
    high = torch.where(torch.isnan(x), _QUIET_NAN, high)
    return _to_int16(high)


def stochastic_bf16(x: torch.Tensor, key: int, first: int = 0) -> torch.Tensor:
    """`stochastic_bf16_bits` of flat ``x``, the elements ``first, first + 1, ...`` of their
    group, as a bf16 tensor."""
    index = torch.arange(first, first + x.numel(), dtype=torch.int64, device=x.device)
    return stochastic_bf16_bits(x.reshape(-1).float(), key, index).view(torch.bfloat16)


@dataclass(slots=True)
class Bf16Master:
    """One group's master as the streamed bf16 ``weight`` alone (a view of the host store's
    pinned arena, or of the executor's copy on the GPU while stepped there): the optimizer
    reads it widened to fp32 and writes it with stochastic rounding."""

    weight: torch.Tensor

    def __post_init__(self) -> None:
        if self.weight.dtype != torch.bfloat16 or self.weight.dim() != 1:
            raise ValueError(f"a bf16 master is a flat bf16 tensor, got {self.weight.dtype}{list(self.weight.shape)}")

    dtype = torch.bfloat16
    """The precision of the value held (a checkpoint saves it as such)."""

    def numel(self) -> int:
        return self.weight.numel()

    def fp32(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The master widened to fp32 (exact), in ``out`` if given."""
        return self.weight.float() if out is None else out.copy_(self.weight)

    def stored(self) -> torch.Tensor:
        """The value in its own precision: the weight itself."""
        return self.weight

    def assign(self, master: torch.Tensor) -> None:
        """Hold ``master`` (any shape, dtype or device): rounded to the nearest bf16, as any bf16
        load of fp32 values is (a loaded model, a checkpoint of an fp32 or split master). From
        another device the values are rounded there first (`across_devices`)."""
        self.weight.copy_(across_devices(master.reshape(-1), self.weight))

    def clone(self) -> Bf16Master:
        return Bf16Master(self.weight.clone())


def across_devices(values: torch.Tensor, into: torch.Tensor) -> torch.Tensor:
    """``values`` ready to copy into ``into``: converted to its dtype where they are, when they
    are on another device (a built-in shape's random init drawn on the GPU). A blocking GPU to
    CPU ``copy_`` that also converts the dtype goes through a new pageable CPU tensor of the
    source dtype (ATen's ``copy_kernel_cuda``: "type conversions are performed on the CPU"),
    whose pages are faulted in as it is written; converted first, the copy lands in ``into``'s
    (pinned) pages directly. The same rounding on either device (round to nearest even)."""
    if values.device == into.device or values.dtype == into.dtype:
        return values
    return values.to(into.dtype)


Master = torch.Tensor | SplitMaster | Bf16Master
"""A group's master: a flat fp32 tensor, a `SplitMaster` or a `Bf16Master`."""


def master_mode(master: Master) -> str:
    """``fp32``, ``split`` or ``bf16``: the form of ``master``."""
    return "split" if isinstance(master, SplitMaster) else "bf16" if isinstance(master, Bf16Master) else "fp32"


def new_master(mode: str, values: torch.Tensor) -> Master:
    """A new master of form ``mode`` (fp32, split or bf16) holding the flat ``values`` (a bf16
    master: rounded to the nearest bf16)."""
    values = values.reshape(-1).float()
    if mode == "split":
        return SplitMaster.of(values)
    if mode == "bf16":
        return Bf16Master(values.bfloat16())
    if mode == "fp32":
        return values.clone()
    raise ValueError(f"master form {mode!r} is not one of {list(MASTER_MODES)}")


def master_device(master: Master) -> torch.device:
    return master.device if isinstance(master, torch.Tensor) else master.weight.device


def master_chunk(master: Master, lo: int, hi: int) -> torch.Tensor:
    """Elements [lo, hi) of the master as fp32: a view of an fp32 master (updated in place by
    the step), or a new tensor (a split master's halves joined, a bf16 master widened)."""
    if isinstance(master, SplitMaster):
        return SplitMaster(master.weight[lo:hi], master.remainder[lo:hi]).fp32()
    if isinstance(master, Bf16Master):
        return master.weight[lo:hi].float()
    return master[lo:hi]


def store_master_chunk(master: Master, new: torch.Tensor, weight_out: torch.Tensor | None, lo: int, hi: int,
                       rounding: tuple[int, int] | None) -> None:
    """After a step of elements [lo, hi) computed ``new`` (fp32; for an fp32 master the view
    `master_chunk` gave, already updated): split a split master's new values back, round a
    bf16 master's stochastically under ``rounding`` = (``quant.weight_rounding_key`` of the
    step, index in its whole group of the master's element 0), or copy an fp32 master's into
    ``weight_out`` (the streamed weights, cast to their dtype)."""
    if isinstance(master, SplitMaster):
        SplitMaster(master.weight[lo:hi], master.remainder[lo:hi]).assign(new)
    elif isinstance(master, Bf16Master):
        if rounding is None:
            raise ValueError("a bf16 master is written with stochastic rounding: its (key, group offset) are needed")
        key, first = rounding
        master.weight[lo:hi].copy_(stochastic_bf16(new, key, first + lo))
    elif weight_out is not None:
        weight_out[lo:hi].copy_(new)

"""The split master: an fp32 master kept as the streamed bf16 weight plus a 16-bit remainder.

Weights (2 B) and masters (4 B) cost 6 B per parameter when both are held; with the master
split they cost 4 B, and the fp32 value is still exact. For an fp32 master with bits ``M``
(as an unsigned 32-bit integer):

    weight    = (M + 0x8000) >> 16          (bf16 bits: M rounded to 16 bits, ties away from 0)
    remainder = M & 0xffff                  (read as a signed int16)
    M         = (weight << 16) + remainder  (mod 2**32, remainder sign-extended)

Exact for every one of the 2**32 bit patterns (signs, zeros, subnormals, infinities, NaNs,
exponent carries): with ``M' = M + 0x8000 mod 2**32`` the weight is ``M' >> 16``, so
``M - (weight << 16) = (M' & 0xffff) - 0x8000`` lies in [-32768, 32767], which is the signed
value of ``M & 0xffff``. Adding 0x8000 to the bits rounds the magnitude (floats are
sign-magnitude), so the weight is the nearest bf16 of the master, as torch's bf16 cast is,
except at an exact tie (low 16 bits 0x8000) below an even bf16: torch rounds such a tie to the
even bf16 (towards zero), the split weight away from zero. Both are half an ulp off. The tie
cannot go torch's way: an even bf16 would then stand for 2**16 + 1 masters, one too many for
a 16-bit remainder. Masters past the largest bf16 stream as infinities (as with torch's cast)
and NaN masters whose payload sits in the low bits stream as infinities; the master itself
stays exact either way.

Where it does not apply: with an fp32 compute dtype the streamed weights are the masters'
own precision, so there is nothing to split.

The split master is ``memory.master=split``; ``memory.master=bf16`` goes 2 B further and keeps
no remainder at all (``master.py``'s `Bf16Master`: the weight is the master, rounded
stochastically each step), at the price of exactness: the split master is exact, the bf16
master is not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lazytrain.optim.kernel import kernel_choice, kernel_for

_LOW = 0xFFFF
SPLIT_PIECE = 1 << 26
"""Elements split at a time on another device by `SplitMaster.assign` (its int64 temporaries:
~1.5 GB a piece)."""


def _to_int16(x: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2**16) as the int16 of the same bits."""
    return (x - ((x >> 15) << 16)).to(torch.int16)


def split_halves(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``master``'s two halves with torch ops: (the weight's bf16 bits as int16, the int16
    remainder)."""
    bits = master.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return _to_int16(((bits + 0x8000) >> 16) & _LOW), _to_int16(bits & _LOW)


def joined(weight: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The fp32 masters of bf16 ``weight`` and int16 ``remainder`` with torch ops (a new tensor)."""
    high = (weight.view(torch.int16).to(torch.int64) & _LOW) << 16
    bits = (high + remainder.to(torch.int64)) & 0xFFFFFFFF
    return (bits - ((bits >> 31) << 32)).to(torch.int32).view(torch.float32)


def split_into(master: torch.Tensor, weight: torch.Tensor, remainder: torch.Tensor) -> None:
    """Write fp32 ``master``'s two halves into bf16 ``weight`` and int16 ``remainder``."""
    kernel = _kernel() if master.device.type == "cpu" else None
    if kernel is not None:
        kernel.split_master(master, weight, remainder)
        return
    high, low = split_halves(master)
    weight.view(torch.int16).copy_(high)
    remainder.copy_(low)


def split_across(values: torch.Tensor, weight: torch.Tensor, remainder: torch.Tensor) -> None:
    """`split_into` for ``values`` on another device than the halves: split where they are,
    `SPLIT_PIECE` elements at a time, each piece's halves copied into ``weight`` and
    ``remainder``."""
    for lo in range(0, values.numel(), SPLIT_PIECE):
        piece = values[lo : lo + SPLIT_PIECE].to(torch.float32).contiguous()
        split_into(piece, weight[lo : lo + piece.numel()], remainder[lo : lo + piece.numel()])


def join_into(weight: torch.Tensor, remainder: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The fp32 masters of ``weight`` and ``remainder``, written into ``out``."""
    kernel = _kernel() if weight.device.type == "cpu" else None
    if kernel is not None:
        kernel.join_master(weight, remainder, out)
        return out
    return out.copy_(joined(weight, remainder))


def _kernel():
    return kernel_for(kernel_choice())


@dataclass(slots=True)
class SplitMaster:
    """One group's fp32 master as two halves: the streamed bf16 ``weight`` (a view of the host
    store's pinned arena) and the int16 ``remainder``. Optimizers read and write both."""

    weight: torch.Tensor
    remainder: torch.Tensor

    def __post_init__(self) -> None:
        if self.weight.dtype != torch.bfloat16 or self.remainder.dtype != torch.int16:
            raise ValueError(
                f"a split master is a bf16 weight and an int16 remainder, got "
                f"{self.weight.dtype} and {self.remainder.dtype}"
            )
        if self.weight.shape != self.remainder.shape or self.weight.dim() != 1:
            raise ValueError(
                f"split master halves must be flat and of one size, got "
                f"{list(self.weight.shape)} and {list(self.remainder.shape)}"
            )

    @classmethod
    def of(cls, master: torch.Tensor) -> SplitMaster:
        """New halves holding the flat fp32 ``master``."""
        split = cls(torch.empty(master.numel(), dtype=torch.bfloat16),
                    torch.empty(master.numel(), dtype=torch.int16))
        split.assign(master)
        return split

    dtype = torch.float32
    """The precision of the value held (a checkpoint saves it as such)."""

    def numel(self) -> int:
        return self.weight.numel()

    def stored(self) -> torch.Tensor:
        """The value in its own precision: the exact fp32 master (a new tensor)."""
        return self.fp32()

    def fp32(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The exact fp32 master (in ``out`` if given)."""
        if out is None:
            out = torch.empty(self.numel(), dtype=torch.float32, device=self.weight.device)
        return join_into(self.weight, self.remainder, out)

    def assign(self, master: torch.Tensor) -> None:
        """Hold ``master`` (any shape, dtype or device; its values as fp32): both halves written.
        From another device the halves are split there, a piece at a time, and copied (not the
        fp32 values: see `master.across_devices`)."""
        values = master.reshape(-1)
        if values.device == self.weight.device:
            split_into(values.to(torch.float32).contiguous(), self.weight, self.remainder)
        else:
            split_across(values, self.weight, self.remainder)

    def clone(self) -> SplitMaster:
        return SplitMaster(self.weight.clone(), self.remainder.clone())

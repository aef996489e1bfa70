"""Hybrid 8-bit AdamW: blockwise 8-bit m and v on the CPU, fused with clipping and the bf16 write.

Per group the optimizer keeps Adam's first moment m and the square root of its second moment
v as one byte per element (an index into bitsandbytes' signed / unsigned dynamic map, see
``quant.py``) plus one fp32 absmax per block of 128 elements: 2.06 bytes per parameter instead
of 8. Groups under ``MIN_8BIT_NUMEL`` elements keep fp32 states, as bitsandbytes does.

The second moment is stored as sqrt(v), not v, because v spans twice the decades of the
gradients it averages: in a block whose largest v is 1, a v under 1.6e-7 (a gradient 4e-4
times the block's largest) falls below the map's smallest code and is stored as 0, and v near
1e-6 keeps only a few codes per decade. The next step then divides m by eps or by a far too
small sqrt(v): on the built-in model, storing v left up to 1.2% of the embedding's v at 0 and
gave single updates of 500 times the learning rate, where AdamW's stay near 1. sqrt(v) needs
half the decades (every v down to 1e-12 of the block's largest keeps a code) and is what the
update divides by anyway.

One step of a group is one pass over memory (``csrc/hybrid8bit.cpp``): gradient times clip
coefficient, dequantize (v is the stored root squared), AdamW update of the fp32 master
(decoupled weight decay on the first ``decay_numel`` elements), new weight cast to
``weight_out``'s dtype, requantize m and sqrt(v) with the absmax of the new block values. The
update itself uses the new m and v before they are quantized, as bitsandbytes' blockwise
kernel does. Where the kernel cannot be built, ``torch_step_8bit`` runs the same float32 math
with torch ops (the kernel's vector path takes sqrt(v) and 1 / (sqrt(v) + eps) from hardware
estimates refined by a Newton step, so the two differ by about an ulp).

With ``rounding="stochastic"`` (``optimizer.state_rounding``) the sqrt(v) codes are rounded
stochastically instead: to the code below or above the new value, the upper one with
probability (value - below) / (above - below), so the expected code value is the value. A
nearest code cannot follow a change smaller than half its gap (sqrt(v) of a parameter whose
gradient stopped shrinks by 0.05% a step at beta2 = 0.999, codes are 0.7-14% apart), so it
holds such values where they were; stochastic codes follow them on average. The uniform number
of each element is a hash of the seed, the group, the step and the element's index in its
group (``quant.rounding_uniforms``): runs repeat exactly, resume exactly, and a data-parallel
shard draws what the whole group would. m keeps nearest codes (rounding it stochastically too
measured farther from fp32 along a run, ``bench/studies/optim_update_error.py``).

A split master (``split.py``) is joined to fp32, stepped and split again inside the same pass
(kernel) or chunk (torch path), so the masters it holds are bit-for-bit those of an unsplit
run fed the same gradients; its weight half is the streamed weight, written in that pass. A
bf16 master (``master.py``) is the streamed weight alone: widened to fp32, stepped with the
same math, and written back with stochastic rounding drawn from a hash of (seed, group, step,
element index) under its own key (``quant.weight_rounding_key``), in the same pass. It is
NOT exact: unbiased, but each step adds up to a bf16 ulp of rounding noise. The kernel and
the torch path draw the same bits, so they differ only where their fp32 values (about an ulp
apart, below) fall on either side of a draw's threshold: one bf16 ulp, on ~2**-16 of the
weights per float32 ulp of difference. The load and the store of every form are
``master.master_chunk`` / ``master.store_master_chunk`` here and ``load_master`` /
``store_master`` in the kernel: a step of another state format calls them the same way.

A group may be stepped on a device instead (`Hybrid8bitAdamW.to_device`: the embedding and
the final norm + head, whose weights the executor keeps on the GPU): its remainder (or fp32
master; nothing for a bf16 master, which is the weights there) and state are copied there, and the torch path runs there on the device's gradient,
in pieces (``COMPILED_CHUNK`` elements), writing the executor's copy of the weights; `to_host`
copies them back. The same float32 math as the host's torch path, compiled: Triton fuses
multiply-adds, so, like the C++ kernel, it differs from that path by about an ulp (a value on a
code's midpoint may take the neighbouring code); run eagerly it equals it bit for bit.

Steps of different groups may run concurrently from several threads (each group's state is
its own and the kernel holds no GIL); one group must not be stepped by two threads at once.
Each step spreads its blocks over torch's intra-op threads (``torch.get_num_threads()``), so
two concurrent steps run two such teams at once: one optimizer thread uses the cores best.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import torch

from lazytrain.optim.base import AdamWConfig, HostOptimizer
from lazytrain.optim.kernel import kernel_choice, kernel_for
from lazytrain.optim.master import (
    Bf16Master,
    Master,
    master_chunk,
    master_device,
    stochastic_bf16_bits,
    store_master_chunk,
)
from lazytrain.optim.quant import (
    BLOCK,
    QuantTables,
    dequantize_blockwise,
    num_blocks,
    quantize_blockwise,
    rounding_key,
    rounding_uniforms,
    signed_tables,
    tables_on,
    uniforms_at,
    unsigned_tables,
    weight_rounding_key,
)
from lazytrain.optim.split import SplitMaster, joined, split_halves

MIN_8BIT_NUMEL = 4096
"""Groups with fewer elements keep fp32 m and v."""

ROUNDINGS = ("nearest", "stochastic")
"""How sqrt(v) is requantized each step (``Hybrid8bitAdamW``'s ``rounding``)."""


def is_8bit(numel: int) -> bool:
    return numel >= MIN_8BIT_NUMEL


def state_bytes_per_param(numels: Sequence[int], fp32_groups: Collection[int] = ()) -> float:
    """Bytes of state per parameter of groups of ``numels`` elements, as Hybrid8bitAdamW keeps them."""
    total = 0
    for g, n in enumerate(numels):
        total += 2 * n + 8 * num_blocks(n) if is_8bit(n) and g not in fp32_groups else 8 * n
    return total / max(sum(numels), 1)


STATE_FORMAT = f"dynamic8-block{BLOCK}-sqrtv"
"""Names the maps, block size and what the second-moment codes hold (sqrt(v)) of saved codes."""

OLD_STATE_FORMATS = {"dynamic8-block256-sqrtv": (256, True), "dynamic8-block256": (256, False)}
"""Earlier formats that loading converts: their block size, and whether the second-moment
codes hold sqrt(v) (the oldest held v itself)."""


@dataclass(frozen=True, slots=True)
class StepScalars:
    """The per-step numbers of one group's AdamW update (bias corrections folded in)."""

    clip: float
    beta1: float
    beta2: float
    eps: float
    step_size: float
    """lr / (1 - beta1**t)"""
    inv_bc2_sqrt: float
    """1 / sqrt(1 - beta2**t)"""
    decay: float
    """1 - lr * weight_decay, applied to the first decay_numel elements."""
    decay_numel: int

    @classmethod
    def of(
        cls, config: AdamWConfig, step: int, lr: float, clip_coef: float, decay_numel: int
    ) -> StepScalars:
        beta1, beta2 = config.betas
        return cls(
            clip=float(clip_coef),
            beta1=beta1,
            beta2=beta2,
            eps=config.eps,
            step_size=lr / (1.0 - beta1**step),
            inv_bc2_sqrt=1.0 / math.sqrt(1.0 - beta2**step),
            decay=1.0 - lr * config.weight_decay,
            decay_numel=decay_numel,
        )


@dataclass(slots=True)
class QuantizedState:
    m_codes: torch.Tensor
    m_absmax: torch.Tensor
    v_codes: torch.Tensor
    """Codes of sqrt(v) in the unsigned map."""
    v_absmax: torch.Tensor
    """Per block, the largest sqrt(v)."""

    @classmethod
    def zeros(cls, numel: int) -> QuantizedState:
        blocks = num_blocks(numel)
        return cls(
            m_codes=torch.full((numel,), signed_tables().zero_code, dtype=torch.uint8),
            m_absmax=torch.zeros(blocks, dtype=torch.float32),
            v_codes=torch.full((numel,), unsigned_tables().zero_code, dtype=torch.uint8),
            v_absmax=torch.zeros(blocks, dtype=torch.float32),
        )

    @classmethod
    def of_moments(cls, m: torch.Tensor, v: torch.Tensor) -> QuantizedState:
        """The quantized state of float moments ``m`` and ``v`` (flat)."""
        m_codes, m_absmax = quantize_blockwise(m, signed_tables())
        v_codes, v_absmax = quantize_blockwise(v.float().sqrt(), unsigned_tables())
        return cls(m_codes=m_codes, m_absmax=m_absmax, v_codes=v_codes, v_absmax=v_absmax)

    def moments(self) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 (m, v) that the codes stand for."""
        root = dequantize_blockwise(self.v_codes, self.v_absmax, unsigned_tables())
        return dequantize_blockwise(self.m_codes, self.m_absmax, signed_tables()), root * root

    def tensors(self) -> dict[str, torch.Tensor]:
        return {
            "m_codes": self.m_codes,
            "m_absmax": self.m_absmax,
            "v_codes": self.v_codes,
            "v_absmax": self.v_absmax,
        }

    def piece(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(m codes, m absmax, v codes, v absmax) of elements ``lo .. hi - 1`` (whole blocks)."""
        blocks = slice(lo // BLOCK, num_blocks(hi))
        return self.m_codes[lo:hi], self.m_absmax[blocks], self.v_codes[lo:hi], self.v_absmax[blocks]


@dataclass(slots=True)
class Fp32State:
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor

    @classmethod
    def zeros(cls, numel: int) -> Fp32State:
        return cls(exp_avg=torch.zeros(numel), exp_avg_sq=torch.zeros(numel))

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}


_ALIGN = 512
"""Byte alignment of each tensor `Hybrid8bitAdamW.stream_in` carves from its scratch buffer."""


def pinned_in_place_copy(t: torch.Tensor) -> torch.Tensor:
    """``t`` (1-D, contiguous) copied into whole pages of its own, page-locked in place
    (`memory.nvme.aligned_empty`): host bytes = ``t``'s rounded up to 4 KiB. ``t.pin_memory()``
    goes through torch's pinned allocator, which rounds each allocation up to a power of two: a
    30B-A3B layer's 4-bit codes (296 MiB each) would take 512 MiB, ~0.45 GiB more host memory
    per streamed GPU step (15 GiB over 33), none of it in the plan's host budget. Not pinned
    without CUDA."""
    from lazytrain.memory.nvme import aligned_empty

    if t.dim() != 1 or not t.is_contiguous():
        raise ValueError(f"pinned_in_place_copy takes a contiguous 1-D tensor, got shape {tuple(t.shape)}")
    out = aligned_empty(t.numel(), t.dtype, pin=torch.cuda.is_available())
    out.copy_(t)
    return out


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


TORCH_CHUNK = 256 * BLOCK
"""Elements per piece of the pure-torch path on the CPU: its temporaries then stay in cache."""
DEVICE_CHUNK = 1 << 23
"""Elements per piece of the eager torch ops on a GPU (the fp32-state path, and the 8-bit one
where it cannot be compiled): temporaries of ~0.4 GB (an estimate: ~48 bytes per element; the
profiler measures them, `CostTable.device_step_work_bytes`)."""
PIECE_ALIGN = 4 * BLOCK
"""A GPU step's pieces hold a multiple of this many elements: whole quantization blocks, and
absmax slices that start 16-byte aligned (4 fp32 per ``BLOCK`` elements)."""
COMPILED_CHUNK = 1 << 26
"""Elements per piece of the compiled 8-bit step on a GPU (`device_step_8bit`). Each piece costs
the calling thread ~0.2-0.25 ms (the compiled function's guards and its kernels' launches), and
at 1 << 23 the GPU kept up with that: on the H200 (7B, 2026-12-04/05) the update's `start`
queued the embedding's, head's and 8 layers' steps (354 pieces of 1 << 23) in 0.061-0.087 s of
host time, the GPU 4-9 ms behind it when the next step was called (it had waited for the
launches), 0.05-0.10 s of each step. At 1 << 26 a layer is 4 pieces, the head 9 (not yet timed
on a GPU: `bench/studies/device_step.py`). The temporaries grow with the piece: 67.6 MB measured at
1 << 23 (8 bytes per element), so ~0.54 GB (`CostTable.device_step_work_bytes`, measured)."""


def _chunk(device: torch.device) -> int:
    return TORCH_CHUNK if device.type == "cpu" else DEVICE_CHUNK


def _adam_update(
    master: torch.Tensor,
    grad: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    s: StepScalars,
    decay_numel: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """New (m, v), and the master updated in place (decay on its first decay_numel elements)."""
    g = grad.float() * s.clip
    m = s.beta1 * m + (1.0 - s.beta1) * g
    v = s.beta2 * v + (1.0 - s.beta2) * (g * g)
    denom = v.sqrt() * s.inv_bc2_sqrt + s.eps
    master[:decay_numel].mul_(s.decay)
    master.sub_(s.step_size * (m / denom))
    return m, v


def torch_step_8bit(
    grad: torch.Tensor,
    master: Master,
    state: QuantizedState,
    weight_out: torch.Tensor | None,
    s: StepScalars,
    rounding: tuple[int, int] | None = None,
    master_rounding: tuple[int, int] | None = None,
) -> None:
    """The kernel's step with torch ops on the tensors' device, a piece of `_chunk` elements at
    a time (on the CPU, the fallback where the kernel does not build). ``rounding``: (key, index
    of the first element in its whole group) to round sqrt(v) stochastically
    (``quant.rounding_uniforms``); ``master_rounding``: the same for a bf16 master's weights
    (``quant.weight_rounding_key``; needed for a `Bf16Master`)."""
    device = grad.device
    mt, vt = tables_on(True, device), tables_on(False, device)
    n, step = master.numel(), _chunk(device)
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        chunk = master_chunk(master, lo, hi)
        blocks = slice(lo // BLOCK, num_blocks(hi))
        m_codes, v_codes = state.m_codes[lo:hi], state.v_codes[lo:hi]
        m_absmax, v_absmax = state.m_absmax[blocks], state.v_absmax[blocks]
        m = dequantize_blockwise(m_codes, m_absmax, mt)
        root = dequantize_blockwise(v_codes, v_absmax, vt)
        decay_numel = min(max(s.decay_numel - lo, 0), hi - lo)
        m, v = _adam_update(chunk, grad[lo:hi], m, root * root, s, decay_numel)
        root = v.sqrt()
        uniforms = None if rounding is None else rounding_uniforms(rounding[0], rounding[1] + lo, hi - lo, device)
        for codes, absmax, x, tables, u in (
            (m_codes, m_absmax, m, mt, None), (v_codes, v_absmax, root, vt, uniforms)
        ):
            new_codes, new_absmax = quantize_blockwise(x, tables, uniforms=u)
            codes.copy_(new_codes)
            absmax.copy_(new_absmax)
        store_master_chunk(master, chunk, weight_out, lo, hi, master_rounding)


def torch_step_fp32(
    grad: torch.Tensor,
    master: Master,
    state: Fp32State,
    weight_out: torch.Tensor | None,
    s: StepScalars,
    master_rounding: tuple[int, int] | None = None,
) -> None:
    n = master.numel()
    step = n if grad.device.type == "cpu" else DEVICE_CHUNK  # a GPU's temporaries stay bounded
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        chunk = master_chunk(master, lo, hi)
        decay_numel = min(max(s.decay_numel - lo, 0), hi - lo)
        m, v = _adam_update(chunk, grad[lo:hi], state.exp_avg[lo:hi], state.exp_avg_sq[lo:hi], s, decay_numel)
        state.exp_avg[lo:hi].copy_(m)
        state.exp_avg_sq[lo:hi].copy_(v)
        store_master_chunk(master, chunk, weight_out, lo, hi, master_rounding)


def _device_piece(grad: torch.Tensor, weight: torch.Tensor, remainder: torch.Tensor | None,
                  m_codes: torch.Tensor, m_absmax: torch.Tensor, v_codes: torch.Tensor, v_absmax: torch.Tensor,
                  weight_out: torch.Tensor | None, scalars: torch.Tensor, ints: torch.Tensor,
                  mt: QuantTables, vt: QuantTables, stochastic: bool) -> None:
    """One piece of `torch_step_8bit`'s math, for `torch.compile` on a GPU (a few fused kernels
    instead of ~100 passes over memory: eager, the 7B's 1.09 B embedding + head parameters took
    340 ms on the H200). The per-step numbers come as tensors, so no step recompiles:
    ``scalars`` = (clip, beta1, 1 - beta1, beta2, 1 - beta2, eps, step_size, inv_bc2_sqrt, decay)
    (the differences taken in float64, as the eager path's Python floats are), ``ints`` = (index
    of the piece's first element in its group, decay_numel, rounding key, a bf16 master's rounding
    key). ``remainder``: the master is split (``weight`` its bf16 half); else a bf16 ``weight``
    is a bf16 master (rounded stochastically), an fp32 one the fp32 master, ``weight_out``
    getting its cast. Decay is a multiply by ``decay`` or by 1 (exact) per element."""
    local = torch.arange(grad.numel(), device=grad.device)
    master, bf16_master = piece_master(weight, remainder)
    new, m, v = piece_adamw(master, dequantize_blockwise(m_codes, m_absmax, mt),
                            dequantize_blockwise(v_codes, v_absmax, vt), grad, scalars, local, ints[1])
    uniforms = uniforms_at(ints[2], local + ints[0]) if stochastic else None
    for codes, absmax, x, tables, u in ((m_codes, m_absmax, m, mt, None), (v_codes, v_absmax, v.sqrt(), vt, uniforms)):
        new_codes, new_absmax = quantize_blockwise(x, tables, uniforms=u)
        codes.copy_(new_codes)
        absmax.copy_(new_absmax)
    piece_store(new, weight, remainder, weight_out, bf16_master, ints[3], local + ints[0])


def piece_master(weight: torch.Tensor, remainder: torch.Tensor | None) -> tuple[torch.Tensor, bool]:
    """A GPU piece's fp32 master (`_device_piece`'s forms) and whether it is a bf16 master."""
    bf16_master = remainder is None and weight.dtype == torch.bfloat16
    return (joined(weight, remainder) if remainder is not None else weight.float() if bf16_master
            else weight), bf16_master


def piece_adamw(master: torch.Tensor, m: torch.Tensor, root: torch.Tensor, grad: torch.Tensor,
                scalars: torch.Tensor, local: torch.Tensor, decay_numel: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A GPU piece's AdamW from its dequantized m and sqrt(v) (``root``): (the new master, m,
    v), ``scalars`` as `_device_piece` takes them, decay on the elements before
    ``decay_numel``."""
    clip, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, step_size, inv_bc2_sqrt, decay = scalars.unbind()
    g = grad.float() * clip
    m = beta1 * m + one_minus_beta1 * g
    v = beta2 * (root * root) + one_minus_beta2 * (g * g)
    denom = v.sqrt() * inv_bc2_sqrt + eps
    return master * torch.where(local < decay_numel, decay, 1.0) - step_size * (m / denom), m, v


def piece_store(new: torch.Tensor, weight: torch.Tensor, remainder: torch.Tensor | None,
                weight_out: torch.Tensor | None, bf16_master: bool, key: torch.Tensor, index: torch.Tensor) -> None:
    """A GPU piece's new master written back in its form: split halves, a bf16 master rounded
    stochastically (``key``, each element's ``index`` in its group), or fp32 (and its cast to
    ``weight_out``)."""
    if remainder is not None:
        high, low = split_halves(new)
        weight.view(torch.int16).copy_(high)
        remainder.copy_(low)
    elif bf16_master:
        weight.view(torch.int16).copy_(stochastic_bf16_bits(new, key, index))
    else:
        weight.copy_(new)
        if weight_out is not None:
            weight_out.copy_(new)


class DevicePiece:
    """A GPU step's piece of one state format (``eager``: its torch ops on one piece of a group)
    and how it runs: compiled on first use, eagerly from the first compile error on (warned)."""

    def __init__(self, eager: Callable[..., None], what: str):
        self.eager = eager
        self.what = what
        self.fn: Callable[..., None] | None = None
        """``eager`` compiled; ``eager`` itself once compiling failed; None before the first call."""

    def __call__(self, *args) -> None:
        if self.fn is None:
            self.fn = torch.compile(self.eager)
        self.fn(*args)

    @property
    def eagerly(self) -> bool:
        return self.fn is self.eager

    def chunk(self) -> int:
        """Elements per piece: ``COMPILED_CHUNK``, or ``DEVICE_CHUNK`` once it runs eagerly."""
        return DEVICE_CHUNK if self.eagerly else COMPILED_CHUNK

    def run_eagerly(self, error: BaseException) -> None:
        """Warn that compiling failed, and run eagerly from now on."""
        warnings.warn(f"lazytrain: the GPU optimizer step ({self.what} states) could not be compiled "
                      f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}); running it "
                      "eagerly, ~16x slower (340 ms against 21 ms for a 7B's embedding and head on an H200, 8-bit)",
                      RuntimeWarning, stacklevel=5)
        self.fn = self.eager


PIECE_8BIT = DevicePiece(_device_piece, "8-bit")


def _on_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A few numbers copied to ``device`` without holding the calling thread: from pinned memory
    on CUDA (a copy from pageable memory goes through the driver's staging buffers, and may hold
    the thread, which goes on to queue the forward, while the link is busy with the streamed
    steps' gigabytes)."""
    t = torch.tensor(values, dtype=dtype)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def _compile_errors() -> tuple[type[BaseException], ...]:
    """What torch.compile raises when it cannot compile (the step then runs eagerly); any other
    error (out of memory, a fault in the compiled kernels) propagates."""
    import torch._dynamo.exc as dynamo_exc
    import torch._inductor.exc as inductor_exc

    return tuple(c for c in (dynamo_exc.BackendCompilerFailed, getattr(inductor_exc, "InductorError", None),
                             getattr(dynamo_exc, "InternalTorchDynamoError", None)) if c is not None)


def device_step_8bit(
    grad: torch.Tensor,
    master: Master,
    state: QuantizedState,
    weight_out: torch.Tensor | None,
    s: StepScalars,
    rounding: tuple[int, int] | None = None,
    chunk: int | None = None,
    master_rounding: tuple[int, int] | None = None,
) -> None:
    """`torch_step_8bit` on a GPU: the same math, `_device_piece` compiled (`device_step`)."""
    device_step(PIECE_8BIT, (tables_on(True, grad.device), tables_on(False, grad.device)), grad, master, state,
                weight_out, s, rounding, chunk, master_rounding)


def device_step(
    piece: DevicePiece,
    tables: tuple,
    grad: torch.Tensor,
    master: Master,
    state,
    weight_out: torch.Tensor | None,
    s: StepScalars,
    rounding: tuple[int, int] | None = None,
    chunk: int | None = None,
    master_rounding: tuple[int, int] | None = None,
    moment_key: int | None = None,
) -> None:
    """A quantized state's step on a GPU: ``piece`` (its format's math, `DevicePiece`) over
    ``chunk`` elements at a time (default ``piece.chunk()``) (a full piece's size, then one
    generic in the size once a tail shows a second: torch's automatic dynamic shapes;
    ``dynamic=True`` would also make the map tables' bit counts symbolic, which inductor cannot
    shift by). Where compiling fails, this piece and the rest run eagerly in pieces of
    ``DEVICE_CHUNK`` (the eager temporaries are ~6x the compiled ones'), and so does every later
    step. ``tables``: the maps of m and sqrt(v) on the GPU; ``rounding``, ``master_rounding``:
    (key, index of the group's first element) of sqrt(v)'s and a bf16 master's stochastic
    rounding; ``moment_key``: m's key where it is rounded stochastically too (4-bit states)."""
    if chunk is None:
        chunk = piece.chunk()
    if chunk <= 0 or chunk % PIECE_ALIGN:
        raise ValueError(f"chunk must be a positive multiple of {PIECE_ALIGN} elements (a piece holds whole "
                         "quantization blocks, its absmax slices 16-byte aligned as compiled kernels assume of "
                         f"their inputs), got {chunk}")
    device = grad.device
    split, weight_is_master = isinstance(master, SplitMaster), isinstance(master, (SplitMaster, Bf16Master))
    if isinstance(master, Bf16Master) and master_rounding is None:
        raise ValueError("a bf16 master is written with stochastic rounding: pass master_rounding")
    scalars = _on_device([s.clip, s.beta1, 1.0 - s.beta1, s.beta2, 1.0 - s.beta2, s.eps, s.step_size,
                          s.inv_bc2_sqrt, s.decay], torch.float32, device)
    key, first = rounding if rounding is not None else (0, 0)
    master_key, first = master_rounding if master_rounding is not None else (0, first)
    keys = (key, master_key) if moment_key is None else (key, master_key, moment_key)
    width = -(-(2 + len(keys)) // 4) * 4  # rows of 4 or 8: each row 32-byte aligned
    n = master.numel()

    def pieces(start: int, size: int) -> None:
        starts = range(start, n, size)
        # every piece's numbers in one copy (each row 32-byte aligned, as compiled kernels
        # assume of their inputs): a copy per piece takes a pinned buffer each, which the host
        # allocator cannot reuse while the copies wait on a busy stream
        pad = (0,) * (width - 2 - len(keys))
        all_ints = _on_device([v for lo in starts for v in (first + lo, s.decay_numel - lo, *keys, *pad)],
                              torch.int64, device).view(-1, width)
        for index, lo in enumerate(starts):
            hi = min(n, lo + size)
            args = (
                grad[lo:hi], (master.weight if weight_is_master else master)[lo:hi],
                master.remainder[lo:hi] if split else None, *state.piece(lo, hi),
                None if weight_is_master or weight_out is None else weight_out[lo:hi], scalars, all_ints[index],
                *tables, rounding is not None,
            )
            try:
                piece(*args)
            except _compile_errors() as error:  # compiling failed (no Triton, no compiler): before this piece ran
                if piece.eagerly:
                    raise
                piece.run_eagerly(error)
                pieces(lo, DEVICE_CHUNK)
                return

    pieces(0, chunk)


@dataclass(slots=True)
class _StepInputs:
    """One group step's checked inputs (`Hybrid8bitAdamW._step_inputs`)."""

    master: Master
    grad: torch.Tensor
    """Flat and contiguous, on the device the group steps on."""
    out: torch.Tensor | None
    """The weights a step writes besides the master: ``weight_out`` for an fp32 master, a split
    master's bf16 half, ``None`` for a bf16 master (the master is the weight)."""
    remainder: torch.Tensor | None
    """A split master's low half (the kernels take the split master as (``out``, remainder))."""
    flat: torch.Tensor
    """The kernels' ``master`` argument: the fp32 master, the bf16 master, or (split) ``out``."""
    on_device: bool
    step: int
    offset: int
    """Index of the master's element 0 in its whole group."""
    scalars: StepScalars
    rounding: tuple[int, int] | None
    """sqrt(v)'s stochastic rounding (``quant.rounding_key``, offset), or ``None``: nearest."""
    master_rounding: tuple[int, int]
    """A bf16 master's rounding (``quant.weight_rounding_key``, offset)."""

    @property
    def kernel_scalars(self) -> tuple[float, ...]:
        s = self.scalars
        return (s.clip, s.beta1, s.beta2, s.eps, s.step_size, s.inv_bc2_sqrt, s.decay)


class Hybrid8bitAdamW(HostOptimizer):
    """AdamW with blockwise 8-bit states (2.06 bytes per parameter), fused on the CPU.

    Interchangeable with ``FusedAdamW``. ``kernel`` is ``"auto"`` (the C++ kernel, built at
    first use, else the pure-torch path with a warning), ``"cpp"`` (the kernel or an error),
    ``"torch"``, or ``"cpp-<variant>"`` (the kernel built for one instruction set,
    ``kernel.VARIANTS``: to test each path); ``None`` reads ``LAZYTRAIN_OPTIM_KERNEL``. Groups in ``fp32_groups`` keep fp32
    m and v whatever their size (bitsandbytes' advice for embeddings: rows of rare tokens get
    rare, tiny gradients, the hardest values for blockwise 8-bit states). ``group_numels``
    are the sizes that choose 8-bit or fp32 states when the masters are a data-parallel
    rank's shards of larger groups (default: the masters' own sizes), so every rank keeps
    the states the unsharded run keeps; ``group_offsets`` are then where each shard starts in
    its group. ``rounding`` is how sqrt(v) is requantized: ``"nearest"`` code, or
    ``"stochastic"`` (one of the two codes around it, drawn from a hash of ``seed``, the group,
    the step and the element's index in its group: the same draw for a shard as for the whole
    group, and again after a resume).
    """

    device_step = True
    KERNEL = "hybrid8bit"
    """The C++ kernel's name (`kernel.SOURCES`); a subclass with other states names its own."""
    QUANTIZED = QuantizedState
    """The state of a quantized group (``zeros(numel)``); a subclass with other states names its own."""

    @property
    def device_step_chunk(self) -> int:
        return PIECE_8BIT.chunk()

    def __init__(
        self,
        masters: list[Master],
        decay_numel: list[int],
        config: AdamWConfig,
        *,
        kernel: str | None = None,
        fp32_groups: Collection[int] = (),
        group_numels: Sequence[int] | None = None,
        group_offsets: Sequence[int] | None = None,
        rounding: str = "nearest",
        seed: int = 0,
    ):
        super().__init__(masters, decay_numel, config)
        if rounding not in ROUNDINGS:
            raise ValueError(f"rounding must be one of {list(ROUNDINGS)}, got {rounding!r}")
        offsets = [0] * len(masters) if group_offsets is None else list(group_offsets)
        if len(offsets) != len(masters) or any(o < 0 for o in offsets):
            raise ValueError(
                f"group_offsets must give one offset >= 0 per group ({len(masters)}), got {offsets}"
            )
        # an empty shard starts at its group's end, which need not be a block multiple
        offsets = [o if m.numel() else 0 for o, m in zip(offsets, masters)]
        if any(o % BLOCK for o in offsets):
            raise ValueError(
                f"group_offsets must be multiples of the {BLOCK}-element block (a shard's blocks "
                f"are then the whole group's), got {offsets}"
            )
        self.rounding, self.seed, self.group_offsets = rounding, int(seed), offsets
        self._kernel = kernel_for(kernel_choice(kernel), self.KERNEL)
        sizes = [m.numel() for m in masters] if group_numels is None else group_numels
        self.states: list[QuantizedState | Fp32State] = [
            self.QUANTIZED.zeros(m.numel())
            if is_8bit(size) and g not in fp32_groups
            else Fp32State.zeros(m.numel())
            for g, (m, size) in enumerate(zip(masters, sizes))
        ]
        self._home: dict[int, tuple[Master, QuantizedState | Fp32State]] = {}
        """Groups on a device (`to_device`): their host master and state."""
        self._device_weight: dict[int, torch.Tensor] = {}
        """Groups on a device: the weights there each step writes."""
        mt, vt = signed_tables(), unsigned_tables()
        self._tables = [
            t
            for tables in (mt, vt)
            for t in (tables.qmap, tables.midpoints, tables.lut, tables.pieces)
        ]

    @property
    def device_groups(self) -> frozenset[int]:
        return frozenset(self._home)

    def to_device(self, group: int, weight: torch.Tensor) -> None:
        """Step ``group`` on ``weight``'s device until `to_host`. ``weight`` is the group's flat
        weights there (the executor's resident copy, holding the current weights): a split
        master's remainder is copied beside it and ``weight`` becomes its other half, an fp32
        master is copied and writes ``weight`` after each step; the state is copied too. Steps
        then take the gradient on that device and write ``weight``: nothing crosses PCIe."""
        self._check_device_weight(group, weight)
        on = {name: t.to(weight.device, copy=True) for name, t in self._streamed_host(group).items()}
        self._place(group, weight, on)

    def _check_device_weight(self, group: int, weight: torch.Tensor) -> None:
        if group in self._home:
            raise ValueError(f"group {group} is on {self._device_weight[group].device} already; to_host first")
        master = self.masters[group]
        if weight.numel() != master.numel():
            raise ValueError(f"group {group}: the device weights must be {master.numel()} contiguous "
                             f"elements, got {weight.numel()}")
        if not weight.is_contiguous():
            raise ValueError(f"group {group}: the device weights must be contiguous (a flat buffer), got "
                             f"strides {weight.stride()}")
        if isinstance(master, (SplitMaster, Bf16Master)) and weight.dtype != torch.bfloat16:
            raise ValueError(f"group {group}: a split or bf16 master's weight is bf16, got {weight.dtype}")

    def _place(self, group: int, weight: torch.Tensor, on: dict[str, torch.Tensor]) -> None:
        """Step ``group`` from the device tensors ``on`` (`_streamed_host`'s names) and
        ``weight`` until it is brought home."""
        master, state = self.masters[group], self.states[group]
        self._home[group] = (master, state)
        self.masters[group] = (SplitMaster(weight.view(-1), on["master"]) if isinstance(master, SplitMaster)
                               else Bf16Master(weight.view(-1)) if isinstance(master, Bf16Master) else on["master"])
        self.states[group] = type(state)(**{name: on[name] for name in state.tensors()})
        self._device_weight[group] = weight.view(-1)

    def _copy_home(self, group: int, non_blocking: bool) -> None:
        """Copy device group ``group``'s master (a split master's two halves, a bf16 master: the
        weight into the host store's weights) and state into its host tensors."""
        master, state = self._home[group]
        on, on_state = self.masters[group], self.states[group]
        if isinstance(master, (SplitMaster, Bf16Master)):
            master.weight.copy_(on.weight, non_blocking=non_blocking)
        if isinstance(master, SplitMaster):
            master.remainder.copy_(on.remainder, non_blocking=non_blocking)
        elif not isinstance(master, Bf16Master):
            master.copy_(on, non_blocking=non_blocking)
        for name, t in state.tensors().items():
            t.copy_(on_state.tensors()[name], non_blocking=non_blocking)

    def to_host(self) -> None:
        """Copy each device group's master and state back to its host tensors (`_copy_home`);
        the groups are stepped on the host from then on."""
        for group in self._home:
            self._copy_home(group, non_blocking=False)
        self._drop_device()

    def streamed_bytes(self, group: int) -> int:
        """Device bytes `stream_in` carves for ``group``: its master remainder (or fp32 master;
        nothing for a bf16 master, which is the weight) and optimizer state, each aligned to
        `_ALIGN`."""
        return sum(_aligned(t.numel() * t.element_size()) for t in self._streamed_host(group).values())

    def _streamed_host(self, group: int) -> dict[str, torch.Tensor]:
        master = self.masters[group]
        if isinstance(master, Bf16Master):
            return dict(self.states[group].tensors())
        return {"master": master.remainder if isinstance(master, SplitMaster) else master,
                **self.states[group].tensors()}

    def stream_in(self, group: int, weight: torch.Tensor, scratch: torch.Tensor) -> None:
        """`to_device` for one step (`Plan.device_steps`): ``group``'s master remainder (or fp32
        master) and state copied into views of ``scratch`` (a flat uint8 buffer of at least
        `streamed_bytes` on the GPU) on the current stream, without waiting (its state tensors
        are moved to pinned memory first, once, by `pinned_in_place_copy`; the master's pinning
        is the host store's, `HostStore.pin_masters`). ``weight``: as for `to_device` (for a split master, its bf16
        half holding the current weights; for a bf16 master, the master). `stream_out` brings
        the group back."""
        self._check_device_weight(group, weight)
        state = self.states[group]
        if scratch.dtype != torch.uint8 or scratch.numel() < self.streamed_bytes(group):
            raise ValueError(f"group {group}: the scratch buffer must be uint8 of >= {self.streamed_bytes(group)} "
                             f"bytes, got {scratch.dtype} of {scratch.numel()}")
        if scratch.device.type == "cuda":
            for name, t in state.tensors().items():
                if not t.is_pinned():
                    setattr(state, name, pinned_in_place_copy(t))  # the field of that name
        on, at = {}, 0
        for name, t in self._streamed_host(group).items():
            nbytes = t.numel() * t.element_size()
            on[name] = scratch[at : at + nbytes].view(t.dtype).view(t.shape)
            on[name].copy_(t, non_blocking=True)
            at += _aligned(nbytes)
        self._place(group, weight, on)

    def stream_out(self, group: int) -> None:
        """`to_host` for ``group`` alone, its copies queued on the current stream without waiting:
        the host tensors hold the step once the stream has run them. A split master's weight
        half, or a bf16 master, goes to the host store's weights (an fp32 master's bf16 weights
        are the caller's)."""
        self._copy_home(group, non_blocking=True)
        self.discard_device(group)

    def discard_device(self, group: int) -> None:
        """Forget ``group``'s device copy without copying it home (one whose step there failed
        before `stream_out`): it is stepped on the host again, from its host tensors as they
        are, which nothing on the device has written."""
        if group not in self._home:
            raise ValueError(f"group {group} is not on a device")
        self.masters[group], self.states[group] = self._home.pop(group)
        del self._device_weight[group]

    def _drop_device(self) -> None:
        """Step every device group on the host again, from its host tensors as they are."""
        for group in list(self._home):
            self.discard_device(group)

    @property
    def backend(self) -> str:
        """``"cpp"`` when steps run in the fused kernel, ``"torch"`` otherwise."""
        return "torch" if self._kernel is None else "cpp"

    def _step_inputs(self, group: int, grad: torch.Tensor, clip_coef: float, lr: float,
                     weight_out: torch.Tensor | None) -> _StepInputs:
        """``step_group``'s checked inputs, shared by the 8-bit and 4-bit steps (one set of
        checks, one place that derives the rounding keys): what each kernel call and torch
        path takes."""
        master = self.masters[group]
        n = master.numel()
        if grad.numel() != n:
            raise ValueError(f"group {group}: gradient has {grad.numel()} elements, master {n}")
        on_device = group in self._home
        where = master_device(master)
        if grad.dtype not in (torch.bfloat16, torch.float32) or grad.device != where:
            raise ValueError(
                f"group {group}: gradient must be a bf16 or fp32 tensor on {where} (where the "
                f"group is stepped), got {grad.dtype} on {grad.device}"
            )
        if on_device:
            if weight_out is not None and weight_out.data_ptr() != self._device_weight[group].data_ptr():
                raise ValueError(f"group {group} is stepped on {where} and writes its weights there; "
                                 "pass weight_out=None")
            weight_out = self._device_weight[group]
        if weight_out is not None and (
            weight_out.numel() != n
            or weight_out.dtype not in (torch.bfloat16, torch.float32)
            or not weight_out.is_contiguous()
        ):
            raise ValueError(
                f"group {group}: weight_out must be a contiguous bf16 or fp32 tensor of {n} "
                f"elements, got {weight_out.dtype} with {weight_out.numel()}"
            )
        if not on_device:
            self._check_weight_out(group, weight_out)
        out = None if weight_out is None else weight_out.view(-1)
        step = self.steps[group] + 1
        # the kernel takes a split master as (weight_out, remainder), `master` only sizing it,
        # and a bf16 master as `master` alone; the weights of either are written with it
        remainder, offset = None, self.group_offsets[group]
        if isinstance(master, SplitMaster):
            out, remainder = master.weight, master.remainder
        elif isinstance(master, Bf16Master):
            out = None
        flat = master.weight if isinstance(master, Bf16Master) else out if remainder is not None else master
        rounding = (rounding_key(self.seed, group, step), offset) if self.rounding == "stochastic" else None
        return _StepInputs(
            master=master, grad=grad.reshape(-1).contiguous(), out=out, remainder=remainder, flat=flat,
            on_device=on_device, step=step, offset=offset,
            scalars=StepScalars.of(self.config, step, lr, clip_coef, self.decay_numel[group]),
            rounding=rounding, master_rounding=(weight_rounding_key(self.seed, group, step), offset),
        )

    def step_group(
        self,
        group: int,
        grad: torch.Tensor,
        clip_coef: float,
        lr: float,
        weight_out: torch.Tensor | None,
    ) -> None:
        i = self._step_inputs(group, grad, clip_coef, lr, weight_out)
        master, grad, out, s, state = i.master, i.grad, i.out, i.scalars, self.states[group]
        if isinstance(state, QuantizedState):
            rounding = i.rounding
            if i.on_device and grad.device.type == "cuda":
                device_step_8bit(grad, master, state, out, s, rounding, master_rounding=i.master_rounding)
            elif self._kernel is None or i.on_device:
                torch_step_8bit(grad, master, state, out, s, rounding, master_rounding=i.master_rounding)
            else:
                self._kernel.step_8bit(
                    grad, i.flat, state.m_codes, state.m_absmax, state.v_codes, state.v_absmax, out, i.remainder,
                    self._tables, *i.kernel_scalars, s.decay_numel, rounding is not None,
                    rounding[0] if rounding else 0, i.offset, i.master_rounding[0],
                )  # fmt: skip
        elif self._kernel is None or i.on_device:
            torch_step_fp32(grad, master, state, out, s, i.master_rounding)
        else:
            self._kernel.step_fp32(grad, i.flat, state.exp_avg, state.exp_avg_sq, out, i.remainder,
                                   *i.kernel_scalars, s.decay_numel, i.offset, i.master_rounding[0])
        self.steps[group] = i.step

    def state_dict(self) -> dict:
        self.to_host()  # the host tensors are the state that is saved
        return {
            "kind": "hybrid8bit",
            "format": STATE_FORMAT,
            "steps": list(self.steps),
            "groups": [state.tensors() for state in self.states],
        }

    def load_state_dict(self, state: dict) -> None:
        # loaded into the host tensors, which the store's masters (restored first) are for the
        # masters: the device copies are dropped, not copied back over them; a group goes to its
        # device again when it is next stepped there
        self._drop_device()
        if state.get("kind") != "hybrid8bit":
            raise ValueError(
                f"optimizer state is of kind {state.get('kind')!r}, this optimizer is "
                "'hybrid8bit'; resume with the optimizer the checkpoint was made with"
            )
        fmt = state.get("format")
        if fmt != STATE_FORMAT and fmt not in OLD_STATE_FORMATS:
            raise ValueError(
                f"8-bit optimizer state has format {fmt!r}, this version reads "
                f"{[STATE_FORMAT, *OLD_STATE_FORMATS]}"
            )
        block, holds_root = (BLOCK, True) if fmt == STATE_FORMAT else OLD_STATE_FORMATS[fmt]
        groups = state["groups"]
        if len(groups) != len(self.states) or len(state["steps"]) != len(self.states):
            raise ValueError(
                f"optimizer state has {len(groups)} groups, the model has {len(self.states)}"
            )
        for g, (saved, own) in enumerate(zip(groups, self.states)):
            tensors = own.tensors()
            if set(saved) != set(tensors):
                raise ValueError(
                    f"group {g}: saved state holds {sorted(saved)}, expected {sorted(tensors)} "
                    "(8-bit and fp32 groups differ: was the model's grouping changed?)"
                )
            for name, dst in tensors.items():
                src = saved[name]
                shape = dst.shape
                if name.endswith("absmax"):  # one per block of the saved format
                    shape = torch.Size([num_blocks(own.m_codes.numel(), block)])
                if src.shape != shape or src.dtype != dst.dtype:
                    raise ValueError(
                        f"group {g}: saved {name} is {src.dtype}{list(src.shape)}, "
                        f"expected {dst.dtype}{list(shape)}"
                    )
        for saved, own in zip(groups, self.states):
            if fmt == STATE_FORMAT or not isinstance(own, QuantizedState):
                for name, dst in own.tensors().items():
                    dst.copy_(saved[name])
                continue
            # an earlier format: dequantize with its blocks, requantize with this one's
            mt, vt = signed_tables(), unsigned_tables()
            m = dequantize_blockwise(saved["m_codes"], saved["m_absmax"], mt, block)
            second = dequantize_blockwise(saved["v_codes"], saved["v_absmax"], vt, block)
            converted = QuantizedState.of_moments(m, second * second if holds_root else second)
            for name, dst in own.tensors().items():
                dst.copy_(converted.tensors()[name])
        self.steps = [int(s) for s in state["steps"]]

    def state_bytes(self) -> int:
        return sum(
            t.numel() * t.element_size() for state in self.states for t in state.tensors().values()
        )

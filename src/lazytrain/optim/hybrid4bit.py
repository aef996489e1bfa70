"""Hybrid 4-bit AdamW: blockwise 4-bit m and sqrt(v) on the CPU, fused with clipping and the bf16 write.

The 8-bit optimizer (``hybrid8bit.py``) with half the bits, as torchao's AdamW4bit and lpmm
("Memory Efficient Optimizers with 4-bit States", Li et al. 2023) keep them: two codes per
byte plus one fp32 absmax per block of ``BLOCK`` = 128 elements, for m and for the second
moment: 2 * (0.5 + 4 / 128) = 1.0625 bytes per parameter instead of 2.06 (8-bit) or 8 (fp32).
Groups under ``MIN_8BIT_NUMEL`` elements (and those in ``fp32_groups``) keep fp32 states, by the
8-bit rule.

The maps (16 codes each):

* m: the signed dynamic map with 3 exponent bits (bitsandbytes' construction at 4 bits, which
  torchao and lpmm use): 0, +-0.0055, +-0.0325, +-0.0775, +-0.2125, +-0.4375, +-0.6625,
  +-0.8875 and 1.
* second moment: the linear map without zero, k / 16 for k = 1..16 (lpmm's finding: a map with
  a zero code rounds small second moments to 0, and the next step divides m by eps alone).

What the second-moment codes hold is sqrt(v), as in the 8-bit optimizer, not v as torchao and
lpmm store it. Measured in a float64 simulation (``bench/studies/optim_4bit_second_moment.py``,
``bench/results/optim_4bit_second_moment_2026-12-06.md``: 32768 parameters, 400 steps,
beta2 = 0.999, per-block gradient scales over 2 decades, log-normal spread inside a block, a
seventh of the gradients shrinking 100x half-way): the weights' distance from float64 AdamW's
after 400 steps, relative to their displacement, is 0.28 storing sqrt(v) against 0.36 storing v
(spread sigma 0.5), 0.49 against 0.72 (sigma 1.0); blocks of 256 were worse than 128 (0.31
and 0.40 at sigma 0.5). Linear codes of v leave every v under 1/32 of its block's
largest on the first code, 1/16 of it: the small second moments, whose elements take the
largest steps, are overstated up to 16x and those elements barely move. The first code of
sqrt(v) is 1/16 of the block's largest sqrt(v): a v down to 1/256 of the largest v keeps its
own code. The price:
single updates up to 6.1 lr (sqrt(v)) against 2.8 lr (v) in that run, fp64 AdamW's 1.3 (no
zero code either way, so no update is unbounded). A short run of the built-in default agrees
(60 steps, one seed: mean loss of the last 20 steps 1.159 with sqrt(v) codes, 1.214 with v
codes, 1.069 with fp32 states; ``..._2026-12-06_runs.md``). Stochastic rounding of the sqrt(v) codes did
not help there (0.28 -> 0.28, 0.49 -> 0.50).

What does help is rounding m's codes stochastically. A fine-tune's CPU proxy (5 seeds,
``bench/results/finetune_8bit_tiny_2026-12-06_cpu_bf16_proxy_s1-5.md``) ended 4-bit states with
nearest codes at 1.097x fp32's tail loss; keeping m in fp32 brought it to 1.0002-1.0015x and
sqrt(v) in fp32 only to 1.065-1.068x (``bench/studies/optim_4bit_first_moment.py``). m moves by
(1 - beta1) of the gradient a step, often less than half the gap between its codes (0.2125 and
0.4375 are neighbours): a nearest code rounds the change away and m sits at the code below or
above its value for as long as the gradient holds (``tests/test_optim_hybrid4bit.py``, m held
at 0.71 of its value). So ``optimizer.state_rounding=stochastic`` rounds both moments' codes
stochastically at 4 bits, each element's m and sqrt(v) drawn under two unrelated keys
(``quant.moment_rounding_key``, ``quant.rounding_key``) from the 8-bit step's hash
(``quant.rounding_uniforms``), and ``auto`` is stochastic for 4-bit states. The saved codes
are the same format either way.

One step is one pass over memory (``csrc/hybrid4bit.cpp``, every ``kernel.VARIANTS`` path), or
`torch_step_4bit`'s torch ops where the kernel does not build, and on a GPU (`to_device`,
`stream_in`) the same math compiled (`device_step_4bit`, the 8-bit step's driver
`hybrid8bit.device_step` with `_device_piece4`; eager torch ops in pieces of ``DEVICE_CHUNK``
where compiling fails). The nearest code is the count of the map's midpoints below the
value (ties to the lower code) on both paths; they differ by the kernel's sqrt and reciprocal
estimates (about an ulp), which can move a value on a midpoint to the neighbouring code.

The master is read and written in one place per path, the 8-bit step's own:
``master.master_chunk`` / ``master.store_master_chunk`` on the torch path and ``load_master`` /
``store_master`` (``csrc/master.h``, included by both kernels) in the kernel: the fp32 master,
the split master (``split.py``, exact) or a bf16 master (``memory.master=bf16``: the streamed
weight, stochastically rounded when written). Its key (``quant.weight_rounding_key``) and draw
per element are the 8-bit step's, so the same fp32 update gives the same bf16 weight with
either state format.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from functools import cache

import torch

from lazytrain.optim.hybrid8bit import (
    DEVICE_CHUNK,
    TORCH_CHUNK,
    DevicePiece,
    Hybrid8bitAdamW,
    StepScalars,
    _adam_update,
    device_step,
    is_8bit,
    piece_adamw,
    piece_master,
    piece_store,
    torch_step_fp32,
)
from lazytrain.optim.master import Master, master_chunk, store_master_chunk
from lazytrain.optim.quant import (
    BLOCK,
    TINY,
    moment_rounding_key,
    num_blocks,
    rounding_uniforms,
    uniforms_at,
)

STATE_FORMAT = f"de4-linear4nz-block{BLOCK}-sqrtv"
"""Names the maps (signed dynamic m, linear no-zero second moment), the block size and what
the second-moment codes hold (sqrt(v)) of saved 4-bit codes."""

CODES = 16


def dynamic_map4() -> torch.Tensor:
    """The signed dynamic map at 4 bits (3 exponent bits): bitsandbytes' ``create_dynamic_map``
    construction, float32, sorted. Per decade i = 0, 1, 2 of 1e-2, 1e-1, 1: the midpoints of
    2**i equal steps of [0.1, 1], both signs; then 0 and 1."""
    values = [0.0, 1.0]
    for i in range(3):
        edges = torch.linspace(0.1, 1, 2**i + 1, dtype=torch.float32)
        means = ((edges[:-1] + edges[1:]) / 2.0 * 10 ** (i - 2)).tolist()
        values += means + [-x for x in means]
    return torch.tensor(sorted(values), dtype=torch.float32)


def linear_map4() -> torch.Tensor:
    """The unsigned linear map without zero: k / 16, k = 1..16."""
    return torch.arange(1, CODES + 1, dtype=torch.float32) / CODES


@dataclass(frozen=True)
class Map4:
    """One 16-code map and its midpoints ([k] between codes k and k + 1, [15] = inf)."""

    qmap: torch.Tensor
    midpoints: torch.Tensor


@cache
def maps_on(device: torch.device | str = "cpu") -> tuple[Map4, Map4]:
    """(m's map, sqrt(v)'s map) with their tensors on ``device``."""
    maps = []
    for qmap in (dynamic_map4(), linear_map4()):
        if qmap.numel() != CODES or not bool((qmap[1:] > qmap[:-1]).all()):
            raise AssertionError("a 4-bit map must hold 16 increasing codes")
        mid = ((qmap[:-1].double() + qmap[1:].double()) / 2).float()
        maps.append(Map4(qmap.to(device), torch.cat([mid, torch.tensor([math.inf])]).to(device)))
    return maps[0], maps[1]


def pack(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes (< 16) two to a byte, the even element in the low nibble."""
    n = codes.numel()
    padded = torch.nn.functional.pad(codes.reshape(-1).to(torch.uint8), (0, n % 2)).view(-1, 2)
    return padded[:, 0] | (padded[:, 1] << 4)


def unpack(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The ``numel`` uint8 codes of `pack`'s bytes."""
    return torch.stack([packed & 15, packed >> 4], dim=1).reshape(-1)[:numel]


def stochastic_codes4(x: torch.Tensor, nearest: torch.Tensor, qmap: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The code below or above normalized ``x``, from its nearest code: the upper one with
    probability (x - below) / (above - below), so the expected code value is ``x`` (clamped
    to the map's ends). ``quant.stochastic_codes`` for a 16-code map without zero."""
    c = nearest.long()
    qc = qmap[c]
    n = torch.where(x >= qc, c + 1, c - 1).clamp(0, CODES - 1)
    qn = qmap[n]
    a, b = torch.minimum(qc, qn), torch.maximum(qc, qn)
    up = (uniforms < (x - a) / (b - a)) & (b > a)
    return (torch.minimum(c, n) + up.long()).to(torch.uint8)


def quantize4(
    x: torch.Tensor, table: Map4, uniforms: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed uint8 codes[ceil(n / 2)], float32 absmax[blocks]) of flat float ``x``: nearest
    codes (midpoints counted below each value, as the kernel counts them), or with
    ``uniforms`` stochastically rounded ones. Blocks with an absmax under the smallest normal
    float are stored as zeros, as 8-bit blocks are."""
    n = x.numel()
    padded = torch.nn.functional.pad(x.reshape(-1).float(), (0, num_blocks(n) * BLOCK - n))
    blocks = padded.view(-1, BLOCK)
    absmax = blocks.abs().amax(dim=1)
    absmax = torch.where(absmax >= TINY, absmax, torch.zeros_like(absmax))
    inv = torch.where(absmax > 0, 1.0 / absmax, torch.zeros_like(absmax))
    normalized = (blocks * inv[:, None]).reshape(-1)[:n]
    codes = torch.bucketize(normalized, table.midpoints[: CODES - 1], right=False).to(torch.uint8)
    if uniforms is not None:
        codes = stochastic_codes4(normalized, codes, table.qmap, uniforms)
    return pack(codes), absmax


def dequantize4(packed: torch.Tensor, absmax: torch.Tensor, table: Map4, numel: int) -> torch.Tensor:
    """float32[numel] values of `quantize4`'s codes."""
    return table.qmap[unpack(packed, numel).long()] * absmax.repeat_interleave(BLOCK)[:numel]


@dataclass(slots=True)
class Quantized4bitState:
    """One group's 4-bit state: the tensors of ``hybrid8bit.QuantizedState`` (same names, so
    the device moves and checkpoints treat both alike), the codes two to a byte."""

    m_codes: torch.Tensor
    m_absmax: torch.Tensor
    v_codes: torch.Tensor
    """Codes of sqrt(v) in the linear map."""
    v_absmax: torch.Tensor
    """Per block, the largest sqrt(v)."""

    @classmethod
    def zeros(cls, numel: int) -> Quantized4bitState:
        # an all-zero block (absmax 0) decodes to zeros whatever its codes
        blocks, nbytes = num_blocks(numel), -(-numel // 2)
        return cls(m_codes=torch.zeros(nbytes, dtype=torch.uint8), m_absmax=torch.zeros(blocks),
                   v_codes=torch.zeros(nbytes, dtype=torch.uint8), v_absmax=torch.zeros(blocks))

    @classmethod
    def of_moments(cls, m: torch.Tensor, v: torch.Tensor) -> Quantized4bitState:
        """The quantized state of float moments ``m`` and ``v`` (flat)."""
        mt, vt = maps_on("cpu")
        m_codes, m_absmax = quantize4(m, mt)
        v_codes, v_absmax = quantize4(v.float().sqrt(), vt)
        return cls(m_codes=m_codes, m_absmax=m_absmax, v_codes=v_codes, v_absmax=v_absmax)

    def moments(self, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 (m, v) of the first ``numel`` elements that the codes stand for."""
        mt, vt = maps_on(self.m_codes.device)
        root = dequantize4(self.v_codes, self.v_absmax, vt, numel)
        return dequantize4(self.m_codes, self.m_absmax, mt, numel), root * root

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"m_codes": self.m_codes, "m_absmax": self.m_absmax, "v_codes": self.v_codes,
                "v_absmax": self.v_absmax}

    def piece(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(m codes, m absmax, v codes, v absmax) of elements ``lo .. hi - 1`` (whole blocks, ``lo``
        even: the packed bytes of exactly these elements)."""
        blocks, nbytes = slice(lo // BLOCK, num_blocks(hi)), slice(lo // 2, -(-hi // 2))
        return self.m_codes[nbytes], self.m_absmax[blocks], self.v_codes[nbytes], self.v_absmax[blocks]


def state_bytes_per_param(numels: Sequence[int], fp32_groups: Collection[int] = ()) -> float:
    """Bytes of state per parameter of groups of ``numels`` elements, as Hybrid4bitAdamW keeps
    them (1.0625 for a large 4-bit group)."""
    total = 0
    for g, n in enumerate(numels):
        total += 2 * (-(-n // 2)) + 8 * num_blocks(n) if is_8bit(n) and g not in fp32_groups else 8 * n
    return total / max(sum(numels), 1)


def torch_step_4bit(
    grad: torch.Tensor,
    master: Master,
    state: Quantized4bitState,
    weight_out: torch.Tensor | None,
    s: StepScalars,
    rounding: tuple[int, int] | None = None,
    master_rounding: tuple[int, int] | None = None,
    m_rounding: tuple[int, int] | None = None,
) -> None:
    """The kernel's step with torch ops on the tensors' device, a piece at a time
    (``TORCH_CHUNK`` elements on the CPU, ``DEVICE_CHUNK`` on a GPU: whole blocks, an even
    count). ``rounding``: (key, index of the first element in its whole group) to round
    sqrt(v) stochastically; ``m_rounding``: the same for m (``quant.moment_rounding_key``);
    ``master_rounding``: the same for a bf16 master's weights (``quant.weight_rounding_key``;
    needed for a `Bf16Master`), as `torch_step_8bit`'s."""
    device = grad.device
    mt, vt = maps_on(device)
    n = master.numel()
    step = TORCH_CHUNK if device.type == "cpu" else DEVICE_CHUNK
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        chunk = master_chunk(master, lo, hi)
        blocks, nbytes = slice(lo // BLOCK, num_blocks(hi)), slice(lo // 2, -(-hi // 2))
        m = dequantize4(state.m_codes[nbytes], state.m_absmax[blocks], mt, hi - lo)
        root = dequantize4(state.v_codes[nbytes], state.v_absmax[blocks], vt, hi - lo)
        decay_numel = min(max(s.decay_numel - lo, 0), hi - lo)
        m, v = _adam_update(chunk, grad[lo:hi], m, root * root, s, decay_numel)
        m_draw, v_draw = (None if keyed is None else rounding_uniforms(keyed[0], keyed[1] + lo, hi - lo, device)
                          for keyed in (m_rounding, rounding))
        for codes, absmax, x, table, u in (("m_codes", "m_absmax", m, mt, m_draw),
                                           ("v_codes", "v_absmax", v.sqrt(), vt, v_draw)):
            new_codes, new_absmax = quantize4(x, table, uniforms=u)
            getattr(state, codes)[nbytes].copy_(new_codes)
            getattr(state, absmax)[blocks].copy_(new_absmax)
        store_master_chunk(master, chunk, weight_out, lo, hi, master_rounding)


def _device_piece4(grad: torch.Tensor, weight: torch.Tensor, remainder: torch.Tensor | None,
                   m_codes: torch.Tensor, m_absmax: torch.Tensor, v_codes: torch.Tensor, v_absmax: torch.Tensor,
                   weight_out: torch.Tensor | None, scalars: torch.Tensor, ints: torch.Tensor,
                   mt: Map4, vt: Map4, stochastic: bool) -> None:
    """One piece of `torch_step_4bit`'s math, for `torch.compile` on a GPU: the 8-bit piece's
    arguments (`hybrid8bit._device_piece`: ``scalars``, the master's forms) with 4-bit codes
    and maps, and ``ints`` = (index of the piece's first element in its group, decay_numel,
    sqrt(v)'s rounding key, a bf16 master's rounding key, m's rounding key, 0, 0, 0); with
    ``stochastic`` both moments' codes are drawn. Eagerly it equals `torch_step_4bit` bit for
    bit (`tests/test_optim_hybrid4bit.py`)."""
    n = grad.numel()
    local = torch.arange(n, device=grad.device)
    index = local + ints[0]
    master, bf16_master = piece_master(weight, remainder)
    new, m, v = piece_adamw(master, dequantize4(m_codes, m_absmax, mt, n), dequantize4(v_codes, v_absmax, vt, n),
                            grad, scalars, local, ints[1])
    for codes, absmax, x, table, key in ((m_codes, m_absmax, m, mt, ints[4]), (v_codes, v_absmax, v.sqrt(), vt, ints[2])):
        new_codes, new_absmax = quantize4(x, table, uniforms=uniforms_at(key, index) if stochastic else None)
        codes.copy_(new_codes)
        absmax.copy_(new_absmax)
    piece_store(new, weight, remainder, weight_out, bf16_master, ints[3], index)


PIECE_4BIT = DevicePiece(_device_piece4, "4-bit")


def device_step_4bit(
    grad: torch.Tensor,
    master: Master,
    state: Quantized4bitState,
    weight_out: torch.Tensor | None,
    s: StepScalars,
    rounding: tuple[int, int] | None = None,
    master_rounding: tuple[int, int] | None = None,
    m_rounding: tuple[int, int] | None = None,
    chunk: int | None = None,
) -> None:
    """`torch_step_4bit` on a GPU: the same math, `_device_piece4` compiled
    (`hybrid8bit.device_step`); ``rounding`` and ``m_rounding`` both or neither."""
    if (rounding is None) != (m_rounding is None):
        raise ValueError("4-bit states round both moments stochastically or neither: pass rounding and "
                         "m_rounding together")
    device_step(PIECE_4BIT, maps_on(grad.device), grad, master, state, weight_out, s, rounding, chunk,
                master_rounding, 0 if m_rounding is None else m_rounding[0])


class Hybrid4bitAdamW(Hybrid8bitAdamW):
    """AdamW with blockwise 4-bit states (1.06 bytes per parameter), fused on the CPU.

    `Hybrid8bitAdamW` with `Quantized4bitState` and the 4-bit kernel: the same arguments
    (``kernel``, ``fp32_groups``, ``group_numels``, ``group_offsets``, ``rounding``, ``seed``),
    the same device moves (`to_device`, `stream_in`, `stream_out`), checkpoints of format
    `STATE_FORMAT` (kind ``hybrid4bit``).
    """

    KERNEL = "hybrid4bit"
    QUANTIZED = Quantized4bitState

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        mt, vt = maps_on("cpu")
        self._tables = [mt.qmap, mt.midpoints, vt.qmap, vt.midpoints]

    @property
    def device_step_chunk(self) -> int:
        return PIECE_4BIT.chunk()

    def step_group(
        self,
        group: int,
        grad: torch.Tensor,
        clip_coef: float,
        lr: float,
        weight_out: torch.Tensor | None,
    ) -> None:
        # the 8-bit step's checks and keys (`_step_inputs`): a bf16 master is rounded under the
        # same key, with the same draw per element, as an 8-bit run's
        i = self._step_inputs(group, grad, clip_coef, lr, weight_out)
        master, grad, out, s, state = i.master, i.grad, i.out, i.scalars, self.states[group]
        if isinstance(state, Quantized4bitState):
            # stochastic rounding covers both moments at 4 bits (module docstring)
            m_rounding = None if i.rounding is None else (moment_rounding_key(self.seed, group, i.step), i.offset)
            if i.on_device and grad.device.type == "cuda":
                device_step_4bit(grad, master, state, out, s, i.rounding, i.master_rounding, m_rounding)
            elif self._kernel is None or i.on_device:
                torch_step_4bit(grad, master, state, out, s, i.rounding, i.master_rounding, m_rounding)
            else:
                self._kernel.step_4bit(grad, i.flat, state.m_codes, state.m_absmax, state.v_codes,
                                       state.v_absmax, out, i.remainder, self._tables, *i.kernel_scalars,
                                       s.decay_numel, i.rounding is not None, i.rounding[0] if i.rounding else 0,
                                       m_rounding is not None, m_rounding[0] if m_rounding else 0,
                                       i.offset, i.master_rounding[0])
        elif self._kernel is None or i.on_device:
            torch_step_fp32(grad, master, state, out, s, i.master_rounding)
        else:
            self._kernel.step_fp32(grad, i.flat, state.exp_avg, state.exp_avg_sq, out, i.remainder,
                                   *i.kernel_scalars, s.decay_numel, i.offset, i.master_rounding[0])
        self.steps[group] = i.step

    def state_dict(self) -> dict:
        self.to_host()  # the host tensors are the state that is saved
        return {"kind": "hybrid4bit", "format": STATE_FORMAT, "steps": list(self.steps),
                "groups": [state.tensors() for state in self.states]}

    def load_state_dict(self, state: dict) -> None:
        """Load a `state_dict` of this kind and format. 8-bit state (kind ``hybrid8bit``) is
        refused, not converted: requantizing its m and sqrt(v) to 4 bits would be cheap, but the
        run would not continue as either the 8-bit or a 4-bit run from the start would."""
        self._drop_device()  # as the 8-bit optimizer: the host tensors are loaded
        kind = state.get("kind")
        if kind != "hybrid4bit":
            raise ValueError(
                f"optimizer state is of kind {kind!r}, this optimizer is 'hybrid4bit' (optimizer.kind="
                f"hybrid4bit); resume with the optimizer the checkpoint was made with (optimizer.kind={kind})"
            )
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"4-bit optimizer state has format {state.get('format')!r}, this version reads "
                             f"{STATE_FORMAT!r}")
        groups = state["groups"]
        if len(groups) != len(self.states) or len(state["steps"]) != len(self.states):
            raise ValueError(f"optimizer state has {len(groups)} groups, the model has {len(self.states)}")
        for g, (saved, own) in enumerate(zip(groups, self.states)):
            tensors = own.tensors()
            if set(saved) != set(tensors):
                raise ValueError(f"group {g}: saved state holds {sorted(saved)}, expected {sorted(tensors)} "
                                 "(4-bit and fp32 groups differ: was the model's grouping changed?)")
            for name, dst in tensors.items():
                src = saved[name]
                if src.shape != dst.shape or src.dtype != dst.dtype:
                    raise ValueError(f"group {g}: saved {name} is {src.dtype}{list(src.shape)}, "
                                     f"expected {dst.dtype}{list(dst.shape)}")
        for saved, own in zip(groups, self.states):
            for name, dst in own.tensors().items():
                dst.copy_(saved[name])
        self.steps = [int(s) for s in state["steps"]]

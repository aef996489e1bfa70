"""Blockwise 8-bit quantization of optimizer states with bitsandbytes' dynamic maps.

A state tensor is cut into blocks of ``BLOCK`` elements; each block keeps its absolute
maximum in fp32 and one byte per element: the index of the code (in a sorted 256-entry map
of values in [-1, 1]) nearest to ``value / absmax``. The signed dynamic map (for Adam's
first moment) and the unsigned one (for the square root of the second) are bitsandbytes'
``create_dynamic_map``: a decimal exponent followed by a linear fraction, so small values
keep relative precision over seven decades.

The nearest code of ``x`` is the number of midpoints between adjacent codes that lie below
``x``. Two exact ways to find it without a search, both built and checked here:

* Bucket table (the pure-torch path, and the kernel without AVX-512 VBMI): the top bits of a
  float32 (sign, exponent and 6 mantissa bits for the signed map, 7 for the twice as dense
  unsigned one) cut [-2, 2] into buckets that each hold at most one midpoint. One 32-bit entry
  per bucket holds the code of the bucket's lowest value and the low bits of the midpoint
  inside it: one look-up and one integer compare give the code.
* Pieces (the kernel with AVX-512 VBMI, where table look-ups of 256 bytes are register
  shuffles but gathers from a large table are slow): the positive codes form a few arithmetic
  runs ("pieces": zero, one per decade, 1.0). The float's binade and one compare pick the
  piece, ``floor((|x| - first) / spacing)`` clamped to the piece gives a code ``e`` with the
  answer in {e, e + 1}, and one compare with ``midpoints[e]`` decides. Negative ``x`` of the
  signed map use the mirror image of the positive codes.

Blocks whose absmax is below the smallest normal float32 are stored as zeros, so that
``1 / absmax`` is always finite.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cache

import torch

BLOCK = 128
"""Elements per quantization block (one fp32 absmax each): 2 + 8 / 128 = 2.0625 bytes of state
per parameter. bitsandbytes uses 256; along a training run of the built-in model, 128 halves
how far 8-bit updates drift from fp32 ones (``bench/studies/optim_update_error.py``)."""

TINY = torch.finfo(torch.float32).tiny
"""Blocks with a smaller absmax are stored as zero."""

LUT_EXP_MIN = 103
"""Smallest float32 biased exponent with its own buckets (2**-24); below, every code is 0."""
LUT_EXP_END = 128
"""One past the largest exponent with buckets: [1, 2) is the last binade (|x| <= 1 + rounding)."""

PIECE_EXP_MIN = 104
"""Binade index of the piece tables = clamp(biased exponent - PIECE_EXP_MIN, 0, 31)."""
PIECE_SLOTS = 16
"""Entries per piece table (9 pieces are used)."""


def create_dynamic_map(signed: bool) -> torch.Tensor:
    """bitsandbytes' ``create_dynamic_map(signed, max_exponent_bits=7, total_bits=8)``, float32."""
    max_exponent_bits, non_sign_bits = 7, 7
    data: list[float] = []
    for i in range(max_exponent_bits):
        extra = 0 if signed else 1
        fraction_items = 2 ** (i + non_sign_bits - max_exponent_bits + extra) + 1
        boundaries = torch.linspace(0.1, 1, fraction_items, dtype=torch.float32)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
        if signed:
            data += (-(10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
    data += [0.0, 1.0]
    if len(data) != 256:
        raise AssertionError(f"dynamic map has {len(data)} entries, expected 256")
    return torch.tensor(sorted(data), dtype=torch.float32)


@dataclass(frozen=True)
class QuantTables:
    """Everything needed to quantize to and dequantize from one 256-entry map."""

    signed: bool
    qmap: torch.Tensor
    """float32[256], sorted code values."""
    midpoints: torch.Tensor
    """float32[256]: ``midpoints[k]`` lies halfway between codes k and k+1; [255] is inf."""
    mantissa_bits: int
    """Mantissa bits in the bucket index: bucket = bits >> (23 - mantissa_bits), clamped."""
    lut: torch.Tensor
    """int32[2 * buckets]: positive magnitudes, then negative ones. Entry = base | key << 8:
    base is the code of the bucket's lowest value; key compares with the low bits of ``x``
    (complemented for negative ``x``) and is all ones when no midpoint lies in the bucket."""
    pieces: torch.Tensor
    """int32[128], the piece tables (float32 entries stored as their bits): first value,
    1 / spacing, first code, last code - first code (16 slots each), then per binade the
    piece of its lowest value and the first value of the next piece if it starts inside the
    binade, else inf (32 slots each)."""
    zero_code: int
    """Index of 0.0 in ``qmap``: the code of an all-zero state."""

    @property
    def shift(self) -> int:
        return 23 - self.mantissa_bits

    @property
    def buckets(self) -> int:
        """Buckets per sign."""
        return (LUT_EXP_END - LUT_EXP_MIN) << self.mantissa_bits


def _code_by_count(x: torch.Tensor, midpoints: torch.Tensor) -> torch.Tensor:
    """Nearest code as the count of midpoints strictly below ``x`` (ties go to the lower code)."""
    return torch.bucketize(x, midpoints[:255], right=False)


def _as_float(bits: torch.Tensor) -> torch.Tensor:
    """float32 of non-negative int64 bit patterns below 2**31."""
    return bits.to(torch.int32).view(torch.float32)


def _bucket_table(qmap: torch.Tensor, midpoints: torch.Tensor, mantissa_bits: int) -> torch.Tensor:
    shift = 23 - mantissa_bits
    low_mask = (1 << shift) - 1
    buckets = (LUT_EXP_END - LUT_EXP_MIN) << mantissa_bits
    # Bucket b covers the float32 magnitudes whose bits >> shift equal first + b; the first
    # bucket also takes everything smaller, the last everything larger (inf, NaN).
    top = torch.arange(buckets, dtype=torch.int64) + (LUT_EXP_MIN << mantissa_bits)
    lo_bits, hi_bits = top << shift, (top << shift) | low_mask
    lo_bits[0], hi_bits[-1] = 0, 0x7F800000
    lo_mag, hi_mag = _as_float(lo_bits), _as_float(hi_bits)
    mid_bits = midpoints.view(torch.int32).to(torch.int64)
    mid_top = (mid_bits & 0x7FFFFFFF) >> shift
    lut = torch.empty(2 * buckets, dtype=torch.int64)
    for half, (low, high) in enumerate(((lo_mag, hi_mag), (-hi_mag, -lo_mag))):
        base = _code_by_count(low, midpoints)
        crossing = _code_by_count(high, midpoints) - base
        if int(crossing.max()) > 1 or int(crossing[0]) or int(crossing[-1]):
            raise AssertionError("a quantization bucket holds two midpoints; use more bits")
        # where x crosses a midpoint inside bucket b, it is midpoints[base[b]]
        mid = base.clamp(max=254)
        inside = crossing == 1
        if not bool((mid_top[mid[inside]] == top[inside]).all()):
            raise AssertionError("a midpoint lies outside the bucket it was assigned to")
        key = mid_bits[mid] & low_mask
        if half:
            key = low_mask - key
        key = torch.where(inside, key, low_mask)
        lut[half * buckets : (half + 1) * buckets] = base | (key << 8)
    return lut.to(torch.int32)


def _piece_table(qmap: torch.Tensor, signed: bool, zero_code: int) -> torch.Tensor:
    # pieces of the positive codes: zero, one per level of create_dynamic_map, then 1.0
    runs = [(zero_code, zero_code)]
    first = zero_code + 1
    for i in range(7):
        count = 2**i if signed else 2 ** (i + 1)
        runs.append((first, first + count - 1))
        first += count
    runs.append((255, 255))
    if first != 255:
        raise AssertionError("the map's levels do not add up to 256 codes")
    x0, inv, base, span = [], [], [], []
    for lo, hi in runs:
        values = qmap[lo : hi + 1].double()
        steps = values[1:] - values[:-1]
        if steps.numel() and float((steps / steps.mean() - 1).abs().max()) > 1e-4:
            raise AssertionError(f"codes {lo}..{hi} are not evenly spaced")
        x0.append(float(qmap[lo]))
        inv.append(0.0 if hi == lo else (hi - lo) / float(values[-1] - values[0]))
        base.append(lo)
        span.append(hi - lo)
    starts = torch.tensor(x0, dtype=torch.float32)
    piece_lo, next_start = [], []
    for b in range(32):
        low = 0.0 if b == 0 else 2.0 ** (b + PIECE_EXP_MIN - 127)
        high = 2.0 ** (b + 1 + PIECE_EXP_MIN - 127)
        inside = [p for p in range(len(runs)) if low < float(starts[p]) < high]
        if len(inside) > 1 or (b == 0 and inside):
            raise AssertionError(f"binade {b} holds more than one piece boundary")
        piece_lo.append(int((starts <= low).sum()) - 1)
        next_start.append(float(starts[inside[0]]) if inside else float("inf"))

    def slots(values: list, dtype: torch.dtype) -> torch.Tensor:
        t = torch.zeros(PIECE_SLOTS, dtype=dtype)
        t[: len(values)] = torch.tensor(values, dtype=dtype)
        return t.view(torch.int32)

    return torch.cat([
        slots(x0, torch.float32),
        slots(inv, torch.float32),
        slots(base, torch.int32),
        slots(span, torch.int32),
        torch.tensor(piece_lo, dtype=torch.int32),
        torch.tensor(next_start, dtype=torch.float32).view(torch.int32),
    ])  # fmt: skip


def piece_estimate(x: torch.Tensor, tables: QuantTables) -> torch.Tensor:
    """The pieces method's first guess ``e`` for ``|x|`` (int64): the code is e or e + 1."""
    p = tables.pieces
    x0, inv = p[0:16].view(torch.float32), p[16:32].view(torch.float32)
    base, span, piece_lo, next_start = p[32:48], p[48:64], p[64:96], p[96:128].view(torch.float32)
    a = x.abs()
    binade = ((a.view(torch.int32) >> 23) - PIECE_EXP_MIN).clamp(0, 31).long()
    piece = piece_lo[binade].long() + (a >= next_start[binade]).long()
    e = torch.floor((a - x0[piece]) * inv[piece]).clamp(min=0).long()
    return base[piece].long() + torch.minimum(e, span[piece].long())


def _check_pieces(tables: QuantTables) -> None:
    """The pieces method must land on the code or one below it for values near every code
    and midpoint: that is all the kernel relies on."""
    spread = torch.rand(1 << 16, generator=torch.Generator().manual_seed(0)) ** 8
    near = torch.cat([tables.qmap, tables.midpoints[:255], spread])
    probes, up, down = [near], near, near
    for _ in range(3):
        up, down = torch.nextafter(up, torch.tensor(2.0)), torch.nextafter(down, torch.tensor(-2.0))
        probes += [up, down]
    x = torch.cat(probes).abs().clamp(max=1.0)
    d = _code_by_count(x, tables.midpoints) - piece_estimate(x, tables)
    if int(d.min()) < 0 or int(d.max()) > 1:
        raise AssertionError("the piece tables miss the nearest code by more than one")


@cache
def build_tables(signed: bool) -> QuantTables:
    qmap = create_dynamic_map(signed)
    if not bool((qmap[1:] > qmap[:-1]).all()):
        raise AssertionError("dynamic map is not strictly increasing")
    zero_code = int((qmap == 0).nonzero()[0, 0])
    if signed and not torch.equal(qmap[:zero_code], -qmap[zero_code + 1 : 255].flip(0)):
        raise AssertionError("the signed map's negative codes must mirror its positive ones")
    midpoints = ((qmap[:-1].double() + qmap[1:].double()) / 2).float()
    midpoints = torch.cat([midpoints, torch.tensor([float("inf")])])
    mantissa_bits = 6 if signed else 7
    tables = QuantTables(
        signed=signed,
        qmap=qmap,
        midpoints=midpoints,
        mantissa_bits=mantissa_bits,
        lut=_bucket_table(qmap, midpoints, mantissa_bits),
        pieces=_piece_table(qmap, signed, zero_code),
        zero_code=zero_code,
    )
    _check_pieces(tables)
    return tables


def signed_tables() -> QuantTables:
    """Tables of the signed dynamic map (Adam's first moment)."""
    return build_tables(True)


def unsigned_tables() -> QuantTables:
    """Tables of the unsigned dynamic map (the square root of Adam's second moment)."""
    return build_tables(False)


@cache
def tables_on(signed: bool, device: torch.device) -> QuantTables:
    """The tables of one map with their tensors on ``device`` (for a step on the GPU)."""
    tables = build_tables(signed)
    if device.type == "cpu":
        return tables
    return replace(tables, **{name: getattr(tables, name).to(device) for name in ("qmap", "midpoints", "lut", "pieces")})


def nearest_code(x: torch.Tensor, tables: QuantTables) -> torch.Tensor:
    """uint8 index of the code nearest to each float32 ``x`` (in [-1, 1]), by bucket table."""
    bits = x.contiguous().view(torch.int32)
    shift, low_mask = tables.shift, (1 << tables.shift) - 1
    negative = bits < 0
    first = LUT_EXP_MIN << tables.mantissa_bits
    bucket = ((bits >> shift) & (0x7FFFFFFF >> shift)) - first
    bucket = bucket.clamp_(0, tables.buckets - 1) + negative.to(torch.int32) * tables.buckets
    entry = tables.lut[bucket.long()]
    key = (bits & low_mask) ^ (negative.to(torch.int32) * low_mask)
    return ((entry & 0xFF) + (key > (entry >> 8)).to(torch.int32)).to(torch.uint8)


def nearest_code_by_pieces(x: torch.Tensor, tables: QuantTables) -> torch.Tensor:
    """The same codes by the pieces method (as the AVX-512 VBMI kernel finds them)."""
    e = piece_estimate(x, tables)
    negative = x.view(torch.int32) < 0
    mid = tables.midpoints[e]
    # a tie goes to the lower code: for negative x, the one further from zero
    code = e + torch.where(negative, x.abs() >= mid, x.abs() > mid).long()
    if tables.signed:
        mirrored = 2 * tables.zero_code - torch.minimum(code, torch.tensor(254))
        code = torch.where(negative, mirrored, code)
    return code.to(torch.uint8)


def num_blocks(numel: int, block: int = BLOCK) -> int:
    return -(-numel // block)


def quantize_blockwise(
    x: torch.Tensor, tables: QuantTables, block: int = BLOCK, uniforms: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 codes[n], float32 absmax[blocks]) of a flat float tensor: nearest codes, or with
    ``uniforms`` (one per element, ``rounding_uniforms``) stochastically rounded ones."""
    n = x.numel()
    padded = torch.nn.functional.pad(x.reshape(-1).float(), (0, num_blocks(n, block) * block - n))
    blocks = padded.view(-1, block)
    absmax = blocks.abs().amax(dim=1)
    absmax = torch.where(absmax >= TINY, absmax, torch.zeros_like(absmax))
    inv = torch.where(absmax > 0, 1.0 / absmax, torch.zeros_like(absmax))
    normalized = (blocks * inv[:, None]).reshape(-1)[:n]
    codes = nearest_code(normalized, tables)
    if uniforms is not None:
        codes = stochastic_codes(normalized, codes, tables, uniforms)
    return codes.clone(), absmax


MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2**32`` of int64 tensors below 2**32, with every product below 2**63."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & MASK32


def fmix32(x: torch.Tensor | int) -> torch.Tensor | int:
    """MurmurHash3's 32-bit finalizer (a bijection of 32-bit integers that mixes every bit
    into every other), of an int or an int64 tensor of values below 2**32."""
    if isinstance(x, int):
        x ^= x >> 16
        x = (x * 0x85EBCA6B) & MASK32
        x ^= x >> 13
        x = (x * 0xC2B2AE35) & MASK32
        return x ^ (x >> 16)
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def rounding_key(seed: int, group: int, step: int) -> int:
    """The 32-bit key of one group's step in stochastic rounding (``rounding_uniforms``)."""
    return fmix32((seed * 0x9E3779B1 + group * 0x85EBCA77 + step * 0xC2B2AE3D) & MASK32)


WEIGHT_STREAM = 0x3C6EF372
"""Mixed into `rounding_key` for a bf16 master's stochastic rounding (`weight_rounding_key`)."""


def weight_rounding_key(seed: int, group: int, step: int) -> int:
    """The 32-bit key of one group's step in a bf16 master's stochastic rounding (``master.py``):
    `rounding_key` hashed again with `WEIGHT_STREAM`, so an element's weight draw and its
    state draw (sqrt(v)) are hashes of one index under two unrelated keys, not one number."""
    return fmix32(rounding_key(seed, group, step) ^ WEIGHT_STREAM)


MOMENT_STREAM = 0x78DDE6E4
"""Mixed into `rounding_key` for the first moment's stochastic rounding (`moment_rounding_key`)."""


def moment_rounding_key(seed: int, group: int, step: int) -> int:
    """The 32-bit key of one group's step in the stochastic rounding of m's codes (4-bit states,
    ``hybrid4bit.py``): `rounding_key` hashed again with `MOMENT_STREAM`, so an element's m draw
    is unrelated to its sqrt(v) draw and its weight draw."""
    return fmix32(rounding_key(seed, group, step) ^ MOMENT_STREAM)


def rounding_uniforms(key: int, first: int, count: int, device: torch.device | None = None) -> torch.Tensor:
    """float32 uniforms in [0, 1) (24 bits) for the elements ``first .. first + count - 1`` of a
    group: a hash of the key and the element's index, so the draw of an element is the same
    whoever computes it (the kernel, this path, a data-parallel rank holding a shard)."""
    return uniforms_at(key, torch.arange(first, first + count, dtype=torch.int64, device=device))


def uniforms_at(key: int | torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`rounding_uniforms` of the elements at int64 ``index`` (``key``: an int, or an int64 tensor
    where the key must not be a constant, as in a compiled step)."""
    return (rounding_bits(key, index) >> 8).to(torch.float32) * 2.0**-24


def rounding_bits(key: int | torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The 32 random bits (int64 values below 2**32) of the elements at int64 ``index`` under
    ``key``: `uniforms_at` takes their top 24, a bf16 master's rounding their top 16."""
    block_key = fmix32(key ^ _mul32(index >> 32, 0x27D4EB2F))
    return fmix32((index & MASK32) ^ block_key)


def stochastic_codes(
    x: torch.Tensor, nearest: torch.Tensor, tables: QuantTables, uniforms: torch.Tensor
) -> torch.Tensor:
    """Stochastic rounding of normalized values ``x`` (in [0, 1]) in the unsigned map, from
    their nearest codes: the code below or above ``x`` with probabilities that make the
    expected code value ``x`` (the lower one's probability is the distance to the upper one
    over their spacing), so small changes of a state average out instead of being rounded
    away. A positive ``x`` never takes the zero code (its second moment would then be 0)."""
    if tables.signed:
        raise ValueError("stochastic rounding is defined for the unsigned map (sqrt(v)) only")
    qmap = tables.qmap
    c = nearest.long()
    qc = qmap[c]
    n = torch.where(x >= qc, c + 1, c - 1).clamp(0, 255)
    qn = qmap[n]
    a, b = torch.minimum(qc, qn), torch.maximum(qc, qn)
    up = (uniforms < (x - a) / (b - a)) & (b > a)
    code = torch.minimum(c, n) + up.long()
    code = torch.where((x > 0) & (code == 0), 1, code)
    return code.to(torch.uint8)


def dequantize_blockwise(
    codes: torch.Tensor, absmax: torch.Tensor, tables: QuantTables, block: int = BLOCK
) -> torch.Tensor:
    """float32[n] values of blockwise codes."""
    n = codes.numel()
    return tables.qmap[codes.long()] * absmax.repeat_interleave(block)[:n]

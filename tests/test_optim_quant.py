"""Blockwise 8-bit quantization: the maps, the exact nearest-code methods, round-trip error."""

from __future__ import annotations

import pytest
import torch

from lazytrain.optim import kernel as kernel_module
from lazytrain.optim import quant
from lazytrain.optim.quant import (
    BLOCK,
    build_tables,
    create_dynamic_map,
    dequantize_blockwise,
    nearest_code,
    nearest_code_by_pieces,
    quantize_blockwise,
)

SIGNS = pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])


def _adversarial(tables: quant.QuantTables, seed: int = 0) -> torch.Tensor:
    """Uniform and log-uniform values, every code and midpoint and their float neighbours."""
    gen = torch.Generator().manual_seed(seed)
    uniform = torch.rand(1 << 16, generator=gen) * 2 - 1
    log_uniform = torch.exp(-torch.rand(1 << 16, generator=gen) * 40) * uniform.sign()
    near = torch.cat([tables.qmap, tables.midpoints[:255], -tables.midpoints[:255]])
    probes = [uniform, log_uniform, near, torch.tensor([0.0, -0.0, 1.0, -1.0, 1e-45, -1e-45])]
    up, down = near, near
    for _ in range(2):
        up, down = torch.nextafter(up, torch.tensor(2.0)), torch.nextafter(down, torch.tensor(-2.0))
        probes += [up, down]
    x = torch.cat(probes).clamp(-1.0, 1.0)
    return x if tables.signed else x.abs()


def _by_count(x: torch.Tensor, tables: quant.QuantTables) -> torch.Tensor:
    """The definition: the number of midpoints strictly below x."""
    return torch.bucketize(x, tables.midpoints[:255], right=False)


def test_signed_map_is_bitsandbytes_dynamic():
    q = create_dynamic_map(signed=True)
    assert q.numel() == 256 and bool((q[1:] > q[:-1]).all())
    assert int((q < 0).sum()) == 127 and int((q == 0).sum()) == 1 and float(q[-1]) == 1.0
    # decade levels of 1, 2, ..., 64 codes; the smallest is 1e-6 * (0.1 + 1) / 2
    assert float(q[128]) == pytest.approx(0.55e-6, rel=1e-6)
    assert float(q[0]) == pytest.approx(-(1 - 0.9 / 128), rel=1e-6)
    assert torch.equal(q[:127], -q[128:255].flip(0))


def test_unsigned_map_is_bitsandbytes_dynamic():
    q = create_dynamic_map(signed=False)
    assert q.numel() == 256 and bool((q[1:] > q[:-1]).all())
    assert float(q[0]) == 0.0 and float(q[-1]) == 1.0
    assert float(q[1]) == pytest.approx(0.325e-6, rel=1e-6)  # 1e-6 * (0.1 + 0.55) / 2
    assert float(q[-2]) == pytest.approx(1 - 0.9 / 256, rel=1e-6)


@SIGNS
def test_bucket_table_finds_the_nearest_code_exactly(signed):
    tables = build_tables(signed)
    x = _adversarial(tables)
    assert torch.equal(nearest_code(x, tables).long(), _by_count(x, tables))


@SIGNS
def test_pieces_find_the_nearest_code_exactly(signed):
    tables = build_tables(signed)
    x = _adversarial(tables, seed=1)
    assert torch.equal(nearest_code_by_pieces(x, tables).long(), _by_count(x, tables))


@SIGNS
@pytest.mark.parametrize("variant", [
    None,  # the native build
    *[pytest.param(name, marks=pytest.mark.skipif(
        bool(kernel_module.missing_cpu_flags(name)),
        reason=f"this CPU cannot run the {name} path (no {' '.join(kernel_module.missing_cpu_flags(name))})"))
      for name in kernel_module.VARIANTS],
])
def test_kernel_finds_the_nearest_code_exactly(signed, variant):
    """Each instruction set's search: the pieces method (AVX-512 VBMI), the bucket table by
    gathers (AVX-512, AVX2) or loads (scalar)."""
    kernel = kernel_module.load_kernel(required=True, variant=variant)
    tables = build_tables(signed)
    # an odd length, so that the SIMD path and the scalar tail both run
    x = torch.cat([_adversarial(tables, seed=2), torch.rand(77) * 2 - 1])
    x = x if signed else x.abs()
    tensors = [tables.qmap, tables.midpoints, tables.lut, tables.pieces]
    assert torch.equal(kernel.nearest_codes(x, tensors, signed).long(), _by_count(x, tables))


@SIGNS
def test_nearest_code_is_nearest_in_float64(signed):
    tables = build_tables(signed)
    x = _adversarial(tables, seed=3)
    code = nearest_code(x, tables).long()
    distance = (x.double()[:, None] - tables.qmap.double()[None, :]).abs()
    best = distance.min(dim=1).values
    # nearest up to the float32 rounding of the midpoints (half an ulp, 2**-24 relative)
    excess = distance.gather(1, code[:, None])[:, 0] - best
    assert bool((excess <= 2.0**-23 * x.abs() + 1e-12).all())


def _blocks(signed: bool, numel: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=gen) * torch.exp(torch.randn(numel, generator=gen) * 2)
    return x if signed else x * x


@SIGNS
@pytest.mark.parametrize("numel", [BLOCK, 10 * BLOCK + 37])
def test_round_trip_error_is_at_most_half_a_code_gap(signed, numel):
    tables = build_tables(signed)
    x = _blocks(signed, numel, seed=numel)
    codes, absmax = quantize_blockwise(x, tables)
    assert absmax.numel() == -(-numel // BLOCK)
    back = dequantize_blockwise(codes, absmax, tables)
    scale = absmax.repeat_interleave(BLOCK)[:numel]
    error = (back - x).abs() / scale
    # half the widest gap between neighbouring codes: 0.9 / 64 (signed), 0.9 / 128 (unsigned)
    widest = 0.9 / 64 if signed else 0.9 / 128
    assert float(error.max()) <= widest / 2 * (1 + 1e-5)
    # and per element, no other code is closer (up to float32 rounding)
    normalized = (x / scale).double()
    gap = (normalized[:, None] - tables.qmap.double()[None, :]).abs().min(dim=1).values
    assert bool(((normalized - tables.qmap[codes.long()].double()).abs() - gap <= 1e-6).all())
    # the block maximum is exact
    blocks = torch.nn.functional.pad(x, (0, absmax.numel() * BLOCK - numel)).view(-1, BLOCK)
    assert torch.equal(absmax, blocks.abs().amax(dim=1))


def test_first_moment_keeps_its_sign():
    tables = build_tables(True)
    x = _blocks(True, 64 * BLOCK, seed=5)
    codes, absmax = quantize_blockwise(x, tables)
    back = dequantize_blockwise(codes, absmax, tables)
    scale = absmax.repeat_interleave(BLOCK)
    # below half the smallest code, a value rounds to zero; above, its sign survives
    zero_below = float(tables.midpoints[tables.zero_code]) * scale
    large = x.abs() > zero_below
    assert torch.equal(back[large].sign(), x[large].sign())
    assert bool((back[~large] == 0).all())
    assert bool((back.sign() * x.sign() >= 0).all())


def test_zero_and_denormal_blocks_are_stored_as_zero():
    tables = build_tables(True)
    x = torch.zeros(3 * BLOCK)
    x[BLOCK:] = torch.randn(2 * BLOCK) * 1e-39  # denormal: 1 / absmax would overflow
    x[2 * BLOCK :] = torch.randn(BLOCK)
    codes, absmax = quantize_blockwise(x, tables)
    assert absmax[0] == 0 and absmax[1] == 0 and absmax[2] > 0
    assert bool((codes[: 2 * BLOCK] == tables.zero_code).all())


def _fmix32(x: int) -> int:
    """MurmurHash3's finalizer, written out on Python ints (the definition)."""
    x ^= x >> 16
    x = (x * 0x85EBCA6B) % 2**32
    x ^= x >> 13
    x = (x * 0xC2B2AE35) % 2**32
    return x ^ (x >> 16)


def test_rounding_uniforms_are_the_hash_of_each_element():
    key = quant.rounding_key(seed=7, group=3, step=11)
    assert key == _fmix32((7 * 0x9E3779B1 + 3 * 0x85EBCA77 + 11 * 0xC2B2AE3D) % 2**32)
    first = 2**32 - 5  # crosses 2**32: the high half of the index keys the draw too
    u = quant.rounding_uniforms(key, first, 10)
    for i, value in enumerate(u.tolist()):
        index = first + i
        block_key = _fmix32(key ^ ((index >> 32) * 0x27D4EB2F) % 2**32)
        assert value == (_fmix32((index % 2**32) ^ block_key) >> 8) * 2.0**-24
    # a shard's draws are the whole group's from its offset on
    whole = quant.rounding_uniforms(key, 0, 5000)
    assert torch.equal(quant.rounding_uniforms(key, 1280, 300), whole[1280:1580])
    assert not torch.equal(quant.rounding_uniforms(key + 1, 0, 5000), whole)
    # uniform on [0, 1): mean 1/2, variance 1/12, no value out of range
    many = quant.rounding_uniforms(key, 0, 1 << 18)
    assert 0.0 <= float(many.min()) and float(many.max()) < 1.0
    assert abs(float(many.mean()) - 0.5) < 0.003 and abs(float(many.var()) - 1 / 12) < 0.001


def test_stochastic_codes_are_unbiased_neighbours():
    tables = build_tables(False)
    qmap = tables.qmap.double()
    gen = torch.Generator().manual_seed(0)
    x = torch.cat([torch.rand(200, generator=gen), torch.exp(-torch.rand(200, generator=gen) * 18),
                   tables.qmap, torch.tensor([0.0, 1e-30, 1.0])]).clamp(0.0, 1.0)
    nearest = nearest_code(x, tables)
    draws = 2000
    total = torch.zeros(x.numel(), dtype=torch.float64)
    below = torch.bucketize(x.double(), qmap, right=True) - 1  # the code at or below x
    for d in range(draws):
        u = quant.rounding_uniforms(quant.rounding_key(0, 0, d), 0, x.numel())
        codes = quant.stochastic_codes(x, nearest, tables, u).long()
        assert bool(((codes == below) | (codes == below + 1) | ((x > 0) & (codes == 1))).all())
        total += qmap[codes]
    exact = torch.isin(x, tables.qmap)
    mean = total / draws
    # a value on a code keeps it; 0 stays 0; a positive value never becomes 0
    assert torch.equal(mean[exact], x[exact].double())
    assert float(mean[-3]) == 0.0 and float(mean[-2]) == float(qmap[1])
    # elsewhere the mean code value is x, to within 5 standard errors of the draws
    lo, hi = qmap[below.clamp(max=254)], qmap[(below + 1).clamp(max=255)]
    p = ((x.double() - lo) / (hi - lo)).clamp(0, 1)
    stderr = (hi - lo) * (p * (1 - p) / draws).sqrt()
    check = ~exact & (x.double() > qmap[1])
    assert bool(((mean - x.double()).abs()[check] <= 5 * stderr[check] + 1e-12).all())


def test_stochastic_rounding_follows_a_slow_decay_that_nearest_rounds_away():
    """sqrt(v) of a parameter whose gradient stopped shrinks by sqrt(beta2) per step (0.05% at
    beta2 = 0.999), less than half a code gap: nearest codes hold it where it was, stochastic
    ones follow it on average. One element at 1.0 keeps the block's absmax fixed."""
    tables = build_tables(False)
    n, steps, factor = 4096, 1000, 0.999**0.5
    x = torch.full((n,), 0.3)
    values = {"nearest": x.clone(), "stochastic": x.clone()}
    for step in range(steps):
        for rounding, value in values.items():
            block = torch.cat([torch.ones(1), value * factor])
            u = quant.rounding_uniforms(quant.rounding_key(0, 0, step), 0, n + 1) if rounding == "stochastic" else None
            codes, absmax = quantize_blockwise(block, tables, block=n + 1, uniforms=u)
            values[rounding] = dequantize_blockwise(codes, absmax, tables, block=n + 1)[1:]
    target = 0.3 * factor**steps  # 0.182
    assert abs(float(values["nearest"].mean()) - 0.3) < 0.01
    assert abs(float(values["stochastic"].mean()) / target - 1) < 0.02

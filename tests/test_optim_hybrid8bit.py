"""Hybrid 8-bit AdamW: one fused step against the float64 reference, both paths and every
instruction-set variant of the kernel this CPU runs, resume, thread safety and a convergence
check against torch's fused fp32 AdamW.

The kernel is built, not skipped: a machine whose compiler cannot build it fails the ``cpp``
tests with the compiler's output."""

from __future__ import annotations

import functools
import io
import math
import threading
import time
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lazytrain.optim import kernel as kernel_module
from lazytrain.optim.adamw import FusedAdamW
from lazytrain.optim.base import AdamWConfig
from lazytrain.optim.hybrid8bit import (
    DEVICE_CHUNK,
    MIN_8BIT_NUMEL,
    TORCH_CHUNK,
    Fp32State,
    Hybrid8bitAdamW,
    QuantizedState,
    is_8bit,
    state_bytes_per_param,
)
from lazytrain.optim.quant import (
    BLOCK,
    dequantize_blockwise,
    num_blocks,
    quantize_blockwise,
    signed_tables,
    unsigned_tables,
)
from lazytrain.optim.reference import reference_step

BACKENDS = ["cpp", "torch"]
VARIANTS = [
    pytest.param(f"cpp-{name}", marks=pytest.mark.skipif(
        bool(kernel_module.missing_cpu_flags(name)),
        reason=f"this CPU cannot run the {name} path (no {' '.join(kernel_module.missing_cpu_flags(name))})"))
    for name in kernel_module.VARIANTS
]
"""The kernel built for each instruction set (``cpp`` is the native build, one of them)."""
CONFIG = AdamWConfig(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _random_moments(numel: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """m and v as some steps of training leave them: scales spread over decades, v >= m**2."""
    scale = torch.exp(torch.randn(num_blocks(numel), generator=gen) * 2).repeat_interleave(BLOCK)
    m = torch.randn(numel, generator=gen) * 1e-2 * scale[:numel]
    v = m * m * (1 + 9 * torch.rand(numel, generator=gen)) + 1e-12
    return m, v


def _random_quantized_state(numel: int, gen: torch.Generator) -> QuantizedState:
    return QuantizedState.of_moments(*_random_moments(numel, gen))


def _moments(state: QuantizedState | Fp32State) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(state, Fp32State):
        return state.exp_avg.clone(), state.exp_avg_sq.clone()
    return state.moments()


def _check_codes(codes, reference_codes, normalized, qmap, scale):
    """Codes equal the float64 nearest codes, or differ by one where the value lies within
    float32 rounding of the midpoint between the two codes."""
    codes, reference_codes = codes.long(), reference_codes.long()
    differ = codes != reference_codes
    if not bool(differ.any()):
        return
    assert int((codes - reference_codes)[differ].abs().max()) == 1
    q = qmap.double()
    midpoint = (q[codes[differ]] + q[reference_codes[differ]]) / 2
    # float32 m carries a few ulps of its largest term; 1e-6 of that scale is ~8 ulps
    tolerance = 1e-6 * (midpoint.abs() + scale[differ])
    assert bool(((normalized[differ] - midpoint).abs() <= tolerance).all()), (
        f"{int(differ.sum())} codes differ from the nearest ones beyond float32 rounding"
    )


LR = 3e-3


@functools.lru_cache(maxsize=16)
def _start(numel, decay_numel, grad_dtype, clip, step, seed):
    """A group's master, gradient and random state, and the float64 reference of its step (the
    same for every backend: computed once). Callers must not change the tensors."""
    gen = torch.Generator().manual_seed(seed)
    master = torch.randn(numel, generator=gen)
    grad = (torch.randn(numel, generator=gen) * 1e-2).to(grad_dtype)
    if is_8bit(numel):
        state = _random_quantized_state(numel, gen)
    else:
        state = Fp32State(*_random_moments(numel, gen))
    m, v = _moments(state)
    ref = reference_step(
        master, grad, m, v, step=step, clip_coef=clip, lr=LR, config=CONFIG, decay_numel=decay_numel
    )
    return master, grad, state, ref


def _one_step(backend, numel, decay_numel, grad_dtype, out_dtype, clip, step, seed, rounding="nearest",
              device=None):
    """One step from a random state; ``device``: the group stepped there (`to_device`; the
    weights written there are ``out``), then brought back."""
    start, grad, start_state, ref = _start(numel, decay_numel, grad_dtype, clip, step, seed)
    master = start.clone()
    opt = Hybrid8bitAdamW([master], [decay_numel], CONFIG, kernel=backend, rounding=rounding)
    assert opt.backend == ("torch" if backend == "torch" else "cpp")
    state = opt.states[0]
    assert isinstance(state, QuantizedState) == is_8bit(numel)
    for name, t in start_state.tensors().items():
        state.tensors()[name].copy_(t)
    opt.steps[0] = step - 1
    m, _ = _moments(state)
    if device is not None:
        weight = torch.full((numel,), float("nan"), dtype=out_dtype or torch.float32, device=device)
        opt.to_device(0, weight)
        opt.step_group(0, grad.to(device), clip, LR, None)
        opt.to_host()
        out = None if out_dtype is None else weight.cpu()
    else:
        out = None if out_dtype is None else torch.full((numel,), float("nan"), dtype=out_dtype)
        opt.step_group(0, grad, clip, LR, out)
    assert opt.steps[0] == step
    beta1 = CONFIG.betas[0]
    m_terms = beta1 * m.double().abs() + (1 - beta1) * grad.double().abs() * clip
    return opt, m_terms, ref, out


def _check_step(opt, ref, out, m_terms):
    master, state = opt.masters[0], opt.states[0]
    # 1e-6 absolute, as the issue asks, for masters of unit scale; a few float32 ulps for the
    # larger ones the random draws include (|w| ~ 8 has an ulp of 9.5e-7)
    torch.testing.assert_close(master.double(), ref.master, rtol=4e-7, atol=1e-6)
    if out is not None:
        # the weight written is the new master, rounded to nearest even as torch casts it
        assert torch.equal(out, master.to(out.dtype))
    if isinstance(state, Fp32State):
        # float32 rounding of the terms of m (which can cancel) and of v
        assert bool(((state.exp_avg.double() - ref.m).abs() <= 1e-6 * m_terms).all())
        torch.testing.assert_close(state.exp_avg_sq.double(), ref.v, rtol=1e-6, atol=0)
        return
    torch.testing.assert_close(state.m_absmax.double(), ref.m_absmax, rtol=2e-6, atol=0)
    torch.testing.assert_close(state.v_absmax.double(), ref.v_absmax, rtol=2e-6, atol=0)
    numel = master.numel()
    m_absmax = ref.m_absmax.repeat_interleave(BLOCK)[:numel]
    v_absmax = ref.v_absmax.repeat_interleave(BLOCK)[:numel]
    # m = beta1 * m_old + (1 - beta1) * g can cancel: its rounding follows the larger term
    _check_codes(
        state.m_codes, ref.m_codes, ref.m_normalized, signed_tables().qmap, m_terms / m_absmax
    )
    _check_codes(
        state.v_codes, ref.v_codes, ref.v_normalized, unsigned_tables().qmap, ref.root / v_absmax
    )


SHAPES = [
    # numel, decay_numel
    (MIN_8BIT_NUMEL, MIN_8BIT_NUMEL),  # smallest 8-bit group, all decayed
    (20 * BLOCK + 77, 7 * BLOCK + 13),  # a tail block, decay ending mid-block and mid-vector
    # the torch path's pieces (TORCH_CHUNK): four, the last a part; decay ending mid-block in
    # the second, so the third and fourth have none. The kernel: many threads' blocks
    (3 * TORCH_CHUNK + 20 * BLOCK + 77, TORCH_CHUNK + 7 * BLOCK + 13),
    (MIN_8BIT_NUMEL - 1, 1000),  # the largest group with fp32 states
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("numel,decay_numel", SHAPES)
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize(
    "out_dtype", [torch.bfloat16, torch.float32, None], ids=["out-bf16", "out-fp32", "no-out"]
)
def test_step_matches_float64_reference(backend, numel, decay_numel, grad_dtype, out_dtype):
    opt, m_terms, ref, out = _one_step(
        backend, numel, decay_numel, grad_dtype, out_dtype, 0.37, 7, numel
    )
    assert isinstance(opt.states[0], QuantizedState) == (numel >= MIN_8BIT_NUMEL)
    _check_step(opt, ref, out, m_terms)


BF16, FP32 = torch.bfloat16, torch.float32
VARIANT_CASES = [
    # numel, decay_numel, gradient dtype, weights written (each vector load and store)
    *[(20 * BLOCK + 77, 7 * BLOCK + 13, g, o) for g in (BF16, FP32) for o in (BF16, FP32, None)],
    (3 * TORCH_CHUNK + 20 * BLOCK + 77, TORCH_CHUNK + 7 * BLOCK + 13, BF16, BF16),
    (MIN_8BIT_NUMEL - 1, 1000, FP32, FP32),
]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("numel,decay_numel,grad_dtype,out_dtype", VARIANT_CASES,
                         ids=lambda x: str(x).removeprefix("torch."))
def test_each_variant_steps_as_the_float64_reference(variant, numel, decay_numel, grad_dtype, out_dtype):
    """The kernel's path for each instruction set (the native build runs only one): a tail
    block, decay ending mid-block and mid-vector, many threads' blocks, fp32 states."""
    opt, m_terms, ref, out = _one_step(variant, numel, decay_numel, grad_dtype, out_dtype, 0.37, 7, numel)
    assert opt._kernel.simd() == variant.removeprefix("cpp-")
    _check_step(opt, ref, out, m_terms)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=15, deadline=None)
@given(
    # as many 8-bit groups as fp32 ones (a plain integer draw favours small sizes)
    numel=st.integers(1, MIN_8BIT_NUMEL - 1) | st.integers(MIN_8BIT_NUMEL, 12_000),
    decay_fraction=st.floats(0, 1),
    grad_dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    out_dtype=st.sampled_from([torch.bfloat16, torch.float32, None]),
    clip=st.sampled_from([1.0, 0.5, 1e-3]),
    step=st.integers(1, 10_000),
    seed=st.integers(0, 2**31 - 1),
)
def test_random_steps_match_float64_reference(
    backend, numel, decay_fraction, grad_dtype, out_dtype, clip, step, seed
):
    decay_numel = int(numel * decay_fraction)
    opt, m_terms, ref, out = _one_step(
        backend, numel, decay_numel, grad_dtype, out_dtype, clip, step, seed
    )
    _check_step(opt, ref, out, m_terms)


@pytest.mark.parametrize("other", [
    "cpp", *VARIANTS,
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_kernel_and_gpu_step_agree_with_the_torch_path(other, rounding):
    """The C++ kernel (each variant), or a group stepped on the GPU (whose stochastic codes are
    drawn from the same hash of each element), against the host's torch path."""
    results = []
    for backend, device in ((other, None) if other != "cuda" else ("torch", other), ("torch", None)):
        opt, _, _, out = _one_step(
            backend, 50_003, 30_001, torch.bfloat16, torch.bfloat16, 0.6, 3, 11, rounding, device=device
        )
        results.append((opt.masters[0], opt.states[0], out))
    (master_a, state_a, out_a), (master_b, state_b, out_b) = results
    torch.testing.assert_close(master_a, master_b, rtol=0, atol=1e-6)
    assert torch.equal(out_a, master_a.bfloat16()) and torch.equal(out_b, master_b.bfloat16())
    for name in ("m_codes", "v_codes"):
        a, b = state_a.tensors()[name].long(), state_b.tensors()[name].long()
        # fused multiply-adds move a few values across a code boundary, by one code
        assert int((a - b).abs().max()) <= 1
        assert float((a != b).float().mean()) < 1e-3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("numel,decay_numel", [*SHAPES, (DEVICE_CHUNK + 20 * BLOCK + 77, DEVICE_CHUNK + 13)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["out-bf16", "out-fp32"])
def test_the_gpu_step_matches_float64_reference(numel, decay_numel, out_dtype, monkeypatch):
    """A group stepped on the GPU (`to_device`: the compiled pieces, the fp32-state path for a
    small group), a tail piece and decay ending inside the second piece included (compiled
    pieces of DEVICE_CHUNK here, to keep the float64 reference small; the split-master test in
    `test_device_update` runs the default size)."""
    from lazytrain.optim import hybrid8bit

    monkeypatch.setattr(hybrid8bit, "COMPILED_CHUNK", DEVICE_CHUNK)
    opt, m_terms, ref, out = _one_step("torch", numel, decay_numel, torch.bfloat16, out_dtype, 0.37, 7, numel,
                                       device="cuda")
    _check_step(opt, ref, out, m_terms)


@pytest.mark.parametrize("backend", ["cpp", *VARIANTS])
def test_unaligned_weight_out(backend):
    """weight_out need not be aligned (streaming stores are used only when it is)."""
    numel = 10 * BLOCK + 5
    for offset in (0, 1, 3):
        gen = torch.Generator().manual_seed(offset)
        master = torch.randn(numel, generator=gen)
        buffer = torch.zeros(numel + 8, dtype=torch.bfloat16)
        out = buffer[offset : offset + numel]
        opt = Hybrid8bitAdamW([master], [numel // 3], CONFIG, kernel=backend)
        opt.step_group(0, torch.randn(numel, generator=gen).bfloat16(), 0.5, 1e-3, out)
        assert torch.equal(out, master.bfloat16())
        assert bool((buffer[:offset] == 0).all()) and bool((buffer[offset + numel :] == 0).all())


@pytest.mark.parametrize("backend", BACKENDS)
def test_small_groups_match_torch_fused_adamw(backend):
    """Groups under MIN_8BIT_NUMEL keep fp32 states: the same steps as FusedAdamW."""
    gen = torch.Generator().manual_seed(0)
    sizes, decay = [1000, 37], [600, 0]
    masters = [torch.randn(n, generator=gen) for n in sizes]
    ours = Hybrid8bitAdamW([m.clone() for m in masters], decay, CONFIG, kernel=backend)
    theirs = FusedAdamW([m.clone() for m in masters], decay, CONFIG)
    for step in range(5):
        for g, n in enumerate(sizes):
            grad = torch.randn(n, generator=gen)
            ours.step_group(g, grad, 0.8, 1e-3 * (step + 1), None)
            theirs.step_group(g, grad, 0.8, 1e-3 * (step + 1), None)
    for a, b in zip(ours.masters, theirs.masters):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert ours.steps == theirs.steps == [5, 5]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_resume_equals_uninterrupted_run(backend, rounding):
    gen = torch.Generator().manual_seed(1)
    sizes, decay = [9000, 100], [5000, 50]
    start = [torch.randn(n, generator=gen) for n in sizes]
    grads = [[torch.randn(n, generator=gen).bfloat16() for n in sizes] for _ in range(6)]

    def run(opt, steps):
        for step in steps:
            for g in range(len(sizes)):
                opt.step_group(g, grads[step][g], 0.9, 1e-3, None)

    whole = Hybrid8bitAdamW([m.clone() for m in start], decay, CONFIG, kernel=backend, rounding=rounding)
    run(whole, range(6))

    first = Hybrid8bitAdamW([m.clone() for m in start], decay, CONFIG, kernel=backend, rounding=rounding)
    run(first, range(3))
    buffer = io.BytesIO()
    torch.save({"optim": first.state_dict(), "masters": first.masters}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    resumed = Hybrid8bitAdamW(saved["masters"], decay, CONFIG, kernel=backend, rounding=rounding)
    resumed.load_state_dict(saved["optim"])
    run(resumed, range(3, 6))

    assert resumed.steps == whole.steps == [6, 6]
    for a, b in zip(resumed.masters, whole.masters):
        assert torch.equal(a, b)
    for a, b in zip(resumed.state_dict()["groups"], whole.state_dict()["groups"]):
        for name in a:
            assert torch.equal(a[name], b[name])


def test_load_state_dict_refuses_other_states():
    opt = Hybrid8bitAdamW([torch.zeros(5000), torch.zeros(10)], [5000, 0], CONFIG, kernel="torch")
    fp32 = FusedAdamW([torch.zeros(5000), torch.zeros(10)], [5000, 0], CONFIG)
    with pytest.raises(ValueError, match="kind 'fp32'"):
        opt.load_state_dict(fp32.state_dict())
    other = Hybrid8bitAdamW([torch.zeros(6000), torch.zeros(10)], [0, 0], CONFIG, kernel="torch")
    with pytest.raises(ValueError, match="m_codes is torch.uint8"):
        opt.load_state_dict(other.state_dict())
    swapped = Hybrid8bitAdamW([torch.zeros(10), torch.zeros(5000)], [0, 0], CONFIG, kernel="torch")
    with pytest.raises(ValueError, match="grouping"):
        opt.load_state_dict(swapped.state_dict())


def test_small_second_moments_survive_quantization():
    """v is stored as sqrt(v). In a block whose largest v is 1, every v down to 1e-12 keeps a
    non-zero code (stored as v, everything under 1.6e-7 became 0 and the next update m / eps),
    and down to 1e-8 sqrt(v), the update's divisor, comes back within 20%."""
    v = torch.logspace(0, -12, BLOCK)
    back = QuantizedState.of_moments(torch.zeros(BLOCK), v).moments()[1]
    assert bool((back > 0).all())
    ratio = (back / v).sqrt()
    wide = v >= 1e-8
    assert 0.8 <= float(ratio[wide].min()) and float(ratio[wide].max()) <= 1.2
    assert 0.5 <= float(ratio.min()) and float(ratio.max()) <= 1.5


@pytest.mark.parametrize("fmt", ["dynamic8-block256", "dynamic8-block256-sqrtv"])
def test_loads_earlier_formats(fmt):
    """Checkpoints of earlier formats (256-element blocks; the oldest held codes of v itself)
    load as this format's codes of the same moments."""
    gen = torch.Generator().manual_seed(3)
    m, v = _random_moments(5000, gen)
    opt = Hybrid8bitAdamW([torch.zeros(5000)], [0], CONFIG, kernel="torch")
    second = v if fmt == "dynamic8-block256" else v.sqrt()
    v_codes, v_absmax = quantize_blockwise(second, unsigned_tables(), 256)
    m_codes, m_absmax = quantize_blockwise(m, signed_tables(), 256)
    old = {"m_codes": m_codes, "m_absmax": m_absmax, "v_codes": v_codes, "v_absmax": v_absmax}
    opt.load_state_dict({"kind": "hybrid8bit", "format": fmt, "steps": [4], "groups": [old]})
    old_m = dequantize_blockwise(m_codes, m_absmax, signed_tables(), 256)
    old_second = dequantize_blockwise(v_codes, v_absmax, unsigned_tables(), 256)
    root = old_second.sqrt() if fmt == "dynamic8-block256" else old_second
    expected = QuantizedState.of_moments(old_m, root * root)
    assert opt.states[0].m_absmax.numel() == num_blocks(5000) == -(-5000 // BLOCK)
    for name, t in expected.tensors().items():
        assert torch.equal(opt.states[0].tensors()[name], t), name
    m_back, _ = opt.states[0].moments()
    assert torch.allclose(m_back, m, rtol=0.2, atol=1e-3 * float(m.abs().max()))
    assert opt.steps == [4]
    with pytest.raises(ValueError, match="format 'dynamic4'"):
        opt.load_state_dict({**opt.state_dict(), "format": "dynamic4"})
    with pytest.raises(ValueError, match="saved m_absmax"):  # a 256-block state called current
        opt.load_state_dict({"kind": "hybrid8bit", "format": opt.state_dict()["format"],
                             "steps": [4], "groups": [old]})


def test_state_bytes_per_parameter():
    numel = 1 << 20
    opt = Hybrid8bitAdamW(
        [torch.zeros(numel), torch.zeros(100)], [numel, 0], CONFIG, kernel="torch"
    )
    assert opt.state_bytes() == 2 * numel + 8 * num_blocks(numel) + 8 * 100
    assert (opt.state_bytes() - 800) / numel <= 2.1


def test_fp32_groups_keep_fp32_states():
    sizes = [20_000, 30_000, 9000]
    opt = Hybrid8bitAdamW(
        [torch.zeros(n) for n in sizes], [0, 0, 0], CONFIG, kernel="torch", fp32_groups=(0, 2)
    )
    assert [type(s) for s in opt.states] == [Fp32State, QuantizedState, Fp32State]
    assert opt.state_bytes() == 8 * 29_000 + 2 * 30_000 + 8 * num_blocks(30_000)
    assert state_bytes_per_param(sizes, (0, 2)) == opt.state_bytes() / sum(sizes)
    # Qwen2.5-7B: embedding and untied head in fp32 states cost 2.91 B/param, not 2.06
    h, vocab, layer = 3584, 152_064, 233_057_792
    numels = [vocab * h] + [layer] * 28 + [h + vocab * h]
    assert state_bytes_per_param(numels) == pytest.approx(2.0625, abs=1e-3)
    assert state_bytes_per_param(numels, (0, 29)) == pytest.approx(2.912, abs=1e-3)


def test_factory_keeps_embedding_states_fp32_when_asked():
    from lazytrain.config import load_config
    from lazytrain.optim.factory import make_optimizer

    sizes = [20_000, 30_000, 9000]
    for flag, kinds in (
        ("false", [QuantizedState] * 3),
        ("true", [Fp32State, QuantizedState, Fp32State]),
    ):
        config = load_config(
            None, ["optimizer.kind=hybrid8bit", f"optimizer.fp32_embedding_states={flag}"]
        )
        opt = make_optimizer(config.optimizer, [torch.zeros(n) for n in sizes], [0, 0, 0],
                             rounding=config.state_rounding())
        assert [type(s) for s in opt.states] == kinds


def test_rejects_mismatched_inputs():
    opt = Hybrid8bitAdamW([torch.zeros(5000)], [0], CONFIG, kernel="torch")
    with pytest.raises(ValueError, match="gradient has 4999 elements"):
        opt.step_group(0, torch.zeros(4999), 1.0, 1e-3, None)
    with pytest.raises(ValueError, match="bf16 or fp32"):
        opt.step_group(0, torch.zeros(5000, dtype=torch.float16), 1.0, 1e-3, None)
    with pytest.raises(ValueError, match="weight_out"):
        opt.step_group(0, torch.zeros(5000), 1.0, 1e-3, torch.zeros(5000, dtype=torch.float16))
    with pytest.raises(ValueError, match="LAZYTRAIN_OPTIM_KERNEL"):
        Hybrid8bitAdamW([torch.zeros(5000)], [0], CONFIG, kernel="cuda")


@pytest.mark.parametrize("backend", BACKENDS)
def test_groups_stepped_concurrently_equal_serial(backend):
    gen = torch.Generator().manual_seed(2)
    sizes = [40_000, 30_001, 5000, 300]
    start = [torch.randn(n, generator=gen) for n in sizes]
    grads = [torch.randn(n, generator=gen).bfloat16() for n in sizes]

    def make():
        return Hybrid8bitAdamW(
            [m.clone() for m in start], [n // 2 for n in sizes], CONFIG, kernel=backend
        )

    serial, concurrent = make(), make()
    outs_serial = [torch.empty(n, dtype=torch.bfloat16) for n in sizes]
    outs_concurrent = [torch.empty(n, dtype=torch.bfloat16) for n in sizes]
    for _ in range(3):
        for g in range(len(sizes)):
            serial.step_group(g, grads[g], 0.7, 1e-3, outs_serial[g])

    def worker(groups):
        for _ in range(3):
            for g in groups:
                concurrent.step_group(g, grads[g], 0.7, 1e-3, outs_concurrent[g])

    threads = [threading.Thread(target=worker, args=(gs,)) for gs in ([0, 2], [1, 3])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for g in range(len(sizes)):
        assert torch.equal(serial.masters[g], concurrent.masters[g])
        assert torch.equal(outs_serial[g], outs_concurrent[g])
    assert serial.steps == concurrent.steps


def test_kernel_releases_the_gil():
    numel = 1 << 22
    opt = Hybrid8bitAdamW([torch.randn(numel)], [numel], CONFIG, kernel="cpp")
    grad = torch.randn(numel).bfloat16()
    span: dict[str, float] = {}

    def step():
        span["start"] = time.perf_counter()
        opt.step_group(0, grad, 1.0, 1e-3, None)
        span["end"] = time.perf_counter()

    ticks = []
    worker = threading.Thread(target=step)
    worker.start()
    while worker.is_alive():
        ticks.append(time.perf_counter())
    worker.join()
    inside = [t for t in ticks if span["start"] < t < span["end"]]
    # the main thread kept running Python while the step ran
    assert len(inside) > 10, (
        f"main thread ran {len(inside)} times during a {span['end'] - span['start']:.3f} s step"
    )


def test_failed_build_falls_back_to_torch_with_a_warning(monkeypatch, tmp_path):
    from torch.utils import cpp_extension

    def no_compiler(*args, **kwargs):
        raise RuntimeError("c++: command not found\nthe rest of the build log")

    monkeypatch.delenv("LAZYTRAIN_OPTIM_KERNEL", raising=False)  # the default: auto
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # no other process's build lock
    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    monkeypatch.setattr(kernel_module, "_loaded", {})
    monkeypatch.setattr(kernel_module, "_failure", {})
    with pytest.warns(RuntimeWarning, match="c\\+\\+: command not found"):
        opt = Hybrid8bitAdamW([torch.zeros(5000)], [0], CONFIG)
    assert opt.backend == "torch"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning per process, not one per optimizer
        assert Hybrid8bitAdamW([torch.zeros(5000)], [0], CONFIG).backend == "torch"
    # asked for, the kernel is built again, and its failure raises with the whole log
    with pytest.raises(RuntimeError, match="(?s)did not build.*the rest of the build log"):
        Hybrid8bitAdamW([torch.zeros(5000)], [0], CONFIG, kernel="cpp")


def test_a_variant_that_does_not_compile_fails_with_the_compilers_message(monkeypatch, tmp_path):
    """A real compiler run on a source that does not compile: the error carries its message."""
    broken = tmp_path / "hybrid8bit.cpp"
    broken.write_text("#error lazytrain test: this kernel does not compile\n")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "builds"))
    monkeypatch.setattr(kernel_module, "SOURCE", broken)
    monkeypatch.setattr(kernel_module, "_loaded", {})
    monkeypatch.setattr(kernel_module, "_failure", {})
    with pytest.raises(RuntimeError, match="(?s)variant scalar.*did not build.*error: #error lazytrain test"):
        Hybrid8bitAdamW([torch.zeros(5000)], [0], CONFIG, kernel="cpp-scalar")


def test_kernel_choices_and_variants_are_checked(monkeypatch):
    with pytest.raises(ValueError, match="'cpp-sse' is not one of .*'cpp-avx2'"):
        Hybrid8bitAdamW([torch.zeros(10)], [0], CONFIG, kernel="cpp-sse")
    with pytest.raises(ValueError, match="variant 'sse' is not one of"):
        kernel_module.missing_cpu_flags("sse")
    # a CPU with AVX2 and no AVX-512: the native build is its AVX2 path, AVX-512 is refused
    monkeypatch.setattr(kernel_module, "_cpu_flags", lambda: "flags\t: fpu sse2 avx fma avx2")
    assert kernel_module.native_variant() == "avx2"
    assert kernel_module.missing_cpu_flags("avx512vbmi") == ("avx512f", "avx512bw", "avx512vbmi")
    with pytest.raises(ValueError, match="'avx512' cannot run on this CPU .* lacks avx512f; .*'avx2', 'scalar'"):
        Hybrid8bitAdamW([torch.zeros(10)], [0], CONFIG, kernel="cpp-avx512")


def _mlp_losses(make_optimizer, steps: int = 200, seed: int = 0) -> list[float]:
    """Full-batch regression with a 2-layer MLP whose parameters are one flat group
    (matrices first, with weight decay; biases last), stepped the executor's way."""
    gen = torch.Generator().manual_seed(seed)
    inputs = torch.randn(512, 32, generator=gen)
    teacher = torch.randn(32, 8, generator=gen) / math.sqrt(32)
    targets = torch.tanh(inputs @ teacher * 2) + 0.05 * torch.randn(512, 8, generator=gen)
    shapes = [(32, 128), (128, 8), (128,), (8,)]
    sizes = [math.prod(s) for s in shapes]
    master = torch.cat([
        torch.randn(sizes[0], generator=gen) / math.sqrt(32),
        torch.randn(sizes[1], generator=gen) / math.sqrt(128),
        torch.zeros(sizes[2] + sizes[3]),
    ])  # fmt: skip
    opt = make_optimizer([master], [sizes[0] + sizes[1]])
    weights = master.clone()
    losses = []
    for _ in range(steps):
        flat = weights.clone().requires_grad_(True)
        w1, w2, b1, b2 = (p.view(s) for p, s in zip(flat.split(sizes), shapes))
        loss = ((torch.relu(inputs @ w1 + b1) @ w2 + b2 - targets) ** 2).mean()
        (grad,) = torch.autograd.grad(loss, flat)
        clip = min(1.0, 1.0 / (float(grad.norm()) + 1e-6))
        opt.step_group(0, grad.bfloat16(), clip, 3e-3, weights)
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.parametrize("backend", BACKENDS)
def test_converges_like_fp32_adamw(backend):
    """Final loss over three problems (one 8-bit run lands a few percent either side of fp32)."""
    config = AdamWConfig(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01)
    ours, theirs = 0.0, 0.0
    for seed in range(3):
        losses = _mlp_losses(lambda m, d: Hybrid8bitAdamW(m, d, config, kernel=backend), seed=seed)
        assert losses[-1] < 0.2 * losses[0]
        ours += sum(losses[-10:]) / 10
        theirs += sum(_mlp_losses(lambda m, d: FusedAdamW(m, d, config), seed=seed)[-10:]) / 10
    # no more than 2% worse; and the same kind of run (not a lot lower either)
    assert 0.95 * theirs <= ours <= 1.02 * theirs, (ours / 3, theirs / 3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_weights_stay_near_fp32_on_one_gradient_stream(backend):
    """Fed the same gradients (3 decades of scale, a persistent mean, elements active at
    different rates, some almost never), 8-bit and fp32 states move the weights to nearly the
    same place. Measured: 0.064 of the distance moved (0.088 with sqrt(v) rounded
    stochastically; ~1.0 when sqrt(v) may round to 0 and the next step divides m by eps)."""
    gen = torch.Generator().manual_seed(0)
    n, steps = 1 << 14, 200
    config = AdamWConfig(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
    scale = 10 ** (-3 * torch.rand(n, generator=gen))
    mean = 0.3 * torch.randn(n, generator=gen)
    rate = torch.rand(n, generator=gen) ** 3
    ours = Hybrid8bitAdamW([torch.zeros(n)], [n], config, kernel=backend)
    theirs = FusedAdamW([torch.zeros(n)], [n], config)
    for _ in range(steps):
        active = torch.rand(n, generator=gen) < rate
        grad = (scale * (mean + torch.randn(n, generator=gen)) * active).to(torch.bfloat16)
        for opt in (ours, theirs):
            opt.step_group(0, grad, 1.0, config.lr, None)
    moved = theirs.masters[0].norm()
    drift = float((ours.masters[0] - theirs.masters[0]).norm() / moved)
    assert drift < 0.075, drift


@pytest.mark.parametrize("backend", [*BACKENDS, *VARIANTS])
def test_stochastic_step_rounds_sqrt_v_to_a_neighbouring_code(backend):
    """One step with stochastic rounding: master, weights, m codes and absmaxes as the float64
    reference has them (nearest m codes); each sqrt(v) code is one of the two codes around the
    reference's value, and some draws differ from nearest rounding."""
    numel = 40 * BLOCK + 77
    opt, m_terms, ref, _ = _one_step(
        backend, numel, 7 * BLOCK + 13, torch.bfloat16, torch.bfloat16, 0.37, 7, 5, "stochastic"
    )
    assert isinstance(opt.states[0], QuantizedState)
    state = opt.states[0]
    torch.testing.assert_close(opt.masters[0].double(), ref.master, rtol=4e-7, atol=1e-6)
    torch.testing.assert_close(state.v_absmax.double(), ref.v_absmax, rtol=2e-6, atol=0)
    m_absmax = ref.m_absmax.repeat_interleave(BLOCK)[:numel]
    _check_codes(state.m_codes, ref.m_codes, ref.m_normalized, signed_tables().qmap, m_terms / m_absmax)
    qmap = unsigned_tables().qmap.double()
    # float32 rounding may put the value a hair across a code: allow a code's float32 neighbourhood
    x = ref.v_normalized
    codes = state.v_codes.long()
    below = torch.bucketize(x * (1 - 1e-6), qmap, right=True) - 1
    above = torch.bucketize(x * (1 + 1e-6), qmap, right=False)
    assert bool(((codes >= below) & (codes <= above.clamp(max=255))).all())
    # the new values lie near their old codes (small gradients against v): ~10% move off nearest
    assert 0.03 < float((codes != ref.v_codes.long()).float().mean()) < 0.5


def test_rejects_unknown_rounding_and_offsets():
    with pytest.raises(ValueError, match="rounding must be one of"):
        Hybrid8bitAdamW([torch.zeros(10)], [0], CONFIG, rounding="up")
    with pytest.raises(ValueError, match="one offset >= 0 per group"):
        Hybrid8bitAdamW([torch.zeros(10)], [0], CONFIG, group_offsets=[0, 128])
    with pytest.raises(ValueError, match="multiples of the 128-element block"):
        Hybrid8bitAdamW([torch.zeros(10)], [0], CONFIG, group_offsets=[100])


@pytest.mark.parametrize("kernel", ["cpp", *VARIANTS])
def test_kernel_draws_as_the_torch_path_past_two_to_the_32(kernel):
    """A shard starting just below element 2**32 of its group: the draws' index crosses into
    the high half (it keys the block) the same way in the kernel and in the torch path."""
    n, start = 4096 + 512, 2**32 - 256
    results = []
    for backend in (kernel, "torch"):
        gen = torch.Generator().manual_seed(8)
        opt = Hybrid8bitAdamW([torch.randn(n, generator=gen)], [n], CONFIG, kernel=backend, rounding="stochastic",
                              seed=1, group_numels=[2**33], group_offsets=[start])
        for _ in range(3):
            opt.step_group(0, torch.randn(n, generator=gen).bfloat16(), 0.9, 1e-3, None)
        results.append(opt.states[0].v_codes)
    assert torch.equal(*results)

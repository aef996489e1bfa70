"""The split master: exact for every fp32 bit pattern (the torch path and the kernel's split and
join for each instruction set), and optimizer steps over it equal the unsplit steps bit for
bit; a training run with it resumes exactly."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lazytrain.cli.main import main
from lazytrain.optim import kernel as kernel_module
from lazytrain.optim.adamw import FusedAdamW
from lazytrain.optim.base import AdamWConfig
from lazytrain.optim.hybrid8bit import Hybrid8bitAdamW
from lazytrain.optim.split import SplitMaster, joined, split_halves

SPECIAL = [
    0x00000000, 0x80000000,  # +-0
    0x00000001, 0x80000001, 0x00008000, 0x00018000, 0x0000FFFF, 0x007FFFFF,  # subnormals
    0x00800000, 0x3F800000, 0xBF800000,  # normals
    0x3F808000, 0x3F818000, 0xBF808000, 0xBF818000,  # exact ties below an even / odd bf16
    0x3F807FFF, 0x3F808001, 0x3F80FFFF, 0x3FFFFFFF, 0x3FFF8000,  # near ties, exponent carries
    0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x7F7F7FFF,  # largest finite
    0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0x7FFFFFFF, 0xFFFFFFFF, 0xFFFF8000,  # inf, NaN
]


def _floats(bits: list[int] | np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.asarray(bits, dtype=np.uint32).view(np.int32).copy()).view(torch.float32)


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int32).numpy().view(np.uint32)


VARIANTS = [
    pytest.param(name, marks=pytest.mark.skipif(
        bool(kernel_module.missing_cpu_flags(name)),
        reason=f"this CPU cannot run the {name} path (no {' '.join(kernel_module.missing_cpu_flags(name))})"))
    for name in kernel_module.VARIANTS
]
"""Each instruction set's build of the kernel."""


def _round_trip(master: torch.Tensor, backend: str, monkeypatch) -> tuple[torch.Tensor, SplitMaster]:
    monkeypatch.setenv("LAZYTRAIN_OPTIM_KERNEL", backend)
    split = SplitMaster.of(master)
    return split.fp32(), split


def _expected_weight_bits(bits: np.ndarray) -> np.ndarray:
    """bf16 bits of the weight: round to nearest on the bits, ties away from zero."""
    return ((bits.astype(np.uint64) + 0x8000) >> 16).astype(np.uint16)


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_special_patterns_round_trip_exactly(backend, monkeypatch):
    # 3 copies so the kernel's vector loop sees them too, not only its tail
    bits = np.array(SPECIAL * 3, dtype=np.uint32)
    joined, split = _round_trip(_floats(bits), backend, monkeypatch)
    assert (_bits(joined) == bits).all()
    assert (split.weight.view(torch.int16).numpy().view(np.uint16) == _expected_weight_bits(bits)).all()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=80),
       st.sampled_from([None, 0x8000, 0x7FFF, 0x8001, 0xFFFF, 0x0000]))
def test_every_bit_pattern_round_trips_exactly(patterns, low):
    """Random bit patterns (forced onto a tie, next to one, or onto a carry when ``low`` is
    given), through the torch path and the kernel."""
    bits = np.array(patterns, dtype=np.uint32)
    if low is not None:
        bits = (bits & 0xFFFF0000) | low
    master = _floats(bits)
    for backend in ("torch", "cpp"):
        with pytest.MonkeyPatch.context() as mp:
            back, split = _round_trip(master, backend, mp)
        assert (_bits(back) == bits).all(), backend
        weight = split.weight.view(torch.int16).numpy().view(np.uint16)
        assert (weight == _expected_weight_bits(bits)).all(), backend


def test_a_split_across_devices_goes_piece_by_piece_to_the_same_halves(monkeypatch):
    """`split_across` (`SplitMaster.assign` of values on another device: a built-in shape's
    random init drawn on the GPU) writes the halves `split_into` writes, over uneven pieces
    (here on one device, with pieces of 7 elements)."""
    from lazytrain.optim import split

    bits = np.concatenate([np.array(SPECIAL, dtype=np.uint32),
                           np.random.default_rng(3).integers(0, 2**32, 40, dtype=np.uint64).astype(np.uint32)])
    master = _floats(bits)
    want = SplitMaster(torch.empty(len(bits), dtype=torch.bfloat16), torch.empty(len(bits), dtype=torch.int16))
    split.split_into(master, want.weight, want.remainder)
    monkeypatch.setattr(split, "SPLIT_PIECE", 7)
    got = SplitMaster(torch.zeros(len(bits), dtype=torch.bfloat16), torch.zeros(len(bits), dtype=torch.int16))
    split.split_across(master, got.weight, got.remainder)
    assert torch.equal(got.weight.view(torch.int16), want.weight.view(torch.int16))
    assert torch.equal(got.remainder, want.remainder)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_masters_assigned_from_the_gpu_hold_the_bits_assigned_from_the_cpu():
    """A split or bf16 master assigned GPU values (split or rounded there, then copied) holds
    what it holds when assigned the same values from the CPU, into pinned memory as the host
    store's."""
    from lazytrain.optim.master import Bf16Master

    values = torch.randn(3 * (1 << 20) + 5, generator=torch.Generator().manual_seed(0)) * 0.02
    values[:len(SPECIAL)] = _floats(np.array(SPECIAL, dtype=np.uint32))
    for make in (lambda n: SplitMaster(torch.empty(n, dtype=torch.bfloat16).pin_memory(),
                                       torch.empty(n, dtype=torch.int16)),
                 lambda n: Bf16Master(torch.empty(n, dtype=torch.bfloat16).pin_memory())):
        from_cpu, from_gpu = make(values.numel()), make(values.numel())
        from_cpu.assign(values)
        from_gpu.assign(values.cuda())
        assert torch.equal(from_gpu.weight.view(torch.int16), from_cpu.weight.view(torch.int16))
        if isinstance(from_cpu, SplitMaster):
            assert torch.equal(from_gpu.remainder, from_cpu.remainder)


@pytest.mark.parametrize("variant", VARIANTS)
def test_each_variant_splits_and_joins_exactly(variant):
    """The kernel's split and join for each instruction set (the native build runs one): the
    special patterns, ties and their neighbours under random high halves, and random bits,
    in the vector loop and the tail, across the threads' ranges; the torch path's halves."""
    kernel = kernel_module.load_kernel(required=True, variant=variant)
    rng = np.random.default_rng(7)
    high = rng.integers(0, 2**16, size=4096, dtype=np.uint64).astype(np.uint32) << 16
    near_ties = np.concatenate([high | low for low in (0x8000, 0x7FFF, 0x8001, 0xFFFF, 0x0000)])
    noise = rng.integers(0, 2**32, size=3 * (1 << 16) + 77, dtype=np.uint64).astype(np.uint32)
    bits = np.concatenate([np.array(SPECIAL * 3, dtype=np.uint32), near_ties, noise])
    master = _floats(bits)
    weight, remainder = torch.empty(len(bits), dtype=torch.bfloat16), torch.empty(len(bits), dtype=torch.int16)
    kernel.split_master(master, weight, remainder)
    want_weight, want_remainder = split_halves(master)
    assert torch.equal(weight.view(torch.int16), want_weight)
    assert torch.equal(remainder, want_remainder)
    back = torch.full_like(master, float("nan"))
    kernel.join_master(weight, remainder, back)
    assert (_bits(back) == bits).all()
    assert torch.equal(joined(weight, remainder).view(torch.int32), master.view(torch.int32))


def test_weight_is_torchs_bf16_except_at_ties_below_an_even_bf16(monkeypatch):
    """Finite masters: the streamed weight equals torch's round-to-nearest-even cast except at
    an exact tie whose lower bf16 is even, where it is one bf16 ulp further from zero."""
    gen = np.random.default_rng(0)
    bits = gen.integers(0, 2**32, size=1 << 20, dtype=np.uint64).astype(np.uint32)
    bits[::1000] = (bits[::1000] & 0xFFFF0000) | 0x8000  # plenty of ties
    master = _floats(bits)
    finite = torch.isfinite(master).numpy() & (np.abs(master.numpy()) <= 3.3e38)
    split = SplitMaster.of(master)
    ours = split.weight.view(torch.int16).numpy().view(np.uint16).astype(np.int64)
    torchs = master.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16).astype(np.int64)
    tie_even = ((bits & 0xFFFF) == 0x8000) & (((bits >> 16) & 1) == 0)
    assert (ours[finite & ~tie_even] == torchs[finite & ~tie_even]).all()
    assert (ours[finite & tie_even] == torchs[finite & tie_even] + 1).all()
    assert tie_even.sum() > 100


def test_kernel_and_torch_paths_agree_on_a_million_patterns(monkeypatch):
    bits = np.random.default_rng(1).integers(0, 2**32, size=1 << 20, dtype=np.uint64).astype(np.uint32)
    master = _floats(bits)
    results = []
    for backend in ("torch", "cpp"):
        joined, split = _round_trip(master, backend, monkeypatch)
        results.append((joined, split))
        assert (_bits(joined) == bits).all()
    assert torch.equal(results[0][1].weight.view(torch.int16), results[1][1].weight.view(torch.int16))
    assert torch.equal(results[0][1].remainder, results[1][1].remainder)


CONFIG = AdamWConfig(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
SIZES = [20_000, 3_000, 8_193]  # 8-bit groups, one with fp32 states (under 4096), odd tails


def _optimizer(kind: str, masters: list) -> FusedAdamW | Hybrid8bitAdamW:
    decay = [n // 2 + 7 for n in SIZES]
    if kind == "fp32":
        return FusedAdamW(masters, decay, CONFIG)
    return Hybrid8bitAdamW(masters, decay, CONFIG, kernel=kind.removeprefix("8bit-"))


@pytest.mark.parametrize("kind", [
    "fp32", "8bit-cpp", "8bit-torch",
    *[pytest.param(f"8bit-cpp-{p.values[0]}", marks=p.marks) for p in VARIANTS],
])
def test_split_steps_equal_unsplit_steps_bit_for_bit(kind, monkeypatch):
    """20 steps from the same gradients: every master and optimizer state bit-identical, and
    the split weight is the split of the unsplit master (the kernel joins and splits inside
    its step with each instruction set's vectors)."""
    # the split and join outside the steps (SplitMaster.of, .fp32) by the same path
    monkeypatch.setenv("LAZYTRAIN_OPTIM_KERNEL", "cpp" if kind == "fp32" else kind.removeprefix("8bit-"))
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(n, generator=gen) * 0.05 for n in SIZES]
    whole = _optimizer(kind, [m.clone() for m in start])
    split = _optimizer(kind, [SplitMaster.of(m) for m in start])
    outs = [torch.empty(n, dtype=torch.bfloat16) for n in SIZES]
    for step in range(20):
        for g, n in enumerate(SIZES):
            grad = (torch.randn(n, generator=gen) * (0.01 + step * 1e-3)).to(torch.bfloat16)
            clip = 1.0 if step % 3 else 0.7
            whole.step_group(g, grad, clip, 1e-2, outs[g])
            split.step_group(g, grad, clip, 1e-2, split.masters[g].weight)
    for g in range(len(SIZES)):
        exact = whole.masters[g]
        assert torch.equal(split.masters[g].fp32().view(torch.int32), exact.view(torch.int32))
        assert torch.equal(split.masters[g].weight.view(torch.int16),
                           SplitMaster.of(exact).weight.view(torch.int16))
    for a, b in zip(_state_tensors(whole), _state_tensors(split)):
        assert torch.equal(a, b)


def _state_tensors(opt) -> list[torch.Tensor]:
    state = opt.state_dict()
    if state["kind"] == "fp32":
        return state["exp_avg"] + state["exp_avg_sq"]
    return [t for group in state["groups"] for t in group.values()]


def test_split_master_rejects_another_weight_out():
    opt = FusedAdamW([SplitMaster.of(torch.zeros(8))], [4], CONFIG)
    with pytest.raises(ValueError, match="weight half is the streamed weight"):
        opt.step_group(0, torch.zeros(8), 1.0, 1e-3, torch.empty(8, dtype=torch.bfloat16))


COMMON = ["training.batch_size=4", "training.progress=false", "data.builtin_train_size=64",
          "data.heldout_size=2", "optimizer.warmup_steps=2", "model.dtype=bf16",
          "optimizer.kind=hybrid8bit", "training.max_grad_norm=0.5", "optimizer.schedule=constant"]


def _losses(run) -> list[float]:
    records = (run / "metrics.jsonl").read_text().splitlines()
    return [json.loads(r)["loss"] for r in records if '"loss"' in r]


def _masters(run):
    from safetensors.torch import load_file

    from lazytrain.train.checkpoint import Checkpointer

    return load_file(str(Checkpointer(run).latest().path / "masters.safetensors"))


def test_split_training_resumes_exactly_and_tracks_the_unsplit_run(tmp_path):
    """bf16 compute on the CPU, 8-bit states: 12 steps with the split master equal 6 + 6
    resumed bit for bit, and stay within bf16 rounding of the unsplit run (whose streamed
    weights differ at exact ties, see optim/split.py)."""
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    main(["train", "training.steps=12", f"training.output_dir={a}", "memory.split_master=true", *COMMON])
    main(["train", "training.steps=6", f"training.output_dir={b}", "memory.split_master=true", *COMMON])
    main(["train", "training.steps=12", f"training.output_dir={b}", "memory.split_master=true",
          "training.resume=true", *COMMON])
    main(["train", "training.steps=12", f"training.output_dir={c}", "memory.split_master=false", *COMMON])
    assert _losses(a) == _losses(b)
    for name, t in _masters(a).items():
        assert torch.equal(t.view(torch.int32), _masters(b)[name].view(torch.int32)), name
    torch.testing.assert_close(torch.tensor(_losses(a)), torch.tensor(_losses(c)), rtol=2e-2, atol=0)


def test_unsplit_checkpoint_resumes_with_the_split_master(tmp_path):
    """Checkpoints hold the exact fp32 master either way: an unsplit run's checkpoint loads
    into a split run (old checkpoints load) and the split run starts from exactly it."""
    from lazytrain.config import load_config
    from lazytrain.train.trainer import Trainer

    run = tmp_path / "run"
    main(["train", "training.steps=3", f"training.output_dir={run}", "memory.split_master=false", *COMMON])
    saved = _masters(run)
    config = load_config(None, ["training.steps=4", f"training.output_dir={run}", "memory.split_master=true",
                                "training.resume=true", *COMMON])
    trainer = Trainer(config)
    trainer.setup()
    assert trainer.store.split_master and trainer.step == 3
    for g in range(len(trainer.store.masters)):
        assert torch.equal(trainer.store.master_fp32(g).view(torch.int32), saved[f"g{g}"].view(torch.int32))


def test_split_master_on_fp32_compute_is_refused(tmp_path):
    assert main(["train", "training.steps=1", f"training.output_dir={tmp_path}", "model.dtype=fp32",
                 "memory.split_master=true"]) == 2

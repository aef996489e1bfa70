"""The bf16 master (memory.master=bf16, optim/master.py): its stochastic rounding is unbiased
where round-to-nearest stalls, the kernel (each instruction set), the torch path and the GPU
step's math round alike, a step lands on a bf16 neighbour of the float64 reference, training
resumes bit for bit, checkpoints load across master forms, and the config refuses what cannot
work. With 4-bit states (optimizer.kind=hybrid4bit) too: the 4-bit kernel rounds with the
8-bit one's code (csrc/master.h), so the same fp32 update gives the same bf16 weight in both."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from lazytrain.cli.main import main
from lazytrain.config import ConfigError, load_config
from lazytrain.optim import hybrid8bit
from lazytrain.optim import kernel as kernel_module
from lazytrain.optim.adamw import FusedAdamW
from lazytrain.optim.base import AdamWConfig
from lazytrain.optim.hybrid4bit import Hybrid4bitAdamW
from lazytrain.optim.hybrid8bit import (
    Hybrid8bitAdamW,
    QuantizedState,
    StepScalars,
    device_step_8bit,
)
from lazytrain.optim.master import Bf16Master, stochastic_bf16
from lazytrain.optim.quant import rounding_bits, rounding_key, weight_rounding_key
from lazytrain.optim.reference import reference_step

VARIANTS = [
    pytest.param(name, marks=pytest.mark.skipif(
        bool(kernel_module.missing_cpu_flags(name)), reason=f"this CPU cannot run the {name} path"))
    for name in kernel_module.VARIANTS
]
CONFIG = AdamWConfig(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
NO_DECAY = AdamWConfig(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
SPECIAL = [0x00000000, 0x80000000, 0x00000001, 0x8000FFFF, 0x007FFFFF, 0x3F800000, 0x3F808000, 0xBF80FFFF,
           0x3FFFFFFF, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7FFFFFFF, 0xFFFFFFFF]
"""fp32 bit patterns: zeros, subnormals, bf16 values, carries into the exponent, the largest
finite values, infinities, NaNs."""


def _ulp(x: torch.Tensor) -> torch.Tensor:
    """The bf16 spacing at |x| (float64): 2**(exponent - 7), subnormals' spacing below."""
    exponent = torch.floor(torch.log2(x.abs().clamp(min=2.0**-126)))
    return torch.exp2(exponent - 7)


def _cpp_step(kernel: str):
    return lambda masters, config: Hybrid8bitAdamW(masters, [0] * len(masters), config, kernel=kernel)


def _eager_device_step(masters, config):
    """The GPU step's math (`_device_piece`, eagerly) on the CPU: `device_step_8bit` as it runs
    where compiling fails, on CPU tensors."""
    opt = Hybrid8bitAdamW(masters, [0] * len(masters), config, kernel="torch")

    def step_group(group, grad, clip, lr, out):
        step = opt.steps[group] + 1
        s = StepScalars.of(config, step, lr, clip, 0)
        master_rounding = (weight_rounding_key(opt.seed, group, step), 0)
        if isinstance(opt.states[group], QuantizedState):
            device_step_8bit(grad, opt.masters[group], opt.states[group], out, s, master_rounding=master_rounding)
        else:  # as a device group's fp32 states are stepped: the torch path there
            hybrid8bit.torch_step_fp32(grad, opt.masters[group], opt.states[group], out, s, master_rounding)
        opt.steps[group] = step

    opt.step_group = step_group
    return opt


def _cpp4_step(kernel: str):
    return lambda masters, config: Hybrid4bitAdamW(masters, [0] * len(masters), config, kernel=kernel)


STEPPERS = {"cpp": _cpp_step("cpp"), "torch": _cpp_step("torch"), "device-eager": _eager_device_step,
            "fp32-adamw": lambda masters, config: FusedAdamW(masters, [0] * len(masters), config),
            "4bit-cpp": _cpp4_step("cpp")}


def _drift(stepper, monkeypatch, round_to_nearest: bool = False) -> tuple[float, float, float]:
    """200 steps of updates ~lr = 1e-4 (1/78 of a bf16 ulp of weights in [1, 2), 2**-7): the
    mean over 16384 weights of (bf16 run - fp32 run) in ulps in the direction each weight
    moves, its standard error, and the fp32
    run's mean move in ulps. Both runs step the same way (the states evolve alike: the
    gradients do not depend on the weights), one with an fp32 master. ``round_to_nearest``:
    the bf16 weights are the fp32 master's rounded to nearest after every step instead (what
    a bf16 master without stochastic rounding does)."""
    monkeypatch.setattr(hybrid8bit.PIECE_8BIT, "fn", hybrid8bit._device_piece)  # no compile on the CPU
    n, steps = 16384, 200
    gen = torch.Generator().manual_seed(5)
    start = (1.0 + torch.rand(n, generator=gen)).bfloat16()
    grad = torch.randn(n, generator=gen).sign() * (0.5 + torch.rand(n, generator=gen))  # a steady sign: updates ~lr
    exact = start.float()
    reference = stepper([exact], NO_DECAY)
    if round_to_nearest:
        master = start.float()
        opt = stepper([master], NO_DECAY)
    else:
        bf16 = Bf16Master(start.clone())
        opt = stepper([bf16], NO_DECAY)
    for _ in range(steps):
        reference.step_group(0, grad, 1.0, 1e-4, None)
        opt.step_group(0, grad, 1.0, 1e-4, None)
        if round_to_nearest:
            master.copy_(master.bfloat16())
    weights = master if round_to_nearest else bf16.weight.float()
    # along each weight's direction of travel (-sign of its gradient): round-to-nearest lags
    error = (weights.double() - exact.double()) / _ulp(exact.double()) * -grad.sign().double()
    moved = ((exact.double() - start.double()) / _ulp(exact.double())).abs().mean()
    return float(error.mean()), float(error.std() / n**0.5), float(moved)


@pytest.mark.parametrize("stepper", list(STEPPERS))
def test_stochastic_rounding_follows_updates_below_half_an_ulp(stepper, monkeypatch):
    """The mean bf16 weight tracks the fp32 trajectory within 4 standard errors where each
    step's update is 1/78 of an ulp; round-to-nearest never moves (~200 standard errors off),
    so this test fails for it (checked below)."""
    mean, se, moved = _drift(STEPPERS[stepper], monkeypatch)
    assert moved > 2.0  # the fp32 run moved by more than 2 ulps
    assert abs(mean) < 4 * se, f"bf16 master {mean:.4f} ulps off the fp32 run on average (standard error {se:.4f})"
    nearest_mean, nearest_se, _ = _drift(STEPPERS[stepper], monkeypatch, round_to_nearest=True)
    assert abs(nearest_mean) > 50 * max(nearest_se, se), "round-to-nearest passes: the test could not fail"


@pytest.mark.parametrize("variant", VARIANTS)
def test_kernel_rounds_as_the_torch_path_bit_for_bit(variant):
    """`stochastic_bf16` of the kernel built for each instruction set equals the torch path's
    bits on random values over 80 binades and the special patterns, at offsets past 2**32."""
    kernel = kernel_module.load_kernel(required=True, variant=variant)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(50_000, generator=gen) * torch.exp2(torch.randint(-40, 40, (50_000,), generator=gen).float())
    special = torch.from_numpy(np.array(SPECIAL, dtype=np.uint32).view(np.int32)).view(torch.float32)
    x = torch.cat([special, x, special])
    for offset in (0, 128 * 9, 2**32 - 25_000 // 128 * 128):
        ours, theirs = kernel.stochastic_bf16(x, 0xDEADBEEF, offset), stochastic_bf16(x, 0xDEADBEEF, offset)
        assert torch.equal(ours.view(torch.int16), theirs.view(torch.int16)), (variant, offset)
    rounded = stochastic_bf16(special, 7).float()
    assert torch.equal(rounded[:3].view(torch.int32), special[:3].bfloat16().float().view(torch.int32))  # zeros, tiny
    assert rounded[11] == float("inf") and rounded[12] == float("-inf") and bool(rounded[13:].isnan().all())


def test_rounding_goes_to_a_neighbour_with_the_right_probability():
    """x = 1 + f ulp rounds up with probability f (the low bits over 2**16), never elsewhere;
    and the weight's draws are not the state's (another key)."""
    n = 200_000
    for f in (0.1, 0.5, 0.93):
        x = torch.full((n,), 1.0 + f * 2.0**-7)
        up = stochastic_bf16(x, 99).float()
        assert set(up.unique().tolist()) <= {1.0, 1.0 + 2.0**-7}
        assert float((up > 1).double().mean()) == pytest.approx(f, abs=4 * (f * (1 - f) / n) ** 0.5)
    index = torch.arange(n)
    state, weight = rounding_bits(rounding_key(0, 3, 7), index), rounding_bits(weight_rounding_key(0, 3, 7), index)
    correlation = np.corrcoef(state.double().numpy(), weight.double().numpy())[0, 1]
    assert abs(correlation) < 4 / n**0.5


@pytest.mark.parametrize("backend", ["cpp", "torch", *[pytest.param(f"cpp-{v.values[0]}", marks=v.marks)
                                                         for v in VARIANTS]])
def test_a_step_lands_on_a_bf16_neighbour_of_the_float64_reference(backend):
    """One step from a random 8-bit state (with decay on a prefix, a clip coefficient): each new
    weight is one of the two bf16 values around the float64 reference (a float32 ulp of slack),
    and their mean error is 0 within 4 standard errors (the rounding is unbiased)."""
    n, decay_numel = 30_011, 17_000
    gen = torch.Generator().manual_seed(2)
    start = torch.randn(n, generator=gen).bfloat16()
    grad = (torch.randn(n, generator=gen) * 1e-2).bfloat16()
    opt = Hybrid8bitAdamW([Bf16Master(start.clone())], [decay_numel], CONFIG, kernel=backend, seed=4)
    m, v = opt.states[0].moments()
    ref = reference_step(start.float(), grad, m, v, step=1, clip_coef=0.7, lr=3e-3, config=CONFIG,
                         decay_numel=decay_numel).master
    opt.step_group(0, grad, 0.7, 3e-3, None)
    new = opt.masters[0].weight.double()
    ulp = _ulp(ref)
    assert bool(((new - ref).abs() <= ulp * (1 + 2**-15)).all())
    error = (new - ref) / ulp
    assert abs(float(error.mean())) < 4 * float(error.std()) / n**0.5
    assert float((new != start.double()).double().mean()) > 0.5  # steps of ~lr move most weights


@pytest.mark.parametrize("other", ["cpp", "device-eager", *[pytest.param(f"cpp-{v.values[0]}", marks=v.marks)
                                                               for v in VARIANTS]])
def test_kernel_and_device_step_agree_with_the_torch_path(other, monkeypatch):
    """5 steps of a group with 8-bit and of one with fp32 states, from every path: the same bf16
    weights except where the fp32 update values differ by an ulp (hardware sqrt and reciprocal
    estimates, fused multiply-adds) across a rounding threshold: a draw lands between the two
    with probability ~2**-16 per float32 ulp, so at most one bf16 ulp, on under 1e-3 of them."""
    monkeypatch.setattr(hybrid8bit.PIECE_8BIT, "fn", hybrid8bit._device_piece)
    gen = torch.Generator().manual_seed(3)
    starts = [torch.randn(n, generator=gen).bfloat16() for n in (40_960, 1000)]
    grads = [[(torch.randn(s.numel(), generator=gen) * 1e-2).bfloat16() for s in starts] for _ in range(5)]
    results = []
    for name in (other, "torch"):
        masters = [Bf16Master(s.clone()) for s in starts]
        opt = STEPPERS[name](masters, CONFIG) if name in STEPPERS else _cpp_step(name)(masters, CONFIG)
        for step_grads in grads:
            for g, grad in enumerate(step_grads):
                opt.step_group(g, grad, 0.8, 1e-3, None)
        results.append([m.weight.clone() for m in masters])
    for a, b in zip(*results):
        diff = (a.double() - b.double()).abs() / _ulp(b.double())
        assert float(diff.max()) <= 1.0 and float((diff > 0).double().mean()) < 1e-3


@pytest.mark.parametrize("kind", ["hybrid8bit", "hybrid4bit", "fp32"])
def test_bf16_training_resumes_exactly(tmp_path, kind):
    """bf16 compute on the CPU, 8-bit, 4-bit (both stochastic) or fp32 states, bf16 master: 8 steps equal
    4 + 4 resumed bit for bit (weights, states, losses: the stochastic draws repeat), and the
    checkpoint holds the masters as bf16 (2 B per parameter)."""
    from safetensors import safe_open

    from lazytrain.train.checkpoint import Checkpointer

    a, b = tmp_path / "a", tmp_path / "b"
    common = [*COMMON, f"optimizer.kind={kind}", *(["optimizer.state_rounding=nearest"] if kind == "fp32" else [])]
    main(["train", "training.steps=8", f"training.output_dir={a}", "memory.master=bf16", *common])
    main(["train", "training.steps=4", f"training.output_dir={b}", "memory.master=bf16", *common])
    main(["train", "training.steps=8", f"training.output_dir={b}", "memory.master=bf16", "training.resume=true",
          *common])
    assert _losses(a) == _losses(b) and len(_losses(a)) == 8
    paths = [Checkpointer(run).latest().path for run in (a, b)]
    for name in ("masters.safetensors", "optimizer.safetensors"):
        with safe_open(str(paths[0] / name), "pt") as fa, safe_open(str(paths[1] / name), "pt") as fb:
            assert set(fa.keys()) == set(fb.keys())
            for key in fa.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                ta, tb = fa.get_tensor(key), fb.get_tensor(key)
                if name.startswith("masters"):
                    assert ta.dtype == torch.bfloat16
                assert torch.equal(ta.view(torch.uint8), tb.view(torch.uint8)), (name, key)


def test_checkpoints_load_across_master_forms(tmp_path, caplog):
    """An fp32 run's checkpoint resumes into a bf16 master rounded to nearest, with a warning;
    a bf16 run's checkpoint resumes into fp32 and split masters exactly."""
    from lazytrain.train.trainer import Trainer

    def resumed(run, master: str) -> Trainer:
        config = load_config(None, ["training.steps=4", f"training.output_dir={run}", f"memory.master={master}",
                                    "training.resume=true", *COMMON])
        trainer = Trainer(config)
        trainer.setup()
        assert trainer.step == 3
        return trainer

    fp32_run, bf16_run = tmp_path / "fp32", tmp_path / "bf16"
    main(["train", "training.steps=3", f"training.output_dir={fp32_run}", "memory.master=fp32", *COMMON])
    main(["train", "training.steps=3", f"training.output_dir={bf16_run}", "memory.master=bf16", *COMMON])
    saved = _masters(fp32_run)
    with caplog.at_level(logging.WARNING, logger="lazytrain.train.checkpoint"):
        trainer = resumed(fp32_run, "bf16")
    assert "rounded to the nearest bf16, once" in caplog.text
    for g, master in enumerate(trainer.store.masters):
        assert isinstance(master, Bf16Master)
        assert torch.equal(master.weight.view(torch.int16), saved[f"g{g}"].bfloat16().view(torch.int16))
    saved = _masters(bf16_run)
    for mode in ("fp32", "split"):
        caplog.clear()
        trainer = resumed(bf16_run, mode)
        assert trainer.store.master_mode == mode and "rounded" not in caplog.text
        for g in range(len(trainer.store.masters)):
            assert torch.equal(trainer.store.master_fp32(g).view(torch.int32), saved[f"g{g}"].float().view(torch.int32))


@pytest.mark.parametrize(("overrides", "message"), [
    (["memory.master=bf16", "memory.split_master=true"],
     "memory.split_master=true (a deprecated alias of memory.master=split) contradicts memory.master=bf16"),
    (["memory.master=split", "memory.split_master=false"], "contradicts memory.master=split"),
    (["memory.master=bf16", "model.dtype=fp32"], "memory.master=bf16 keeps the master in the streamed bf16 weights"),
    (["memory.split_master=true", "model.dtype=fp32"], "memory.master=split keeps the master"),
    (["memory.master=half"], "memory.master='half' is not one of auto, fp32, split, bf16"),
])
def test_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, overrides)


def test_the_deprecated_alias_and_auto_resolve():
    from lazytrain.train.session import resolve_master

    cpu, gpu = torch.device("cpu"), torch.device("cuda")

    def resolved(*overrides, device=gpu, dtype=torch.bfloat16, distributed=False):
        return resolve_master(load_config(None, list(overrides)), device, dtype, distributed)

    assert resolved() == "split" and resolved(device=cpu) == "fp32" and resolved(dtype=torch.float32) == "fp32"
    assert resolved("memory.split_master=true", device=cpu) == "split"
    assert resolved("memory.split_master=false") == "fp32"
    assert resolved("memory.split_master=auto", "memory.master=bf16") == "bf16"
    assert resolved("memory.split_master=false", "memory.master=fp32") == "fp32"
    assert resolved(distributed=True) == "fp32"
    assert resolved("memory.master=bf16", "optimizer.kind=hybrid4bit") == "bf16"  # 4-bit states round it too
    with pytest.raises(ConfigError, match="memory.master=bf16 is not supported under torchrun yet"):
        resolved("memory.master=bf16", distributed=True)
    with pytest.raises(ConfigError, match="this run computes in torch.float32"):
        resolved("memory.master=bf16", dtype=torch.float32)


def test_a_bf16_master_refuses_another_weight_out_and_needs_its_key():
    opt = Hybrid8bitAdamW([Bf16Master(torch.zeros(4096, dtype=torch.bfloat16))], [0], CONFIG, kernel="torch")
    with pytest.raises(ValueError, match="the master is bf16, so it is the streamed weight"):
        opt.step_group(0, torch.zeros(4096), 1.0, 1e-3, torch.empty(4096, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="a bf16 master is written with stochastic rounding"):
        hybrid8bit.torch_step_8bit(torch.zeros(4096), opt.masters[0], opt.states[0], None,
                                   StepScalars.of(CONFIG, 1, 1e-3, 1.0, 0))


COMMON = ["training.batch_size=4", "training.progress=false", "data.builtin_train_size=64",
          "data.heldout_size=2", "optimizer.warmup_steps=2", "model.dtype=bf16",
          "optimizer.kind=hybrid8bit", "training.max_grad_norm=0.5", "optimizer.schedule=constant",
          "optimizer.state_rounding=stochastic"]


def _losses(run) -> list[float]:
    import json

    records = (run / "metrics.jsonl").read_text().splitlines()
    return [json.loads(r)["loss"] for r in records if '"loss"' in r]


def _masters(run):
    from safetensors.torch import load_file

    from lazytrain.train.checkpoint import Checkpointer

    return load_file(str(Checkpointer(run).latest().path / "masters.safetensors"))


def _four_bit_run(kernel: str, starts: list[torch.Tensor], grads, rounding: str = "nearest") -> list[torch.Tensor]:
    """The bf16 weights after `grads`' steps of Hybrid4bitAdamW with bf16 masters from
    ``starts`` (the first group a shard at element 128 * 3 of its group, so the offset counts)."""
    masters = [Bf16Master(s.clone()) for s in starts]
    opt = Hybrid4bitAdamW(masters, [s.numel() // 2 for s in starts], CONFIG, kernel=kernel, rounding=rounding,
                          group_offsets=[128 * 3] + [0] * (len(starts) - 1), seed=11)
    for step_grads in grads:
        for g, grad in enumerate(step_grads):
            opt.step_group(g, grad, 0.8, 1e-3, None)
    return [m.weight.clone() for m in opt.masters]


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("kernel", ["cpp", *[pytest.param(f"cpp-{v.values[0]}", marks=v.marks) for v in VARIANTS]])
def test_four_bit_kernel_agrees_with_its_torch_path(kernel, rounding):
    """hybrid4bit with bf16 masters, 5 steps of a 4-bit group (an odd tail) and an fp32-state one,
    each kernel path against the torch path: the same bf16 weights except where the fp32 update
    differs by an ulp across a rounding threshold (the kernel's sqrt and reciprocal estimates,
    which can also move a value on a midpoint to the neighbouring 4-bit code, and with it later
    updates): at most one bf16 ulp, on under 1e-3 of the weights, as for 8-bit states. Most
    weights must move, or agreement would be empty."""
    gen = torch.Generator().manual_seed(8)
    starts = [torch.randn(n, generator=gen).bfloat16() for n in (40_960 + 77, 1000)]
    grads = [[(torch.randn(s.numel(), generator=gen) * 1e-2).bfloat16() for s in starts] for _ in range(5)]
    ours, theirs = _four_bit_run(kernel, starts, grads, rounding), _four_bit_run("torch", starts, grads, rounding)
    for a, b, start in zip(ours, theirs, starts):
        diff = (a.double() - b.double()).abs() / _ulp(b.double())
        assert float(diff.max()) <= 1.0 and float((diff > 0).double().mean()) < 1e-3
        assert float((b != start).double().mean()) > 0.5


@pytest.mark.parametrize("variant", VARIANTS)
def test_eight_and_four_bit_kernels_round_a_bf16_master_alike(variant):
    """The rounding is one code (csrc/master.h): both kernels' `stochastic_bf16` give the torch
    path's bits (random values, special patterns, offsets past 2**32), and a group with fp32
    states (the same fp32 update in both optimizers) gets the same bf16 weights, bit for bit,
    from Hybrid8bitAdamW and Hybrid4bitAdamW: same key, same draw per element, same offset."""
    eight = kernel_module.load_kernel(required=True, variant=variant)
    four = kernel_module.load_kernel(required=True, variant=variant, name="hybrid4bit")
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(20_000, generator=gen) * torch.exp2(torch.randint(-40, 40, (20_000,), generator=gen).float())
    special = torch.from_numpy(np.array(SPECIAL, dtype=np.uint32).view(np.int32)).view(torch.float32)
    x = torch.cat([special, x, special])
    for offset in (0, 128 * 5, 2**32 - 10_000 // 128 * 128):
        expected = stochastic_bf16(x, 0x1234567, offset).view(torch.int16)
        for kernel in (eight, four):
            assert torch.equal(kernel.stochastic_bf16(x, 0x1234567, offset).view(torch.int16), expected), offset
    n = 3000  # under MIN_8BIT_NUMEL: fp32 states in both optimizers
    start = torch.randn(n, generator=gen).bfloat16()
    grads = [(torch.randn(n, generator=gen) * 1e-2).bfloat16() for _ in range(4)]
    weights = []
    for cls in (Hybrid8bitAdamW, Hybrid4bitAdamW):
        opt = cls([Bf16Master(start.clone())], [n], CONFIG, kernel=f"cpp-{variant}", group_offsets=[128 * 7], seed=3)
        for grad in grads:
            opt.step_group(0, grad, 0.9, 1e-3, None)
        weights.append(opt.masters[0].weight.view(torch.int16))
    assert torch.equal(*weights)
    assert float((weights[0] != start.view(torch.int16)).double().mean()) > 0.5


def test_four_bit_device_moves_keep_a_bf16_master():
    """hybrid4bit's device moves (`to_device`, `stream_in` / `stream_out`, here onto CPU tensors:
    the GPU's code, the torch path) step a bf16 master as the host torch path does, bit for bit,
    and write it back into the host weights."""
    gen = torch.Generator().manual_seed(10)
    n = 40 * 128 + 3  # 4-bit states (over MIN_8BIT_NUMEL), an odd tail
    start = torch.randn(n, generator=gen).bfloat16()
    grads = [(torch.randn(n, generator=gen) * 1e-2).bfloat16() for _ in range(3)]
    host, moved, streamed = (Hybrid4bitAdamW([Bf16Master(start.clone())], [n], CONFIG, kernel="torch", seed=2)
                             for _ in range(3))
    moved_home, streamed_home = moved.masters[0].weight, streamed.masters[0].weight
    states = streamed.states[0].tensors().values()
    assert streamed.streamed_bytes(0) == sum(hybrid8bit._aligned(t.numel() * t.element_size()) for t in states)
    on_device = start.clone()
    moved.to_device(0, on_device)
    for grad in grads:
        host.step_group(0, grad, 0.5, 1e-3, None)
        moved.step_group(0, grad, 0.5, 1e-3, None)
        streamed.stream_in(0, streamed_home.clone(), torch.empty(streamed.streamed_bytes(0), dtype=torch.uint8))
        streamed.step_group(0, grad, 0.5, 1e-3, None)
        streamed.stream_out(0)
    assert torch.equal(on_device.view(torch.int16), host.masters[0].weight.view(torch.int16))
    moved.to_host()
    for home in (moved_home, streamed_home):
        assert torch.equal(home.view(torch.int16), host.masters[0].weight.view(torch.int16))
    assert not torch.equal(host.masters[0].weight, start)

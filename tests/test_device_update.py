"""The resident groups (embedding, final norm + head) stepped on the executor's device
(`Plan.const_update="device"`) train exactly as when the CPU optimizer steps them."""

from __future__ import annotations

import dataclasses
import logging
import math
import threading

import pytest
import torch
from conftest import make_hf_model, random_batch

from lazytrain.memory.host_store import HostStore
from lazytrain.model.adapter import ModelAdapter, load_hf_config
from lazytrain.model.loading import load_safetensors
from lazytrain.optim.adamw import FusedAdamW
from lazytrain.optim.base import AdamWConfig
from lazytrain.optim.hybrid8bit import Hybrid8bitAdamW
from lazytrain.optim.master import Bf16Master
from lazytrain.optim.split import SplitMaster
from lazytrain.plan.plan import megatrain_plan
from lazytrain.runtime.executor import Executor
from lazytrain.runtime.update import HostUpdater

CPU = torch.device("cpu")
OPT = AdamWConfig(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
STEPS = 6


def _run(folder, const_update: str, dtype: torch.dtype, master: str, device=CPU, poison: bool = False,
         rounding: str = "stochastic", device_layers: int = 0, device_steps: int = 0, prepare=None):
    """Train STEPS steps; returns (losses, store, optimizer state). ``poison``: after the first
    update, the host copies of the device groups' gradients and weights are overwritten with
    NaN, so any step that still read them would show it (a streamed device layer, too).
    ``prepare(optimizer, executor, updater)`` runs once before the first step."""
    adapter = ModelAdapter(load_hf_config(folder), device, dtype)
    store = HostStore(adapter.layouts, dtype, pin=False, master=master)
    load_safetensors(adapter, store, folder)
    plan = dataclasses.replace(megatrain_plan(adapter.num_layers, 3, 12, every=2), const_update=const_update,
                               device_layers=device_layers, device_steps=device_steps)
    executor = Executor(adapter, store, plan, device)
    optimizer = Hybrid8bitAdamW(store.masters, [lay.decay_numel for lay in adapter.layouts], OPT, kernel="torch",
                                rounding=rounding, seed=3)
    updater = HostUpdater(executor, optimizer, overlap=True)
    if prepare is not None:
        prepare(optimizer, executor, updater)
    losses = []
    if poison:
        assert executor.device_groups == {0, *range(1, 1 + device_layers), len(store.weights) - 1}
    for step in range(STEPS):
        stats = executor.forward_backward(*random_batch(3, 12, adapter.vocab_size, padded=True, seed=step))
        losses.append(stats.loss)
        updater.start(min(1.0, 0.5 / (stats.grad_norm + 1e-6)), OPT.lr * (1 - step / STEPS))
        if poison and step == 0:
            updater._join()  # the streamed steps' copies out
            for g in executor.device_groups:
                store.grads[g].fill_(float("nan"))
            for g in executor.device_groups:
                store.weights[g].fill_(float("nan"))
        if step == 2:  # a checkpoint mid-run: the device groups come home, then go back
            updater.finish()
            optimizer.state_dict()
    updater.finish()
    return losses, store, optimizer.state_dict()


def _tiny(folder, layers: int) -> tuple[ModelAdapter, HostStore]:
    """A tiny fp32 Qwen2 saved in ``folder`` and loaded into a host store."""
    make_hf_model("qwen2", seed=1, layers=layers).save_pretrained(folder)
    adapter = ModelAdapter(load_hf_config(folder), CPU, torch.float32)
    store = HostStore(adapter.layouts, torch.float32, pin=False)
    load_safetensors(adapter, store, folder)
    return adapter, store


def _assert_same(a, b):
    (losses_a, store_a, state_a), (losses_b, store_b, state_b) = a, b
    assert losses_a == losses_b
    for g in range(len(store_a.masters)):
        assert torch.equal(store_a.master_fp32(g), store_b.master_fp32(g)), f"group {g}"
        assert torch.equal(store_a.weights[g], store_b.weights[g]), f"group {g}"
    assert state_a["steps"] == state_b["steps"]
    for ga, gb in zip(state_a["groups"], state_b["groups"]):
        for name in ga:
            assert torch.equal(ga[name], gb[name].cpu()), name


@pytest.mark.parametrize("family", ["qwen2", "qwen2-tied"])
@pytest.mark.parametrize("dtype,master", [(torch.float32, "fp32"), (torch.bfloat16, "split"), (torch.bfloat16, "bf16")],
                         ids=["fp32", "bf16-split", "bf16-master"])
def test_device_groups_train_as_on_the_host(tmp_path, family, dtype, master):
    make_hf_model(family, seed=1, layers=4).save_pretrained(tmp_path)
    host = _run(tmp_path, "host", dtype, master)
    device = _run(tmp_path, "device", dtype, master, poison=True)
    _assert_same(host, device)
    # the first layers resident and stepped there too (one segment of the plan inside them,
    # one across their end: every=2 checkpoints layers 0 and 2)
    for device_layers in (1, 3):
        _assert_same(host, _run(tmp_path, "device", dtype, master, poison=True, device_layers=device_layers))
    # streamed layers stepped there too, with their states copied in and out: after none, one
    # or three resident ones, and up to the last layer
    for device_layers, device_steps in ((0, 2), (1, 1), (1, 3)):
        _assert_same(host, _run(tmp_path, "device", dtype, master, poison=True, device_layers=device_layers,
                                device_steps=device_steps))
    # and they trained: the embedding moved
    fresh = HostStore(ModelAdapter(load_hf_config(tmp_path), CPU, dtype).layouts, dtype, pin=False, master=master)
    load_safetensors(ModelAdapter(load_hf_config(tmp_path), CPU, dtype), fresh, tmp_path)
    assert not torch.equal(fresh.master_fp32(0), device[1].master_fp32(0))


def test_device_steps_keep_the_gradients_and_weights_off_the_host(tmp_path):
    """The executor keeps the device groups' gradients (the head's accumulated in its flat
    buffer) and the optimizer writes the resident weights: the host buffers are not touched."""
    adapter, store = _tiny(tmp_path, 2)
    plan = dataclasses.replace(megatrain_plan(adapter.num_layers, 2, 8), const_update="device")
    executor = Executor(adapter, store, plan, CPU)
    final = len(store.masters) - 1
    assert executor.device_groups == {0, final}
    for g in (0, final):
        store.grads[g].fill_(float("nan"))
    executor.forward_backward(*random_batch(2, 8, adapter.vocab_size, padded=False))
    assert set(executor.device_grads) == {0, final}
    assert all(bool(store.grads[g].isnan().all()) for g in (0, final))
    head = adapter.final_layout.params[-1]
    assert executor.device_grads[final][head.offset:].abs().sum() > 0
    optimizer = Hybrid8bitAdamW(store.masters, [lay.decay_numel for lay in adapter.layouts], OPT, kernel="torch")
    updater = HostUpdater(executor, optimizer)
    before = store.weights[0].clone()
    updater.start(1.0, 1e-3)
    updater._join()
    assert optimizer.device_groups == {0, final} and not executor.device_grads
    assert torch.equal(store.weights[0], before)  # stepped where the executor holds it
    assert not torch.equal(executor.resident[0], before)
    updater.finish()
    assert optimizer.device_groups == frozenset()
    assert torch.equal(store.weights[0], executor.resident[0])


def test_an_optimizer_without_a_device_step_says_so(tmp_path):
    make_hf_model("qwen2", seed=1, layers=2).save_pretrained(tmp_path)
    adapter = ModelAdapter(load_hf_config(tmp_path), CPU, torch.float32)
    store = HostStore(adapter.layouts, torch.float32, pin=False)
    optimizer = FusedAdamW(store.masters, [lay.decay_numel for lay in adapter.layouts], OPT)
    with pytest.raises(ValueError, match="CPU only.*hybrid8bit"):
        optimizer.to_device(0, store.weights[0].clone())
    # a plan (e.g. a plan file) that steps groups on the GPU is refused before any step
    plan = dataclasses.replace(megatrain_plan(adapter.num_layers, 2, 8), const_update="device")
    with pytest.raises(ValueError, match="FusedAdamW optimizer cannot.*hybrid8bit"):
        HostUpdater(Executor(adapter, store, plan, CPU), optimizer)


def test_to_device_checks_its_weights():
    master = SplitMaster.of(torch.randn(5000))
    optimizer = Hybrid8bitAdamW([master], [5000], OPT, kernel="torch")
    with pytest.raises(ValueError, match="5000 contiguous elements"):
        optimizer.to_device(0, torch.zeros(10, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="must be contiguous"):
        optimizer.to_device(0, torch.zeros(10000, dtype=torch.bfloat16)[::2])
    with pytest.raises(ValueError, match="bf16"):
        optimizer.to_device(0, torch.zeros(5000))
    optimizer.to_device(0, master.weight.clone())
    with pytest.raises(ValueError, match="already"):
        optimizer.to_device(0, master.weight.clone())
    with pytest.raises(ValueError, match="weight_out=None"):
        optimizer.step_group(0, torch.zeros(5000), 1.0, 1e-3, torch.zeros(5000, dtype=torch.bfloat16))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_a_split_master_stepped_on_the_gpu_agrees_with_the_host_torch_path(rounding):
    """Split masters on the GPU (the float64 reference checks cover whole ones,
    `test_optim_hybrid8bit`): within the C++ kernel's distance from the torch path, over two
    compiled pieces of the default size (COMPILED_CHUNK), the second a tail."""
    from lazytrain.optim.hybrid8bit import COMPILED_CHUNK

    torch.manual_seed(0)
    n = COMPILED_CHUNK + 3 * (1 << 20) + 77
    master0 = torch.randn(n)
    host_master, dev_master = SplitMaster.of(master0), SplitMaster.of(master0)
    host = Hybrid8bitAdamW([host_master], [n - 100], OPT, kernel="torch", rounding=rounding, seed=1)
    dev = Hybrid8bitAdamW([dev_master], [n - 100], OPT, kernel="torch", rounding=rounding, seed=1)
    dev.to_device(0, dev_master.weight.to("cuda"))
    # one step: a code one off after a step moves the next step's update by a few % of the lr
    grad = torch.randn(n).bfloat16()
    host.step_group(0, grad, 0.8, 1e-3, None)
    dev.step_group(0, grad.to("cuda"), 0.8, 1e-3, None)
    dev.to_host()
    torch.testing.assert_close(dev_master.fp32(), host_master.fp32(), rtol=0, atol=1e-6)
    for name, t in host.states[0].tensors().items():
        other = dev.states[0].tensors()[name]
        if name.endswith("codes"):  # fused multiply-adds move a few values across a code boundary
            assert int((t.long() - other.long()).abs().max()) <= 1 and float((t != other).float().mean()) < 1e-3
        else:
            torch.testing.assert_close(other, t, rtol=2e-6, atol=0)


def test_a_device_step_that_cannot_be_compiled_runs_eagerly(monkeypatch):
    """Where torch.compile fails (no Triton, no compiler), the step warns and runs its eager
    pieces: the same values (here on the CPU, as the device's)."""
    from lazytrain.optim import hybrid8bit
    from lazytrain.optim.hybrid8bit import StepScalars, device_step_8bit, torch_step_8bit

    def broken(fn):
        def run(*args):
            raise torch._dynamo.exc.BackendCompilerFailed(fn, RuntimeError("no backend"), None)
        return run

    monkeypatch.setattr(hybrid8bit.PIECE_8BIT, "fn", None)
    monkeypatch.setattr(hybrid8bit.torch, "compile", broken)
    n = 3 * 4096 + 5
    a, b = SplitMaster.of(torch.randn(n)), SplitMaster.of(torch.randn(n))
    b.weight.copy_(a.weight)
    b.remainder.copy_(a.remainder)
    opt_a = Hybrid8bitAdamW([a], [n], OPT, kernel="torch")
    opt_b = Hybrid8bitAdamW([b], [n], OPT, kernel="torch")
    grad = torch.randn(n).bfloat16()
    s = StepScalars.of(OPT, 1, 1e-3, 0.5, n - 7)
    torch_step_8bit(grad, a, opt_a.states[0], None, s)
    with pytest.warns(RuntimeWarning, match="could not be compiled.*eagerly"):
        device_step_8bit(grad, b, opt_b.states[0], None, s)
    assert hybrid8bit.PIECE_8BIT.eagerly
    assert torch.equal(a.fp32(), b.fp32())
    for name, t in opt_a.states[0].tensors().items():
        assert torch.equal(t, opt_b.states[0].tensors()[name]), name


def test_a_skipped_steps_device_gradients_are_not_held_into_the_next(tmp_path):
    """A step whose update is skipped (non-finite loss) leaves its device gradients unstepped;
    the next step lets go of them before it runs, as the planner assumes."""
    adapter, store = _tiny(tmp_path, 2)
    plan = dataclasses.replace(megatrain_plan(adapter.num_layers, 2, 8), const_update="device")
    executor = Executor(adapter, store, plan, CPU)
    executor.forward_backward(*random_batch(2, 8, adapter.vocab_size, padded=False))
    stale = executor.device_grads[0]
    seen = []
    real_embed = adapter.embed
    adapter.embed = lambda *a: (seen.append(any(g is stale for g in executor.device_grads.values())), real_embed(*a))[1]
    executor.forward_backward(*random_batch(2, 8, adapter.vocab_size, padded=False, seed=1))
    assert seen == [False] and executor.device_grads[0] is not stale


def test_device_layers_are_not_streamed(tmp_path):
    adapter, store = _tiny(tmp_path, 4)
    streamed = {}
    for k in (0, 2):
        plan = dataclasses.replace(megatrain_plan(adapter.num_layers, 2, 8, every=2), const_update="device",
                                   device_layers=k)
        executor = Executor(adapter, store, plan, CPU)
        stats = executor.forward_backward(*random_batch(2, 8, adapter.vocab_size, padded=False))
        streamed[k] = stats.h2d_weight_bytes
        assert set(executor.device_grads) == {0, *range(1, k + 1), len(store.weights) - 1}
    layer_bytes = store.weights[1].numel() * store.weights[1].element_size()
    # with 3 slots: layers 2 and 3 stream in the forward and are still there for the backward;
    # streamed too, layers 0 and 1 took 3 copies (0 again in the backward)
    assert streamed[2] == 2 * layer_bytes and streamed[0] == 5 * layer_bytes


def test_a_plan_with_device_layers_needs_the_device_update():
    from lazytrain.plan.plan import Plan, PlanError

    with pytest.raises(ValueError, match="needs const_update='device'"):
        dataclasses.replace(megatrain_plan(4, 2, 8), device_layers=2)
    plan = dataclasses.replace(megatrain_plan(4, 2, 8), const_update="device", device_layers=5)
    with pytest.raises(PlanError, match="exceeds the model's 4 layers"):
        plan.check(4)
    with pytest.raises(ValueError, match=">= 0"):
        Plan(policy="x", batch_size=1, seq_len=1, layers=[], device_layers=-1)


def test_loading_state_drops_the_device_copies_without_writing_them_back():
    """A resume with groups on a device: the restored masters must survive (the device copies
    are dropped, not copied back over them), and the loaded state is the host's."""
    n = 5000
    master = SplitMaster.of(torch.randn(n))
    optimizer = Hybrid8bitAdamW([master], [n], OPT, kernel="torch")
    optimizer.step_group(0, torch.randn(n).bfloat16(), 1.0, 1e-3, None)
    saved = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in optimizer.state_dict().items()}
    saved["groups"] = [{k: t.clone() for k, t in g.items()} for g in saved["groups"]]
    optimizer.to_device(0, master.weight.clone())
    optimizer.step_group(0, torch.randn(n).bfloat16(), 1.0, 1e-3, None)  # moves the device copy on
    restored = torch.randn(n)
    master.assign(restored)  # what the checkpoint restores into the store, before the state
    optimizer.load_state_dict(saved)
    assert optimizer.device_groups == frozenset()
    assert torch.equal(master.fp32(), restored)
    assert optimizer.steps == [1]
    for name, t in optimizer.states[0].tensors().items():
        assert torch.equal(t, saved["groups"][0][name]), name


def test_the_device_layers_forward_is_queued_before_the_first_streamed_layer_waits(tmp_path):
    """Layer k's weights wait for its CPU update (`before_load`); the embedding and the device
    layers' forwards must be queued before that wait, so the GPU runs them meanwhile."""
    adapter, store = _tiny(tmp_path, 4)
    plan = dataclasses.replace(megatrain_plan(adapter.num_layers, 2, 8, every=2), const_update="device",
                               device_layers=2)
    events = []
    executor = Executor(adapter, store, plan, CPU, before_load=lambda group: events.append(("load", group)))
    forward = adapter.layer_forward
    adapter.layer_forward = lambda i, *a, **k: (events.append(("forward", i)), forward(i, *a, **k))[1]
    executor.forward_backward(*random_batch(2, 8, adapter.vocab_size, padded=False))
    first_load = events.index(("load", 3))  # group 3: layer 2, the first streamed one
    assert ("forward", 0) in events[:first_load] and ("forward", 1) in events[:first_load]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("device_layers,device_steps", [(2, 0), (1, 2)], ids=["resident", "streamed"])
def test_device_groups_and_layers_train_on_the_gpu_as_on_the_host(tmp_path, device_layers, device_steps):
    """The executor on CUDA with bf16 split masters: the embedding, head and the first two layers
    stepped on the card (resident; or layer 0 resident and layers 1-2 streamed with their states
    copied in and out on their own streams; compiled step; host copies poisoned) against every
    group stepped by the CPU. Not bit for bit: the GPU fuses multiply-adds (a few codes one apart, see above), and
    bf16 weights one ulp apart change the next gradients, whose small entries Adam's normalisation
    then moves by up to the lr. So: losses to bf16 precision, and each group's total update within
    a few % of its size."""
    make_hf_model("qwen2", seed=1, layers=4).save_pretrained(tmp_path)
    cuda = torch.device("cuda")
    adapter = ModelAdapter(load_hf_config(tmp_path), CPU, torch.bfloat16)
    start = HostStore(adapter.layouts, torch.bfloat16, pin=False, master="split")
    load_safetensors(adapter, start, tmp_path)
    host = _run(tmp_path, "host", torch.bfloat16, "split", device=cuda, rounding="nearest")
    dev = _run(tmp_path, "device", torch.bfloat16, "split", device=cuda, rounding="nearest", poison=True,
               device_layers=device_layers, device_steps=device_steps)
    (losses_h, store_h, _), (losses_d, store_d, _) = host, dev
    assert all(map(math.isfinite, losses_d))
    torch.testing.assert_close(torch.tensor(losses_d), torch.tensor(losses_h), rtol=1e-2, atol=0)
    for g in range(len(store_h.masters)):
        update_h = store_h.master_fp32(g) - start.master_fp32(g)
        update_d = store_d.master_fp32(g) - start.master_fp32(g)
        assert float(update_h.norm()) > 0, f"group {g}"
        assert float((update_d - update_h).norm()) <= 0.05 * float(update_h.norm()), f"group {g}"


def test_streamed_steps_are_stepped_by_the_caller_from_the_host_gradients_into_the_host_weights(tmp_path):
    """`Plan.device_steps`: the streamed layers' gradients go to the host as the others' do;
    the updater steps those layers through its scratch slots (the CPU worker never does) and
    writes the new weights, master and state into the host tensors, where the next forward
    streams them from."""
    adapter, store = _tiny(tmp_path, 3)
    plan = dataclasses.replace(megatrain_plan(adapter.num_layers, 2, 8), const_update="device", device_steps=2)
    executor = Executor(adapter, store, plan, CPU)
    assert executor.streamed_steps == {1, 2} and executor.device_groups == {0, 4}
    for g in (1, 2):
        store.grads[g].fill_(float("nan"))
    executor.forward_backward(*random_batch(2, 8, adapter.vocab_size, padded=False))
    assert set(executor.device_grads) == {0, 4}
    assert all(bool(store.grads[g].isfinite().all()) for g in (1, 2))
    optimizer = Hybrid8bitAdamW(store.masters, [lay.decay_numel for lay in adapter.layouts], OPT, kernel="torch")
    stepped = []
    real = optimizer.step_group
    optimizer.step_group = lambda g, grad, *a: (stepped.append((g, threading.current_thread().name, grad)),
                                                real(g, grad, *a))[1]
    updater = HostUpdater(executor, optimizer)
    before = [store.weights[g].clone() for g in (1, 2, 3)]
    updater.start(1.0, 1e-3)
    updater.finish()
    main = threading.current_thread().name
    assert {g for g, thread, _ in stepped if thread == main} == {0, 1, 2, 4}  # the GPU's: queued by the caller
    assert {g for g, thread, _ in stepped if thread != main} == {3}  # the CPU worker's
    for g, _, grad in stepped:
        if g in (1, 2):  # a copy of the host gradient in a scratch slot
            assert grad.data_ptr() != store.grads[g].data_ptr() and torch.equal(grad, store.grads[g])
    assert not executor.device_grads and optimizer.device_groups == frozenset()
    assert all(not torch.equal(store.weights[g], b) for g, b in zip((1, 2, 3), before))
    assert optimizer.steps[1] == optimizer.steps[2] == 1
    assert updater._scratch == []  # given back once the last streamed step was queued


@pytest.mark.parametrize("make", [SplitMaster.of, lambda x: Bf16Master(x.bfloat16())], ids=["split", "bf16"])
def test_stream_in_and_out_round_trip_and_check_their_buffers(make):
    n = 3000
    master = make(torch.randn(n))
    optimizer = Hybrid8bitAdamW([master], [n], OPT, kernel="torch")
    optimizer.step_group(0, torch.randn(n).bfloat16(), 1.0, 1e-3, None)
    reference = Hybrid8bitAdamW([master.clone()], [n], OPT, kernel="torch")
    reference.load_state_dict(optimizer.state_dict())
    scratch = torch.empty(optimizer.streamed_bytes(0), dtype=torch.uint8)
    with pytest.raises(ValueError, match="uint8 of >="):
        optimizer.stream_in(0, master.weight.clone(), scratch[:-1])
    with pytest.raises(ValueError, match="3000 contiguous"):
        optimizer.stream_in(0, master.weight[:10].clone(), scratch)
    grad = torch.randn(n).bfloat16()
    optimizer.stream_in(0, master.weight.clone(), scratch)
    assert optimizer.device_groups == {0}
    optimizer.step_group(0, grad, 0.7, 1e-3, None)
    optimizer.stream_out(0)
    reference.step_group(0, grad, 0.7, 1e-3, None)
    assert optimizer.device_groups == frozenset()
    assert torch.equal(master.fp32(), reference.masters[0].fp32())
    for name, t in optimizer.states[0].tensors().items():
        assert torch.equal(t, reference.states[0].tensors()[name]), name


def test_a_streamed_state_is_pinned_in_whole_pages_not_a_power_of_two():
    """`pinned_in_place_copy`, how `stream_in` pins a state tensor on CUDA: the same values in
    whole pages of its own (torch's pinned allocator would hold 2^k bytes: 300,000 -> 524,288,
    which at 30B-A3B was 15 GiB of host memory outside the plan's budget)."""
    from lazytrain.optim.hybrid8bit import pinned_in_place_copy

    for t in (torch.randint(0, 255, (300_000,), dtype=torch.uint8), torch.randn(5_000)):
        out = pinned_in_place_copy(t)
        assert torch.equal(out, t) and out.data_ptr() != t.data_ptr() and out.data_ptr() % 4096 == 0
        assert out.untyped_storage().nbytes() == -(-t.nbytes // 4096) * 4096
        assert out.is_pinned() == torch.cuda.is_available()
    with pytest.raises(ValueError, match="1-D"):
        pinned_in_place_copy(torch.zeros(2, 3))


def test_streamed_steps_are_queued_as_the_next_forward_goes(tmp_path):
    """Not all at `start`: the first two once the next step's inputs are queued, then each
    `STREAMED_LOOKAHEAD` groups ahead of the weights the forward loads (all at once, 12 layers'
    copies went ahead of the next step's inputs on the H200's H2D link)."""
    from lazytrain.runtime.update import STREAMED_LOOKAHEAD

    assert STREAMED_LOOKAHEAD == 2
    adapter, store = _tiny(tmp_path, 4)
    plan = dataclasses.replace(megatrain_plan(adapter.num_layers, 2, 8), const_update="device", device_steps=4)
    executor = Executor(adapter, store, plan, CPU)
    optimizer = Hybrid8bitAdamW(store.masters, [lay.decay_numel for lay in adapter.layouts], OPT, kernel="torch")
    updater = HostUpdater(executor, optimizer)
    events = []
    real_step, real_load = optimizer.step_group, executor.before_load
    optimizer.step_group = lambda g, *a: (events.append(("step", g)) if g in executor.streamed_steps else None,
                                          real_step(g, *a))[1]
    executor.before_load = lambda g: (events.append(("load", g)), real_load(g))[1]
    executor.forward_backward(*random_batch(2, 8, adapter.vocab_size, padded=False))
    events.clear()
    updater.start(1.0, 1e-3)
    assert events == [] and updater._pending == [1, 2, 3, 4]  # nothing queued yet
    started = []
    executor.step_started = lambda: (started.append(len(events)), updater._queue_first(),
                                     started.append(len(updater._scratch)))
    executor.forward_backward(*random_batch(2, 8, adapter.vocab_size, padded=False, seed=1))
    forward = events[: events.index(("load", 4)) + 1]
    assert started == [0, 2]  # nothing queued before; then the two slots taken
    assert updater._scratch == []  # and given back after the last one was queued
    assert forward == [("step", 1), ("step", 2), ("load", 1), ("step", 3), ("load", 2), ("step", 4),
                       ("load", 3), ("load", 4)]
    updater.finish()
    # a finish right after start (a checkpoint, no forward) queues them all
    executor.forward_backward(*random_batch(2, 8, adapter.vocab_size, padded=False, seed=2))
    updater.start(1.0, 1e-3)
    events.clear()
    updater.finish()
    assert events == [("step", g) for g in (1, 2, 3, 4)] and optimizer.steps[1:5] == [2, 2, 2, 2]


def test_streamed_steps_let_go_of_their_slots_and_held_gradients_when_the_simulator_does(tmp_path):
    """The simulator frees a held gradient before its layer's next forward and the streamed
    steps' scratch slots by the forward of the last streamed layer (`simulate`'s stage model):
    weak references to each, probed at the end of every stage of the step that runs them (the
    30B-A3B's b128 plan ran >= 4.3 GiB over its prediction in that step on the H100, 2026-12-07;
    this pins the Python side of it). Layers 0-3 are stepped from streamed states, layers 0, 1,
    2 and 4 hold their gradients (layer 4's goes home through the CPU worker's ring)."""
    import gc
    import weakref

    adapter, store = _tiny(tmp_path, 6)
    plan = dataclasses.replace(megatrain_plan(adapter.num_layers, 2, 8), const_update="device", device_steps=4)
    plan = dataclasses.replace(plan, layers=[dataclasses.replace(lp, grad="gpu") if i in (0, 1, 2, 4) else lp
                                             for i, lp in enumerate(plan.layers)])
    executor = Executor(adapter, store, plan, CPU)
    assert sorted(executor.streamed_steps) == [1, 2, 3, 4] and sorted(executor.held_grads) == [1, 2, 3, 5]
    optimizer = Hybrid8bitAdamW(store.masters, [lay.decay_numel for lay in adapter.layouts], OPT, kernel="torch")
    updater = HostUpdater(executor, optimizer)
    tracked: dict[str, weakref.ref] = {}
    queue = updater._queue_streamed_on_gpu

    def tracking_queue(last):
        queue(last)
        for n, buffers in enumerate(updater._scratch):
            tracked.update({f"slot {n}.{k}": weakref.ref(t) for k, t in enumerate(buffers)})

    updater._queue_streamed_on_gpu = tracking_queue
    executor.forward_backward(*random_batch(2, 8, adapter.vocab_size, padded=False))
    held = dict(executor.device_grads)
    tracked.update({f"grad {g}": weakref.ref(held[g]) for g in (1, 2, 3, 5)})
    del held
    updater.start(1.0, 1e-3)

    def alive():
        gc.collect()
        return {name for name, ref in tracked.items() if ref() is not None}

    executor.stage_memory, executor.memory_probe = [], alive
    executor.forward_backward(*random_batch(2, 8, adapter.vocab_size, padded=False, seed=1))
    updater.finish()
    stages = dict(executor.stage_memory)
    assert any(name.startswith("slot") for name in stages["embed"])  # taken as the step starts
    for layer in range(6):
        gone = {f"grad {g}" for g in (1, 2, 3, 5) if g - 1 <= layer}
        if layer >= 3:
            gone |= {name for name in tracked if name.startswith("slot")}
        assert not gone & stages[f"fwd {layer}"], (layer, stages[f"fwd {layer}"])
    assert all(not stages[name] for name in stages if not name.startswith(("embed", "fwd")) or name == "embed bwd")


def _out_of_memory(*_):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.90 GiB (simulated)")


def _failing_once(optimizer, method: str, when) -> None:
    """Make ``optimizer.<method>`` (streamed_bytes, stream_in, to_device or step_group) run out
    of memory at the first call for which ``when(group, n)`` holds (n: that method's calls so far,
    this one included). A failing step on the device first writes its device copy and then
    raises, uncounted, as a step that runs out midway would."""
    state = {"n": 0, "failed": False}
    real = getattr(optimizer, method)

    def patched(group, *args):
        state["n"] += 1
        if state["failed"] or not when(group, state["n"]) or (
                method == "step_group" and group not in optimizer.device_groups):
            return real(group, *args)
        state["failed"] = True
        if method == "step_group":
            real(group, *args)
            optimizer.steps[group] -= 1
        _out_of_memory()

    setattr(optimizer, method, patched)


@pytest.mark.parametrize("where,when", [("slots", "forward"), ("copy in", "forward"), ("step", "forward"),
                                        ("slots", "finish"), ("step", "finish")])
def test_a_streamed_step_that_runs_out_of_gpu_memory_is_stepped_on_the_cpu(tmp_path, where, when, caplog):
    """An update's streamed steps (layers 0-2, groups 1-3) run out of GPU memory: taking the
    scratch slots (all three go to the CPU), copying group 2 in, or in group 2's step, after it
    wrote its device copy (groups 2 and 3 go). The second update's, queued in the next forward;
    or the third's, queued by the `finish` of the checkpoint right after it. Those groups are
    stepped on the CPU, the same update, from their host tensors; the run trains exactly as the
    host's and the CPU worker steps every streamed layer from then on. Until this, the failed
    group's update was lost (its device copy came home at `finish` as the update) and `finish`
    ran out again taking the slots."""
    make_hf_model("qwen2", seed=1, layers=4).save_pretrained(tmp_path)
    host = _run(tmp_path, "host", torch.bfloat16, "split")
    update = 2 if when == "forward" else 3
    seen = {}

    def prepare(optimizer, executor, updater):
        seen.update(executor=executor, updater=updater)
        if where == "slots":  # called once per group when the slots are taken (and by stream_in)
            taken = []
            when_ = lambda group, n: not updater._scratch and (taken.append(n) or len(taken) == 3 * update - 2)
            _failing_once(optimizer, "streamed_bytes", when_)
        else:
            calls = []
            method = "stream_in" if where == "copy in" else "step_group"
            _failing_once(optimizer, method, lambda group, n: group == 2 and (calls.append(n) or len(calls) == update))

    with caplog.at_level(logging.WARNING, logger="lazytrain"):
        device = _run(tmp_path, "device", torch.bfloat16, "split", device_steps=3, prepare=prepare)
    _assert_same(host, device)
    updater, executor = seen["updater"], seen["executor"]
    assert isinstance(updater.out_of_memory, torch.OutOfMemoryError) and updater.out_of_memory.__traceback__ is None
    assert executor.streamed_steps == frozenset() and updater._scratch == []
    groups = "[1, 2, 3]" if where == "slots" else "[2, 3]"
    assert f"optimizer step of groups {groups}" in caplog.text and "Tried to allocate 1.90 GiB" in caplog.text
    assert caplog.text.count("ran out of memory") == 1  # the later updates step them on the CPU at once


@pytest.mark.parametrize("where", ["copy", "step"])
def test_a_device_group_copied_to_the_gpu_that_runs_out_is_stepped_on_the_cpu(tmp_path, caplog, where):
    """The head's first update runs out of GPU memory copying its master and state there, or in
    its step there, after writing its device copy (the weights: the resident ones): the copy is
    dropped and the head stepped on the CPU from the gradient the GPU held, its resident weights
    reloaded from the host; it stays on the CPU, and the run trains exactly as the host's."""
    make_hf_model("qwen2", seed=1, layers=4).save_pretrained(tmp_path)
    host = _run(tmp_path, "host", torch.bfloat16, "split")
    placed = []

    def prepare(optimizer, executor, updater):
        head = executor.num_groups - 1
        _failing_once(optimizer, "to_device" if where == "copy" else "step_group", lambda group, n: group == head)
        real = optimizer.to_device
        optimizer.to_device = lambda group, weight: (placed.append(group), real(group, weight))[1]

    with caplog.at_level(logging.WARNING, logger="lazytrain"):
        device = _run(tmp_path, "device", torch.bfloat16, "split", prepare=prepare)
    _assert_same(host, device)
    # update 1 (5 failed), then 4 after update 3's checkpoint: 5 not tried again
    assert placed == [0, 5, 0]
    assert "optimizer step of groups [5]" in caplog.text and caplog.text.count("ran out of memory") == 1


def test_a_device_step_that_runs_out_of_memory_stops_the_run_with_what_to_do(tmp_path):
    """A group whose master and state have lived on the GPU since an earlier update may be
    half-stepped: no fallback, one error."""
    from lazytrain.errors import LazyTrainError
    from lazytrain.runtime.update import DeviceStepOutOfMemory

    adapter, store = _tiny(tmp_path, 2)
    plan = dataclasses.replace(megatrain_plan(adapter.num_layers, 2, 8), const_update="device")
    executor = Executor(adapter, store, plan, CPU)
    optimizer = Hybrid8bitAdamW(store.masters, [lay.decay_numel for lay in adapter.layouts], OPT, kernel="torch")
    updater = HostUpdater(executor, optimizer)
    executor.forward_backward(*random_batch(2, 8, adapter.vocab_size, padded=False))
    updater.start(1.0, 1e-3)  # the first update places the groups
    executor.forward_backward(*random_batch(2, 8, adapter.vocab_size, padded=False, seed=1))
    optimizer.step_group = lambda group, *a: _out_of_memory() if group == 0 else None
    with pytest.raises(DeviceStepOutOfMemory, match="group 0.*may be partly stepped.*training.resume=true") as info:
        updater.start(1.0, 1e-3)
    assert isinstance(info.value, LazyTrainError) and isinstance(info.value, MemoryError)


def _piece_spy(monkeypatch, fail_at: int | None = None) -> tuple[list[int], list[int]]:
    """Stand-ins for the compiled piece (`PIECE_8BIT.fn`: the eager piece, or a compile error
    at its call ``fail_at``) and for the eager one (`PIECE_8BIT.eager`), recording each call's
    elements: (the compiled stand-in's, the eager piece's)."""
    from lazytrain.optim import hybrid8bit

    eager, compiled = hybrid8bit._device_piece, ([], [])

    def eager_piece(*args):
        compiled[1].append(args[0].numel())
        eager(*args)

    def compiled_piece(*args):
        if fail_at is not None and len(compiled[0]) == fail_at:
            raise torch._dynamo.exc.BackendCompilerFailed(compiled_piece, RuntimeError("no backend"), None)
        compiled[0].append(args[0].numel())
        eager(*args)

    monkeypatch.setattr(hybrid8bit.PIECE_8BIT, "eager", eager_piece)
    monkeypatch.setattr(hybrid8bit.PIECE_8BIT, "fn", compiled_piece)
    return compiled


def _device_step_in_pieces(chunk: int | None, rounding) -> list[torch.Tensor]:
    """One `device_step_8bit` (on the CPU) from a fixed start: the master and the state after."""
    from lazytrain.optim.hybrid8bit import StepScalars, device_step_8bit
    from lazytrain.optim.quant import BLOCK

    n = 40 * BLOCK + 5  # over MIN_8BIT_NUMEL: 8-bit states
    gen = torch.Generator().manual_seed(0)
    master = SplitMaster.of(torch.randn(n, generator=gen))
    opt = Hybrid8bitAdamW([master], [n], OPT, kernel="torch")
    opt.step_group(0, torch.randn(n, generator=gen).bfloat16(), 0.5, 1e-3, None)  # moments that are not zero
    device_step_8bit(torch.randn(n, generator=gen).bfloat16(), master, opt.states[0], None,
                     StepScalars.of(OPT, 2, 1e-3, 0.7, 21 * BLOCK + 9), rounding, chunk=chunk)
    return [master.fp32(), *opt.states[0].tensors().values()]


@pytest.mark.parametrize("rounding", [None, (12345, 640)])
def test_the_device_steps_pieces_do_not_change_its_values(monkeypatch, rounding):
    """`device_step_8bit` in pieces of ``chunk`` elements (default COMPILED_CHUNK; a benchmark's
    other sizes) gives the values of one piece, a tail, decay ending inside a piece and
    stochastic rounding's element indices included (the eager piece on the CPU, as the compiled
    one on a GPU); a size that would cut a quantization block, or misalign its absmax slice, is
    refused."""
    from lazytrain.optim import hybrid8bit
    from lazytrain.optim.hybrid8bit import PIECE_ALIGN, StepScalars, device_step_8bit
    from lazytrain.optim.quant import BLOCK

    monkeypatch.setattr(hybrid8bit, "COMPILED_CHUNK", 4 * PIECE_ALIGN)
    n = 40 * BLOCK + 5
    whole = None
    for chunk, sizes in ((12 * PIECE_ALIGN, [n]), (None, [2048, 2048, n - 4096]),
                         (PIECE_ALIGN, [512] * 10 + [n - 5120])):
        calls, _ = _piece_spy(monkeypatch)
        result = _device_step_in_pieces(chunk, rounding)
        assert calls == sizes, chunk
        if whole is None:
            whole = result
        for a, b in zip(whole, result):
            assert torch.equal(a, b), chunk
    state = Hybrid8bitAdamW([torch.randn(n)], [n], OPT, kernel="torch").states[0]
    for bad in (0, BLOCK, PIECE_ALIGN + BLOCK, -PIECE_ALIGN):
        with pytest.raises(ValueError, match=f"chunk must be a positive multiple of {PIECE_ALIGN}.*got {bad}"):
            device_step_8bit(torch.zeros(n), SplitMaster.of(torch.zeros(n)), state, None,
                             StepScalars.of(OPT, 2, 1e-3, 0.7, 0), None, chunk=bad)


def test_a_device_step_whose_compiling_fails_midway_goes_on_eagerly_in_smaller_pieces(monkeypatch):
    """A compile error at a later piece (a tail's recompile): the pieces before it stay done,
    this one and the rest run eagerly in DEVICE_CHUNK pieces (their temporaries are ~6x a
    compiled piece's), and the step equals one run in a single piece; later steps are eager."""
    from lazytrain.optim import hybrid8bit
    from lazytrain.optim.hybrid8bit import PIECE_ALIGN

    monkeypatch.setattr(hybrid8bit, "COMPILED_CHUNK", 4 * PIECE_ALIGN)
    monkeypatch.setattr(hybrid8bit, "DEVICE_CHUNK", PIECE_ALIGN)
    n = 40 * 128 + 5
    _piece_spy(monkeypatch)
    whole = _device_step_in_pieces(12 * PIECE_ALIGN, None)
    compiled, eager = _piece_spy(monkeypatch, fail_at=1)
    with pytest.warns(RuntimeWarning, match="could not be compiled.*eagerly"):
        result = _device_step_in_pieces(None, None)
    assert compiled == [2048] and eager == [512] * 6 + [n - 5120]
    for a, b in zip(whole, result):
        assert torch.equal(a, b)
    assert hybrid8bit.PIECE_8BIT.eagerly
    eager.clear()
    _device_step_in_pieces(None, None)
    assert eager == [512] * 10 + [n - 5120]

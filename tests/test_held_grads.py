"""Gradients the plan holds on the GPU (`LayerPlan.grad="gpu"`, issue 51 item 1): the device
path emulated on the CPU (the executor's device is the CPU, as `test_device_update`'s), where a
held gradient is kept by the executor, taken by the updater, and brought home through the
store's ring, or stepped in place by a ``device_steps`` layer. The masters must equal those of
host-buffered gradients bit for bit."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import make_hf_model, random_batch

from lazytrain.memory.host_store import GRAD_RING_SLOTS, HostBytes, HostStore, grad_ring_bytes
from lazytrain.model.adapter import ModelAdapter, load_hf_config
from lazytrain.model.loading import load_safetensors
from lazytrain.optim.base import AdamWConfig
from lazytrain.optim.hybrid8bit import Hybrid8bitAdamW
from lazytrain.plan.plan import LayerPlan, PlanError, megatrain_plan
from lazytrain.runtime.executor import Executor, held_grad_groups, host_grad_groups
from lazytrain.runtime.update import HostUpdater

CPU = torch.device("cpu")
OPT = AdamWConfig(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
STEPS = 20


def _plan(num_layers: int, gpu: tuple[int, ...] = (), **fields):
    plan = dataclasses.replace(megatrain_plan(num_layers, 2, 8, every=2), **fields)
    plan.layers = [dataclasses.replace(lp, grad="gpu" if i in gpu else "host") for i, lp in enumerate(plan.layers)]
    return plan


def _store(folder, defer: bool, device: torch.device = CPU) -> tuple[ModelAdapter, HostStore]:
    """fp32: bf16 matmuls on the CPU take 5x as long, and the held gradient's bits move the same
    way in either dtype."""
    adapter = ModelAdapter(load_hf_config(folder), device, torch.float32)
    store = HostStore(adapter.layouts, torch.float32, pin=False, defer_grads=defer)
    load_safetensors(adapter, store, folder)
    return adapter, store


def _train(folder, max_grad_norm: float, gpu: tuple[int, ...] = (), fail_step_of: int | None = None,
           device: torch.device = CPU, **fields):
    """STEPS overlapped steps (a `finish` midway, as a checkpoint's); the store's gradient
    buffers wait for the plan (none for the held layers). ``fail_step_of``: that group's first
    streamed GPU step runs out of memory (it is stepped on the CPU instead)."""
    adapter, store = _store(folder, defer=True, device=device)
    executor = Executor(adapter, store, _plan(adapter.num_layers, gpu, **fields), device)
    optimizer = Hybrid8bitAdamW(store.masters, [lay.decay_numel for lay in adapter.layouts], OPT, kernel="torch",
                                seed=3)
    updater = HostUpdater(executor, optimizer, overlap=True)
    if fail_step_of is not None:
        real = optimizer.step_group

        def step_group(group, *args):
            if group == fail_step_of and group in optimizer.device_groups and updater.out_of_memory is None:
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            return real(group, *args)

        optimizer.step_group = step_group
    losses, clips = [], []
    for step in range(STEPS):
        stats = executor.forward_backward(*random_batch(2, 8, adapter.vocab_size, padded=True, seed=step))
        assert set(executor.device_grads) >= executor.held_grads
        losses.append(stats.loss)
        clips.append(min(1.0, max_grad_norm / (stats.grad_norm + 1e-6)))
        updater.start(clips[-1], OPT.lr * (1 - step / STEPS))
        assert not executor.device_grads.keys() & executor.held_grads  # taken by the update
        if step == STEPS // 2:
            updater.finish()
    updater.finish()
    assert not updater._held and not executor.device_grads
    assert (updater.out_of_memory is not None) == (fail_step_of is not None)
    return losses, clips, store, optimizer.state_dict()


def _assert_same(a, b):
    (losses_a, clips_a, store_a, state_a), (losses_b, clips_b, store_b, state_b) = a, b
    assert losses_a == losses_b and clips_a == clips_b
    for g in range(len(store_a.masters)):
        assert torch.equal(store_a.master_fp32(g), store_b.master_fp32(g)), f"group {g}"
        assert torch.equal(store_a.weights[g], store_b.weights[g]), f"group {g}"
    for ga, gb in zip(state_a["groups"], state_b["groups"]):
        for name in ga:
            assert torch.equal(ga[name], gb[name].cpu()), name


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("model")
    make_hf_model("qwen2", seed=1, layers=4).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def host_runs(folder):
    """Every gradient through the host buffers, by max_grad_norm (run once for the module)."""
    runs = {}
    return lambda max_grad_norm: runs.get(max_grad_norm) or runs.setdefault(max_grad_norm,
                                                                             _train(folder, max_grad_norm))


@pytest.mark.parametrize("max_grad_norm", [1e-3, 1e6], ids=["clipped", "unclipped"])
def test_held_gradients_train_as_host_buffered_ones_bit_for_bit(folder, host_runs, max_grad_norm):
    """Three of four layers held (more than the ring's slots: slots are reused), beside a
    host-buffered one; and, with the device update, a ``device_steps`` layer held (stepped from
    its GPU gradient) beside a held one the CPU steps: the same masters, weights and states as
    every gradient through the host buffers, over 20 steps; the same with a resident layer
    first."""
    host = host_runs(max_grad_norm)
    clipped = any(c < 1.0 for c in host[1])
    assert clipped == (max_grad_norm < 1.0)
    _assert_same(host, _train(folder, max_grad_norm, gpu=(0, 1, 3)))
    _assert_same(host, _train(folder, max_grad_norm, gpu=(0, 2), const_update="device", device_steps=1))
    # a resident layer (no host buffer since 2026-12-07) before a streamed GPU step and a held one
    _assert_same(host, _train(folder, max_grad_norm, gpu=(1, 2), const_update="device", device_layers=1,
                              device_steps=1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_held_gradients_on_a_gpu_train_as_host_buffered_ones(folder):
    """On CUDA (the held gradients' events, the ring's copy stream and pinned slots, the
    allocator's reuse after the copy; a device_steps layer stepped from its held gradient): the
    same training as host-buffered gradients. The same kernels run either way; the tolerance
    only allows for nondeterministic GPU kernels (atomics in some backward passes), whose last-bit
    differences Adam's normalisation moves by up to the lr in small entries, as
    `test_device_update`'s GPU test says: losses to 1e-3, each group's update within 5%."""
    cuda = torch.device("cuda")
    start = _store(folder, defer=False)[1]
    host = _train(folder, 1e-3, device=cuda)
    for fields in ({"gpu": (0, 1, 3)}, {"gpu": (0, 2), "const_update": "device", "device_steps": 1}):
        held = _train(folder, 1e-3, device=cuda, **fields)
        torch.testing.assert_close(torch.tensor(held[0]), torch.tensor(host[0]), rtol=1e-3, atol=0)
        for g in range(len(host[2].masters)):
            update_host = host[2].master_fp32(g) - start.master_fp32(g)
            update_held = held[2].master_fp32(g) - start.master_fp32(g)
            assert float((update_held - update_host).norm()) <= 0.05 * float(update_host.norm()), (fields, g)


def test_a_held_device_step_that_runs_out_of_memory_is_stepped_on_the_cpu(folder, host_runs):
    """Layer 0's streamed GPU step runs out of memory: it is stepped on the CPU from its held
    gradient (it has no host buffer), the same update, and the run stays exact."""
    host = host_runs(1e-3)
    _assert_same(host, _train(folder, 1e-3, gpu=(0, 2), const_update="device", device_steps=2, fail_step_of=1))


def test_held_layers_have_no_host_gradient_buffer_and_a_ring(folder):
    adapter, full = _store(folder, defer=False)
    plan = _plan(adapter.num_layers, (0, 3))
    assert held_grad_groups(plan) == {1, 4}
    resident = _plan(adapter.num_layers, (0, 3), const_update="device", device_layers=1)
    assert held_grad_groups(resident) == {4}
    # a resident layer's gradient never leaves the GPU: no host buffer either (the MILP counts none)
    assert host_grad_groups(resident, adapter.num_layers + 2) == frozenset(range(adapter.num_layers + 2)) - {1, 4}
    _, store = _store(folder, defer=True)
    n = len(store.weights)
    assert store.host_grad_groups is None and store.bytes().grads == full.bytes().grads  # counted whole meanwhile
    store.allocate_grads(host_grad_groups(plan, n))
    assert store.host_grad_groups == frozenset(range(n)) - {1, 4} and store.grads[1] is None
    held_numel = store.weights[1].numel() + store.weights[4].numel()
    ring = GRAD_RING_SLOTS * store.weights[1].numel() * 4
    assert store.ring_bytes == ring == grad_ring_bytes(store.weights[1].numel(), torch.float32)
    assert full.bytes().grads - (store.bytes().grads - ring) == held_numel * 4  # exactly the held layers' bytes
    predicted = HostBytes.predict(store.num_params, torch.float32, "fp32", 2.0,
                                  host_grad_numel=store.num_params - held_numel, ring_numel=store.weights[1].numel())
    assert predicted.grads == store.bytes().grads
    assert HostBytes.predict(store.num_params, torch.float32, "fp32", 2.0).grads == full.bytes().grads
    with pytest.raises(ValueError, match="allocated already"):
        store.allocate_grads(range(n))


def test_a_plan_that_sends_a_gradient_to_a_missing_host_buffer_is_refused(folder):
    adapter, store = _store(folder, defer=True)
    first = _plan(adapter.num_layers, (1, 2))
    Executor(adapter, store, first, CPU).forward_backward(*random_batch(2, 8, adapter.vocab_size, padded=False))
    assert store.host_grad_groups == frozenset(range(len(store.weights))) - {2, 3}  # from the first step's plan
    with pytest.raises(PlanError, match=r"gradients of layer 2 to the host .*no buffer.*grad='gpu'"):
        Executor(adapter, store, _plan(adapter.num_layers, (1,)), CPU)
    # held on the GPU, or stepped there as a resident layer: no buffer needed
    Executor(adapter, store, _plan(adapter.num_layers, (1, 2, 3)), CPU)
    Executor(adapter, store, _plan(adapter.num_layers, (2,), const_update="device", device_layers=2), CPU)
    with pytest.raises(ValueError, match="grad 'disk' is not one of"):
        LayerPlan(grad="disk")


def test_the_trainer_gives_host_buffers_to_the_first_plans_host_gradients_only(tmp_path, monkeypatch):
    """`lazytrain train` with a plan file holding layer 1's gradient on the GPU (the built-in
    model has 2 layers): the store's buffers are allocated for the other groups only, and the
    losses and exported weights equal those of the same plan with every gradient on the host."""
    import json

    import transformers

    from lazytrain.cli.main import main
    from lazytrain.train.trainer import Trainer

    monkeypatch.setattr(Trainer, "evaluate", lambda self, *a, **k: {})  # generation: most of the time, none of the test
    allocated = []
    real = HostStore.allocate_grads
    monkeypatch.setattr(HostStore, "allocate_grads", lambda self, groups: (allocated.append(set(groups)),
                                                                           real(self, groups))[1])
    common = ["training.batch_size=2", "training.progress=false", "data.builtin_train_size=64",
              "data.heldout_size=2", "training.steps=3", "training.max_grad_norm=0.01"]
    for run, gpu in (("host", ()), ("held", (1,))):
        path = tmp_path / f"{run}.json"
        _plan(2, gpu).save(path)
        assert main(["train", f"training.output_dir={tmp_path / run}", f"plan.file={path}", *common]) == 0
    assert allocated == [{0, 1, 2, 3}, {0, 1, 3}]

    def losses(run):
        records = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
        return [json.loads(r)["loss"] for r in records if '"loss"' in r]

    assert len(losses("held")) == 3 and losses("held") == losses("host")
    a = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "host")
    b = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "held")
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name

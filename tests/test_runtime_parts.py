"""The runtime's parts on their own: stream exposure, weight streaming, the host store, the profiler."""

from __future__ import annotations

import pytest
import torch

from lazytrain.memory.host_store import HostMemoryError, HostStore
from lazytrain.model.adapter import ModelAdapter, _layout
from lazytrain.model.build import model_config
from lazytrain.runtime.streams import Streams, exposure
from lazytrain.runtime.weights import WeightStreamer


def test_exposure_splits_idle_time_by_what_compute_waited_on():
    # compute [0,2] and [5,8]; H2D busy [1,4]; D2H busy [3,6] and [9,10]; step 10 ms
    out = exposure({"compute": [(0, 2), (5, 8)], "h2d": [(1, 4)], "d2h": [(3, 6), (9, 10)]}, 10.0)
    assert out["compute_ms"] == 5
    assert out["h2d_busy_ms"] == 3 and out["h2d_exposed_ms"] == 2  # [2,4]
    assert out["d2h_busy_ms"] == 4 and out["d2h_exposed_ms"] == 2  # [4,5] and [9,10]; [3,4] is H2D's
    assert out["other_idle_ms"] == 1  # [8,9]: nothing was busy
    assert out["compute_ms"] + out["h2d_exposed_ms"] + out["d2h_exposed_ms"] + out["other_idle_ms"] == 10


def test_weight_streamer_copies_each_layer_once_per_use_in_schedule_order():
    host = [torch.full((n,), float(i)) for i, n in enumerate((6, 4, 6))]
    loads = []
    streamer = WeightStreamer(host, num_slots=2, depth=1, streams=Streams(torch.device("cpu")),
                              device=torch.device("cpu"), before_load=loads.append)
    schedule = [0, 1, 2, 2, 1, 0]  # forward, then backward in reverse
    streamer.begin(schedule)
    for layer in schedule:
        w = streamer.acquire(layer)
        assert w.numel() == host[layer].numel() and torch.all(w == layer)
        streamer.release(layer)
    # 2 slots: loading 2 evicts 0 (its next use is furthest away), so backward finds 2 and 1
    # still resident and copies only 0 again
    assert loads == [0, 1, 2, 0]
    assert streamer.h2d_bytes == sum(host[i].numel() * 4 for i in loads)
    with pytest.raises(RuntimeError, match="out of order"):
        streamer.begin([0, 1])
        streamer.acquire(1)
    with pytest.raises(ValueError, match="at least 2 weight slots"):
        WeightStreamer(host, num_slots=1, depth=1, streams=Streams(torch.device("cpu")), device=torch.device("cpu"))


def test_host_store_lays_groups_out_flat_and_counts_bytes():
    layouts = [_layout("embed", "model.", [("embed_tokens.weight", (10, 4))]),
               _layout("layer0", "model.layers.0.", [("norm.weight", (4,)), ("proj.weight", (4, 4))])]
    store = HostStore(layouts, torch.bfloat16, pin=False, optimizer_bytes_per_param=2.0)
    assert [w.numel() for w in store.weights] == [40, 20] and store.num_params == 60
    # matrices first (they take weight decay), then the 1-D norm
    assert [p.name for p in layouts[1].params] == ["proj.weight", "norm.weight"]
    store.set_param(1, "norm.weight", torch.arange(4.0))
    assert torch.equal(store.masters[1][16:], torch.arange(4.0))
    assert torch.equal(store.weights[1][16:].float(), torch.arange(4.0))
    b = store.bytes(optimizer_state_bytes=120)
    assert (b.weights, b.masters, b.grads, b.optimizer) == (120, 240, 120, 120)
    assert b.per_param()["total"] == pytest.approx(10.0)
    # views of one arena: a group's weights are contiguous and the groups adjacent
    assert store.weights[1].data_ptr() == store.weights[0].data_ptr() + 40 * 2


def test_host_store_refuses_a_model_that_does_not_fit():
    adapter = ModelAdapter(model_config("builtin:qwen2.5-3b"), torch.device("cpu"), torch.bfloat16)
    with pytest.raises(HostMemoryError, match="optimizer.kind=hybrid8bit"):
        HostStore(adapter.layouts, torch.bfloat16, pin=False, host_limit_bytes=8 * 2**30)


def test_profiler_measures_the_executor_pieces_on_the_cpu(tmp_path):
    from lazytrain.config import load_config
    from lazytrain.runtime.profiler import profile
    from lazytrain.train.session import build_session

    config = load_config(None, [f"training.output_dir={tmp_path}", "model.source=builtin:tiny"])
    session = build_session(config)
    costs = profile(session.adapter, session.store, session.device, 4, 32, session.make_optimizer, repeats=1)
    layer = costs.layers[0]
    assert costs.num_layers == session.adapter.num_layers and (costs.batch_size, costs.seq_len) == (4, 32)
    assert layer.forward_ms > 0 and layer.backward_ms > 0 and layer.recompute_ms > 0
    # saved tensors include the layer input, which is batch x seq x hidden fp32 values
    assert layer.saved_bytes > layer.input_bytes == 4 * 32 * session.adapter.hidden_size * 4
    assert costs.optimizer_ns_per_param > 0
    assert layer.weight_bytes == session.store.weights[1].numel() * session.store.weights[1].element_size()
    # the last group (stepped after the layers) apart from the embedding (stepped before them)
    assert costs.head_params == session.adapter.final_layout.numel < costs.const_params
    # fp32 AdamW (this config's) has no device step for the resident groups
    assert session.config.optimizer.kind == "fp32"
    assert costs.const_update_ms is None and costs.const_update_bytes == 0
    if session.device.type == "cpu":  # no copies to slow the CPU down
        assert costs.copy_slowdown == 1.0 and "copy_slowdown" not in costs.notes


def test_the_slowdown_under_copies_runs_a_layers_forward_and_backward(tmp_path, monkeypatch):
    """`profiler._layer_forward_backward`: what `copy_slowdown` is timed on, a kept layer's
    forward under autograd and its backward, gradients reaching the layer's weights."""
    from lazytrain.config import load_config
    from lazytrain.plan.plan import keep_all_plan
    from lazytrain.runtime.executor import Executor
    from lazytrain.runtime.profiler import _layer_forward_backward
    from lazytrain.train.session import build_session

    session = build_session(load_config(None, [f"training.output_dir={tmp_path}", "model.source=builtin:tiny"]))
    executor = Executor(session.adapter, session.store, keep_all_plan(session.adapter.num_layers, 2, 16, 4096),
                        session.device)
    slot = session.store.weights[1].to(session.device)
    grads = []
    real_grad = torch.autograd.grad

    def grad(outputs, inputs, *args, **kwargs):
        out = real_grad(outputs, inputs, *args, **kwargs)
        grads.append(out)
        return out

    monkeypatch.setattr(torch.autograd, "grad", grad)
    try:
        _layer_forward_backward(executor, 0, slot, 2, 16, "causal")()
    finally:
        executor.abandon()
    (got,) = grads  # the input's gradient and every weight's of the layer
    assert len(got) == 1 + len(session.adapter.layouts[1].params) and all(g.abs().sum() > 0 for g in got)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_copy_slowdown_is_the_layers_under_copies_both_ways(tmp_path):
    from lazytrain.config import load_config
    from lazytrain.runtime.profiler import profile
    from lazytrain.train.session import build_session

    config = load_config(None, [f"training.output_dir={tmp_path}", "model.source=builtin:tiny", "model.dtype=bf16"])
    session = build_session(config)
    costs = profile(session.adapter, session.store, session.device, 4, 64, session.make_optimizer, repeats=2)
    both = costs.notes["copy_slowdown"]
    assert set(both) == {"layer", "matmuls"} and costs.copy_slowdown == both["layer"]


def test_the_profiler_times_the_resident_groups_step_on_the_device(tmp_path):
    from lazytrain.config import load_config
    from lazytrain.optim.hybrid8bit import state_bytes_per_param
    from lazytrain.runtime.profiler import profile
    from lazytrain.train.session import build_session

    config = load_config(None, [f"training.output_dir={tmp_path}", "model.source=builtin:tiny",
                                "optimizer.kind=hybrid8bit"])
    session = build_session(config)
    costs = profile(session.adapter, session.store, session.device, 2, 16, session.make_optimizer, repeats=1)
    # here the device is the CPU: an fp32 master and 8-bit states per parameter
    assert costs.const_update_ms > 0
    per_param = 4 + state_bytes_per_param([session.store.weights[1].numel()])
    assert costs.const_update_bytes == pytest.approx(costs.const_params * per_param, rel=1e-6)
    if session.device.type == "cpu":
        assert costs.device_step_work_bytes == 0  # measured on CUDA only


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_gpu_steps_temporaries_are_measured(tmp_path):
    """`CostTable.device_step_work_bytes`: the compiled step's allocations while it runs, one
    piece's (a scratch group the size of a decoder layer): some, and below 64 bytes per element."""
    from lazytrain.config import load_config
    from lazytrain.optim.hybrid8bit import COMPILED_CHUNK
    from lazytrain.runtime.profiler import const_update_costs
    from lazytrain.train.session import build_session

    config = load_config(None, [f"training.output_dir={tmp_path}", "model.source=builtin:tiny",
                                "optimizer.kind=hybrid8bit", "model.dtype=bf16", "memory.split_master=true"])
    session = build_session(config)
    ms, held, work, chunk = const_update_costs(session.make_optimizer, session.store, session.adapter,
                                               session.device, 2)
    piece = min(COMPILED_CHUNK, session.store.weights[1].numel())
    assert ms > 0 and held > 0 and 0 < work < 64 * piece and chunk == COMPILED_CHUNK


def test_the_profilers_saved_tensors_go_at_their_last_use_in_the_backward():
    """The profiler's count of saved storages must not hold them through the backward it then
    measures: autograd (and the executor) free each after its last use, so the working set the
    profiler measures would be too large (every saved variable refers to the pack hook)."""
    import gc
    import weakref

    from lazytrain.runtime.profiler import saved_tensor_bytes

    alive = {}

    class Probe(torch.autograd.Function):  # the first op: its backward runs last
        @staticmethod
        def forward(ctx, t):
            ctx.save_for_backward(t)
            return t * 1.0

        @staticmethod
        def backward(ctx, grad):
            assert ctx.saved_tensors[0] is not None
            gc.collect()
            alive["y"] = storage() is not None
            return grad

    x = torch.randn(1000, requires_grad=True)

    def forward():
        nonlocal storage
        y = Probe.apply(x) * 2
        storage = weakref.ref(y.untyped_storage())
        return y.sin().sum()  # saves y; its backward runs first

    storage = None
    out, nbytes = saved_tensor_bytes(forward)
    assert nbytes == 2 * 4000  # x (saved by the probe) and y
    torch.autograd.grad(out, [x])
    assert alive == {"y": False}


def test_the_profiler_lets_go_of_its_executors_buffers(tmp_path, monkeypatch):
    """A profile in the process that then trains (``lazytrain train`` without ``plan.costs``,
    plan_bench) must not leave its executor's resident groups and weight slots allocated: on the
    H200 they were 5.0 GB under every stage of the 9B run after it; nor tensors that only a
    reference cycle holds (3.2 GB of them under the 30B-A3B's first plan on the H100), so the
    profile ends with a collection."""
    import gc
    import weakref

    from lazytrain.config import load_config
    from lazytrain.runtime import profiler
    from lazytrain.train.session import build_session

    made, cycled = [], []

    class Recorded(profiler.Executor):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)
            garbage = [torch.zeros(1000)]
            garbage.append(garbage)  # unreachable once this returns, but freed by the collector only
            cycled.append(weakref.ref(garbage[0]))

    monkeypatch.setattr(profiler, "Executor", Recorded)
    session = build_session(load_config(None, [f"training.output_dir={tmp_path}", "model.source=builtin:tiny"]))
    gc.disable()  # no automatic collection in between
    try:
        profiler.profile(session.adapter, session.store, session.device, 2, 16, session.make_optimizer, repeats=1)
        assert cycled[0]() is None
    finally:
        gc.enable()
    assert len(made) == 1
    assert made[0].weights.slots == [] and made[0].resident == {} and made[0]._consts == []


def test_stage_memory_names_the_simulators_stages_in_order(tmp_path):
    from lazytrain.config import load_config
    from lazytrain.plan.plan import LayerPlan, Plan
    from lazytrain.plan.simulate import simulate
    from lazytrain.plan.synthetic import random_cost_table
    from lazytrain.runtime.executor import Executor
    from lazytrain.train.session import build_session

    config = load_config(None, [f"training.output_dir={tmp_path}", "model.source=builtin:tiny"])
    session = build_session(config)
    L = session.adapter.num_layers
    # a keep layer and a checkpoint segment: both backward paths mark their stages
    plan = Plan(batch_size=2, seq_len=16, layers=[LayerPlan(mode="keep", tier="gpu")]
                + [LayerPlan(mode="checkpoint", tier="gpu")] + [LayerPlan(mode="drop")] * (L - 2), policy="test")
    executor = Executor(session.adapter, session.store, plan, session.device)
    executor.stage_memory, ticks = [], iter(range(1000))
    executor.memory_probe = lambda: next(ticks)
    ids = torch.randint(0, session.adapter.vocab_size, (2, 16))
    executor.forward_backward(ids, ids.clone())
    names = [name for name, _ in executor.stage_memory]
    costs = random_cost_table(0, L).at(2, 16)
    predicted = simulate(plan, costs)
    assert names == predicted.stage_names and len(predicted.gpu_bytes_by_stage) == len(names)
    assert [v for _, v in executor.stage_memory] == list(range(len(names)))


@pytest.mark.parametrize("recompute", ["none", "attention"])
def test_a_host_tier_keep_layer_lets_go_of_its_device_tensors_after_its_forward(tmp_path, recompute):
    """Autograd keeps a pack hook (and what it refers to) as long as the graph: the executor's
    per-layer table of stored tensors must not outlive the layer's forward, or every offloaded
    tensor's GPU copy stays until backward (a Qwen3.5-9B solved plan ran out of GPU memory so)."""
    import gc
    import weakref

    from lazytrain.config import load_config
    from lazytrain.plan.plan import LayerPlan, Plan
    from lazytrain.runtime.executor import Executor
    from lazytrain.train.session import build_session

    session = build_session(load_config(None, [f"training.output_dir={tmp_path}", "model.source=builtin:tiny"]))
    L = session.adapter.num_layers
    plan = Plan(batch_size=2, seq_len=16, layers=[LayerPlan(mode="keep", tier="host", recompute=recompute)] * L,
                policy="test")
    executor = Executor(session.adapter, session.store, plan, session.device)
    offloaded = []
    put = executor.activations.put

    def tracking_put(tensor, tier, slot=None):
        offloaded.append(weakref.ref(tensor))
        return put(tensor, tier, slot)

    def alive():
        gc.collect()
        return sum(ref() is not None for ref in offloaded)

    executor.activations.put = tracking_put
    executor.stage_memory, executor.memory_probe = [], alive
    ids = torch.randint(0, session.adapter.vocab_size, (2, 16))
    executor.forward_backward(ids, ids.clone())
    assert len(offloaded) > 0
    assert [n for _, n in executor.stage_memory] == [0] * len(executor.stage_memory)


@pytest.mark.parametrize("second", ["keep", "checkpoint"])
def test_layer_inputs_copied_to_the_host_hold_no_device_memory_until_backward(tmp_path, second):
    """A layer input that went to the host tier (a keep layer's saved input, a checkpoint) is
    not held on the device as well, by the layer's gradient leaf or the previous keep layer's
    output (the simulator counts it on the host only: a 9B plan's backward stages ran 0.54 GB
    over the prediction per such layer); the gradients stay exact (the parity tests)."""
    import weakref

    from lazytrain.config import load_config
    from lazytrain.plan.plan import LayerPlan, Plan
    from lazytrain.runtime.executor import Executor
    from lazytrain.train.session import build_session

    session = build_session(load_config(None, [f"training.output_dir={tmp_path}", "model.source=builtin:tiny"]))
    L = session.adapter.num_layers
    assert L >= 2
    layers = [LayerPlan(mode="keep", tier="host")] + [LayerPlan(mode=second, tier="host")] * (L - 1)
    plan = Plan(batch_size=2, seq_len=16, layers=layers, policy="test")
    executor = Executor(session.adapter, session.store, plan, session.device)
    inputs: list[weakref.ref] = []
    forward = session.adapter.layer_forward

    def recording_forward(i, weights, x, *args, **kwargs):
        if len(inputs) < L:  # the forward pass's calls (backward re-runs layers too)
            inputs.append(weakref.ref(x))
        return forward(i, weights, x, *args, **kwargs)

    def holding():
        return sum(1 for ref in inputs if (t := ref()) is not None and t.untyped_storage().nbytes() > 0)

    session.adapter.layer_forward = recording_forward
    executor.stage_memory, executor.memory_probe = [], holding
    ids = torch.randint(0, session.adapter.vocab_size, (2, 16))
    executor.forward_backward(ids, ids.clone())
    stages = dict(executor.stage_memory)
    assert len(inputs) == L and stages["head"] == 0, executor.stage_memory


@pytest.mark.parametrize("last", ["keep", "checkpoint"])
def test_the_last_hidden_state_is_not_held_through_backward(tmp_path, last):
    """The head's input (the last layer's output) is counted in the head stage only: the
    executor held it in a local variable through every backward stage, one batch x seq x
    hidden tensor beyond the simulator's stages. (A keep last layer's saved output, another
    tensor on the same storage, holds it until that layer's backward, no longer.)"""
    import weakref

    from lazytrain.config import load_config
    from lazytrain.plan.plan import LayerPlan, Plan
    from lazytrain.runtime.executor import Executor
    from lazytrain.train.session import build_session

    session = build_session(load_config(None, [f"training.output_dir={tmp_path}", "model.source=builtin:tiny"]))
    L = session.adapter.num_layers
    layers = [LayerPlan(mode="checkpoint", tier="gpu")] * (L - 1) + [LayerPlan(mode=last, tier="gpu")]
    executor = Executor(session.adapter, session.store, Plan(batch_size=2, seq_len=16, layers=layers, policy="test"),
                        session.device)
    head_input: list[weakref.ref] = []
    head = executor.head_loss_backward

    def recording_head(x, *args, **kwargs):
        head_input.append(weakref.ref(x))
        return head(x, *args, **kwargs)

    def holding():
        t = head_input[0]() if head_input else None
        return int(t is not None and t.untyped_storage().nbytes() > 0)

    executor.head_loss_backward = recording_head
    executor.stage_memory, executor.memory_probe = [], holding
    ids = torch.randint(0, session.adapter.vocab_size, (2, 16))
    executor.forward_backward(ids, ids.clone())
    stages = dict(executor.stage_memory)
    held = {name for name, n in stages.items() if n and name.startswith(("bwd", "embed bwd"))}
    assert stages["head"] == 0 and not held, executor.stage_memory


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_loss_and_grad_equals_autograd_cross_entropy(dtype):
    """The head's in-place softmax gradient is autograd's linear + fp32 cross-entropy."""
    import torch.nn.functional as F

    from lazytrain.runtime.executor import chunk_loss_and_grad

    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(37, 16, generator=gen)).to(dtype)
    w = (torch.randn(101, 16, generator=gen) * 0.3).to(dtype)
    targets = torch.randint(0, 101, (37,), generator=gen)
    logits = F.linear(x, w).requires_grad_()
    expected = F.cross_entropy(logits.float(), targets, reduction="sum") / 50
    (expected_grad,) = torch.autograd.grad(expected, [logits])
    loss, grad = chunk_loss_and_grad(x, w, targets, 50)
    assert grad.dtype == dtype and loss.dtype == torch.float32 and not grad.requires_grad
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-6, atol=1e-6)
    tol = {"rtol": 1e-5, "atol": 1e-7} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-4}
    torch.testing.assert_close(grad, expected_grad, **tol)


def test_a_kept_layers_output_does_not_outlive_its_backward(tmp_path):
    """Every layer kept on the GPU: after layer 0's backward, its output (the tensor autograd
    started that backward from) is not held into the embedding's backward stage, which the
    simulator prices without it. The backward loop's prefetch bound the kept layer's saved
    tuple to a local, which held it to the end of the step."""
    import weakref

    from lazytrain.config import load_config
    from lazytrain.plan.plan import LayerPlan, Plan
    from lazytrain.runtime.executor import Executor
    from lazytrain.train.session import build_session

    session = build_session(load_config(None, [f"training.output_dir={tmp_path}", "model.source=builtin:tiny"]))
    adapter = session.adapter
    layers = [LayerPlan(mode="keep", tier="gpu") for _ in range(adapter.num_layers)]
    executor = Executor(adapter, session.store, Plan(batch_size=2, seq_len=16, layers=layers, policy="test"),
                        session.device)
    outputs: dict[int, weakref.ref] = {}
    forward = adapter.layer_forward

    def recording_forward(layer, *args, **kwargs):
        out = forward(layer, *args, **kwargs)
        if torch.is_grad_enabled():
            outputs[layer] = weakref.ref(out)
        return out

    def holding():
        t = outputs[0]() if 0 in outputs else None
        return int(t is not None)

    adapter.layer_forward = recording_forward
    try:
        executor.stage_memory, executor.memory_probe = [], holding
        ids = torch.randint(0, adapter.vocab_size, (2, 16))
        executor.forward_backward(ids, ids.clone())
    finally:
        del adapter.layer_forward
    assert dict(executor.stage_memory)["embed bwd"] == 0, executor.stage_memory


def test_a_session_fine_tuning_a_saved_model_rounds_its_8bit_states_stochastically(tmp_path):
    """optimizer.state_rounding=auto reaches the optimizer: stochastic for loaded weights,
    nearest for a built-in shape's random init (and the profiler's scratch optimizer too)."""
    from lazytrain.config import load_config
    from lazytrain.model.loading import save_hf
    from lazytrain.train.session import build_session

    def session(source):
        return build_session(load_config(None, [f"training.output_dir={tmp_path / 'out'}", f"model.source={source}",
                                                "optimizer.kind=hybrid8bit", "training.device=cpu"]))

    scratch = session("builtin:tiny")
    assert scratch.optimizer.rounding == "nearest"
    save_hf(scratch.adapter, scratch.store, tmp_path / "model")
    loaded = session(tmp_path / "model")
    assert loaded.optimizer.rounding == "stochastic"
    assert loaded.make_optimizer([torch.zeros(256)], [256]).rounding == "stochastic"


@pytest.mark.parametrize("allocation", ["h2d", "compute"])
def test_a_fetched_activation_comes_from_the_pool_asked_for_and_its_copy_waits_for_its_last_users(
        monkeypatch, allocation):
    """The order of the stream operations of one host-tier fetch, recorded through a stand-in
    for `Streams` (on the CPU the real one does nothing): ``compute`` allocates on the compute
    stream, makes the copy stream wait for what compute has queued, and records the copy
    stream's use; ``h2d`` allocates on the copy stream, as before."""
    from lazytrain.runtime.activations import ActivationStore
    from lazytrain.runtime.streams import Streams

    log = []

    class Recording(Streams):
        def record(self, stream=None, timing=False):
            log.append(("record", stream or "compute"))
            return f"event{len(log)}"

        def wait(self, event, stream=None):
            if event is not None:
                log.append(("wait", event, stream or "compute"))

        def on(self, stream):
            log.append(("on", stream))
            return super().on(None)

        def keep_alive(self, tensor, stream):
            log.append(("keep_alive", stream))

    streams = Recording(torch.device("cpu"))
    streams.compute, streams.h2d, streams.d2h = "compute", "h2d", "d2h"
    store = ActivationStore(streams, torch.device("cpu"), fetch_allocation=allocation)
    handle = store.put(torch.arange(6.0).view(2, 3), "host")
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: log.append(("alloc",)) or real_empty(*a, **k))
    log.clear()
    assert torch.equal(store.get(handle), torch.arange(6.0).view(2, 3))
    ops = [op for op in log if op[0] != "record" or op[1] == "compute"]
    if allocation == "compute":
        assert ops[:5] == [("wait", ops[0][1], "h2d"), ("alloc",), ("record", "compute"),
                           ("wait", "event3", "h2d"), ("on", "h2d")]
    else:
        assert ops[:3] == [("wait", ops[0][1], "h2d"), ("on", "h2d"), ("alloc",)]
    assert ("keep_alive", "h2d") not in ops  # the block is not held for the copy stream's later work
    # compute reads the copy after waiting for it; a copy freed unread, or an abandoned step's
    # queued copies, are waited for by compute before its pool hands the block out again
    unread = store.put(torch.ones(4), "host")
    store.prefetch(unread)
    log.clear()
    store.free(unread)
    waits = [op for op in log if op[0] == "wait" and op[2] == "compute"]
    assert len(waits) == (1 if allocation == "compute" else 0)
    log.clear()
    store.abandon()
    assert [op[0] for op in log] == (["record", "wait"] if allocation == "compute" else [])
    with pytest.raises(ValueError, match="fetch_allocation must be one of"):
        ActivationStore(streams, torch.device("cpu"), fetch_allocation="pinned")

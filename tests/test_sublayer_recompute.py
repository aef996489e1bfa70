"""Sub-layer recompute (a kept layer recomputing its MLP or attention block in backward): the
profiler measures each option, the cost table carries it, the simulator and the MILP plan with
it, and the executor keeps what the simulator predicts. Parity with HF autograd is in
test_executor_parity.py (the random plans draw the option)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from conftest import make_hf_model, random_batch
from test_executor_parity import assert_grads_equal, reference_grads, streamed

from lazytrain.config import load_config
from lazytrain.optim.factory import make_optimizer
from lazytrain.plan.costs import CostTable, CostTableMismatch, RecomputeCosts
from lazytrain.plan.milp import milp_evaluate, min_gpu_bytes, solve_plan
from lazytrain.plan.plan import LayerPlan, Plan, keep_all_plan
from lazytrain.plan.render import format_plan_table
from lazytrain.plan.simulate import simulate
from lazytrain.plan.synthetic import random_cost_table
from lazytrain.runtime.executor import Executor
from lazytrain.runtime.profiler import profile

CPU = torch.device("cpu")
GB = 10**9


def table_with_mlp_option(num_layers: int = 8, recompute_share: float = 0.5) -> CostTable:
    """Uniform layers whose MLP holds 2/3 of the saved bytes beyond the input and costs
    ``recompute_share`` of the whole layer's recompute to re-run."""
    base = random_cost_table(3, num_layers, uniform=True, options=False, keep_forward=False)
    lc = base.layers[0]
    lc = replace(lc, saved_bytes=20 * lc.input_bytes, backward_work_bytes=lc.input_bytes,
                 forward_work_bytes=lc.input_bytes)
    mlp = RecomputeCosts(saved_bytes=lc.input_bytes + (lc.saved_bytes - lc.input_bytes) // 3,
                         recompute_ms=recompute_share * lc.recompute_ms,
                         backward_work_bytes=2 * lc.input_bytes)
    lc = replace(lc, recompute_options={"mlp": mlp})
    return replace(base, layers=[replace(lc) for _ in range(num_layers)],
                   layer_types=list(base.layer_types), host_bytes=0, nvme_bytes=0)


def test_milp_recomputes_the_mlp_when_memory_is_tight_and_it_pays():
    table = table_with_mlp_option()
    keep = simulate(keep_all_plan(table.num_layers, table.batch_size, table.seq_len), table)
    table.gpu_bytes = int(table.gpu_fixed_bytes + 0.5 * (keep.peak_gpu_bytes - table.gpu_fixed_bytes))
    plan = solve_plan(table, tiers=("gpu",), mip_rel_gap=1e-7)
    whole = solve_plan(table, tiers=("gpu",), mip_rel_gap=1e-7, recompute=())
    sim, sim_whole = simulate(plan, table), simulate(whole, table)
    assert sim.feasible and sim_whole.feasible
    assert any(lp.recompute == "mlp" for lp in plan.layers)
    assert all(lp.recompute == "none" for lp in whole.layers)
    assert sim.step_time_s < sim_whole.step_time_s
    assert plan.predicted_step_time_s == pytest.approx(sim.step_time_s, rel=1e-6)
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    text = format_plan_table(plan, sim, table)
    assert "recompute" in text and "mlp" in text


def test_milp_keeps_whole_layers_when_memory_is_ample_or_the_block_is_dear():
    # compute-bound (a re-forward hidden under a weight copy would cost nothing: a tie)
    table = replace(table_with_mlp_option(), h2d_gbps=1e4, d2h_gbps=1e4, bidir_gbps=1e4)
    roomy = solve_plan(table, tiers=("gpu",))
    assert all(lp.mode == "keep" and lp.recompute == "none" for lp in roomy.layers)
    # an MLP recompute dearer than the whole layer's is never worth it
    dear = table_with_mlp_option(recompute_share=1.5)
    keep = simulate(keep_all_plan(dear.num_layers, dear.batch_size, dear.seq_len), dear)
    dear.gpu_bytes = int(dear.gpu_fixed_bytes + 0.5 * (keep.peak_gpu_bytes - dear.gpu_fixed_bytes))
    plan = solve_plan(dear, tiers=("gpu",))
    assert all(lp.recompute == "none" for lp in plan.layers)


def test_the_option_lowers_the_least_gpu_memory():
    table = table_with_mlp_option()
    assert min_gpu_bytes(table, tiers=("gpu",)) <= min_gpu_bytes(table, tiers=("gpu",), recompute=())


def test_a_table_without_options_loads_and_plans_whole_layers(tmp_path):
    """costs.json from before sub-layer options: every option unavailable."""
    table = table_with_mlp_option()
    d = table.to_dict()
    for layer in d["layers"]:
        del layer["recompute_options"]
    (tmp_path / "costs.json").write_text(json.dumps(d))
    old = CostTable.load(tmp_path / "costs.json")
    assert all(lc.recompute_options == {} for lc in old.layers)
    keep = simulate(keep_all_plan(old.num_layers, old.batch_size, old.seq_len), old)
    old.gpu_bytes = int(old.gpu_fixed_bytes + 0.5 * (keep.peak_gpu_bytes - old.gpu_fixed_bytes))
    assert all(lp.recompute == "none" for lp in solve_plan(old, tiers=("gpu",)).layers)
    plan = keep_all_plan(old.num_layers, old.batch_size, old.seq_len)
    plan.layers[0].recompute = "mlp"
    with pytest.raises(CostTableMismatch, match="no costs for a kept layer recomputing 'mlp'"):
        simulate(plan, old)
    with pytest.raises(ValueError, match="recomputing 'mlp' is not a mode"):
        milp_evaluate(plan, old)


def test_options_round_trip_and_rescale(tmp_path):
    table = table_with_mlp_option()
    table.save(tmp_path / "costs.json")
    assert CostTable.load(tmp_path / "costs.json") == table
    twice = table.at(2 * table.batch_size, table.seq_len)
    option, scaled = table.layers[0].recompute_options["mlp"], twice.layers[0].recompute_options["mlp"]
    assert scaled.saved_bytes == pytest.approx(2 * option.saved_bytes, rel=1e-6)
    # the layer's weight gradients (at most the whole working set) keep their size
    grads = min(table.layers[0].weight_bytes, option.backward_work_bytes)
    assert scaled.backward_work_bytes == pytest.approx(grads + 2 * (option.backward_work_bytes - grads), rel=1e-6)
    with pytest.raises(ValueError, match="not among"):
        replace(table.layers[0], recompute_options={"norm": option})


@pytest.fixture(scope="module", params=["qwen2", "qwen3_5"])
def profiled(request, tmp_path_factory):
    """A 5-layer model of the family (Qwen3.5: Gated-DeltaNet and attention layers), profiled
    on the CPU in fp32."""
    folder = tmp_path_factory.mktemp(request.param) / "model"
    make_hf_model(request.param, layers=5).save_pretrained(folder)
    adapter, store = streamed(folder)
    optimizer = load_config(None, []).optimizer
    costs = profile(adapter, store, CPU, 2, 24, lambda masters, decay: make_optimizer(optimizer, masters, decay),
                    repeats=1)
    return adapter, store, costs


def test_profiler_measures_each_option(profiled):
    _, _, costs = profiled
    for lc in costs.type_costs().values():
        assert set(lc.recompute_options) == {"mlp", "attention", "mlp_up"}
        for option in lc.recompute_options.values():
            assert lc.input_bytes <= option.saved_bytes < lc.saved_bytes
            assert option.recompute_ms >= 0


def test_backward_working_set_counts_the_layer_output(profiled):
    """The output the backward starts from is live through it: the profiler's window holds it in
    its base (no allocator peaks on the CPU, so the working set is just that output)."""
    _, _, costs = profiled
    assert costs.version == 2
    for lc in costs.type_costs().values():
        assert lc.backward_work_bytes == lc.input_bytes
        assert all(rc.backward_work_bytes == lc.input_bytes for rc in lc.recompute_options.values())


def test_a_kept_forward_working_set_is_measured_on_cuda_only(profiled):
    """`_Peak` reads the CUDA allocator: on the CPU the kept forwards' working sets stay
    unmeasured (None) and the no-grad forward's stands in for every way of keeping."""
    _, _, costs = profiled
    for lc in costs.type_costs().values():
        assert lc.keep_forward_work_bytes is None
        assert all(rc.forward_work_bytes is None for rc in lc.recompute_options.values())
        assert {lc.kept(k).forward_work_bytes for k in ("none", *lc.recompute_options)} == {lc.forward_work_bytes}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_kept_forward_working_set_is_measured_on_the_gpu(tmp_path):
    """Under autograd a layer's intermediates are mostly saved tensors: beyond them, a kept
    forward allocates no more than the no-grad forward's peak (allocator rounding aside)."""
    from lazytrain.memory.host_store import HostStore
    from lazytrain.model.adapter import ModelAdapter, load_hf_config
    from lazytrain.model.loading import load_safetensors

    folder = tmp_path / "model"
    make_hf_model("qwen2", layers=2).save_pretrained(folder)
    adapter = ModelAdapter(load_hf_config(folder), torch.device("cuda"), torch.bfloat16)
    store = HostStore(adapter.layouts, torch.bfloat16, pin=True)
    load_safetensors(adapter, store, folder)
    optimizer = load_config(None, []).optimizer
    costs = profile(adapter, store, torch.device("cuda"), 4, 256,
                    lambda masters, decay: make_optimizer(optimizer, masters, decay), repeats=1)
    lc = costs.layers[0]
    for work in (lc.keep_forward_work_bytes, *(rc.forward_work_bytes for rc in lc.recompute_options.values())):
        # the output is allocated in the window and is no saved tensor: at least one hidden state
        assert work is not None and lc.input_bytes <= work <= 1.1 * lc.forward_work_bytes + 2**20, \
            (work, lc.input_bytes, lc.forward_work_bytes)


def test_executor_keeps_what_the_simulator_predicts(profiled):
    """Host-tier keep layers with each option (and a host checkpoint): the activation store's
    host peak is the simulator's, byte for byte."""
    adapter, store, costs = profiled
    L = adapter.num_layers
    options = ["mlp", "attention", "mlp_up", "none"]
    layers = [LayerPlan(mode="keep", tier="host", recompute=options[i % 4]) for i in range(L - 1)]
    layers[-1] = LayerPlan(mode="checkpoint", tier="host")
    layers.append(LayerPlan(mode="keep", tier="gpu"))
    plan = Plan(policy="x", batch_size=costs.batch_size, seq_len=costs.seq_len, layers=layers)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, adapter.vocab_size, (costs.batch_size, costs.seq_len), generator=g)
    stats = Executor(adapter, store, plan, CPU).forward_backward(ids, ids.clone(), None)
    assert stats.peak_activation_bytes["host"] == simulate(plan, costs).peak_host_bytes
    assert stats.peak_activation_bytes["host"] < simulate(
        Plan(policy="x", batch_size=costs.batch_size, seq_len=costs.seq_len,
             layers=[replace(lp, recompute="none") for lp in layers]), costs).peak_host_bytes


def test_a_forward_set_on_the_block_runs_inside_the_checkpoint_and_stays(tmp_path):
    """A replacement of the block's forward on the instance (as a memory-lean MLP would be) is
    what runs, in the forward and in the recompute, and it is still there afterwards."""
    model = make_hf_model("qwen2", layers=3)
    model.save_pretrained(tmp_path)
    adapter, store = streamed(tmp_path)
    mlp = adapter.templates["full_attention"].mlp
    calls = []

    def replacement(x):
        calls.append(torch.is_grad_enabled())
        return type(mlp).forward(mlp, x)

    mlp.forward = replacement
    ids, labels, mask = random_batch(2, 9, adapter.vocab_size, padded=True)
    _, ref = reference_grads(model, ids, labels, mask)
    plan = Plan(policy="x", batch_size=2, seq_len=9,
                layers=[LayerPlan(mode="keep", tier="host", recompute="mlp") for _ in range(3)])
    Executor(adapter, store, plan, CPU).forward_backward(ids, labels, mask)
    assert_grads_equal(adapter, store, ref)
    assert mlp.forward is replacement
    assert len(calls) == 6  # each layer's forward and its recompute


def test_a_layer_without_a_lean_mlp_offers_no_up_projection_recompute(tmp_path):
    from lazytrain.memory.host_store import HostStore
    from lazytrain.model.adapter import ModelAdapter, load_hf_config
    from lazytrain.model.loading import load_safetensors
    from lazytrain.model.sublayer import RecomputeUnavailable, options

    folder = tmp_path / "model"
    make_hf_model("qwen2", layers=2).save_pretrained(folder)
    adapter = ModelAdapter(load_hf_config(folder), CPU, torch.float32, lean_ops=False)
    assert options(adapter.templates["full_attention"]) == ("mlp", "attention")
    store = HostStore(adapter.layouts, torch.float32, pin=False)
    load_safetensors(adapter, store, folder)
    plan = keep_all_plan(2, 2, 7)
    plan.layers[1].recompute = "mlp_up"
    with pytest.raises(RecomputeUnavailable, match="recomputes 'mlp_up' in a 'full_attention' layer"):
        Executor(adapter, store, plan, CPU)  # before any step
    with pytest.raises(RecomputeUnavailable, match="whose MLP is not a memory-lean SwiGLU"):
        adapter.layer_forward(1, adapter.layouts[2].leaves(store.weights[2]), torch.randn(2, 7, adapter.hidden_size),
                              adapter.rotary_embeddings(torch.arange(7).expand(2, -1), torch.float32),
                              adapter.layer_masks(None), recompute="mlp_up")

"""The first decoder layers resident on the GPU and stepped there (`Plan.device_layers`): the
simulator's copies, CPU time, GPU step and memory; the MILP's agreement with it; how many the
planner keeps resident when it may choose; the plan file; the errors."""

import math
from dataclasses import replace

import pytest
from test_plan_simulate import assert_milp_within_its_bound

from lazytrain.plan.costs import CostTableMismatch
from lazytrain.plan.milp import PlanInfeasible, milp_evaluate, min_gpu_bytes, solve_plan
from lazytrain.plan.plan import Plan, checkpoint_all_plan, megatrain_plan
from lazytrain.plan.policies import PolicyOptions, baseline_plan, policy_plan
from lazytrain.plan.search import search_batch
from lazytrain.plan.simulate import _Stages, simulate
from lazytrain.plan.synthetic import DecoderShape, random_cost_table, synthetic_cost_table

SMALL = DecoderShape(num_layers=8, hidden=2048, intermediate=5632, num_heads=16, num_kv_heads=4, vocab=32000)


def device_table(seed: int = 3, num_layers: int = 6):
    """A random table with the GPU step's time and bytes; compute not slowed by copies."""
    return replace(random_cost_table(seed, num_layers, const_update=True), copy_slowdown=1.0)


def resident(plan: Plan, device_layers: int) -> Plan:
    out = Plan.from_dict(plan.to_dict())
    out.const_update, out.device_layers = "device", device_layers
    return out


def cpu_bound_table():
    """The CPU update of a layer (1 ns/param: ~45 ms) takes far longer than its forward (~1 ms)
    and than its GPU step (10 ps/param)."""
    table = synthetic_cost_table(SMALL, 4, 1024)
    return replace(table, optimizer_ns_per_param=1.0, const_update_ms=table.const_params * 1e-8,
                   const_update_bytes=4 * table.const_params)


def layer_copies(result) -> set[str]:
    return {label for stream, _, _, label in result.timeline if stream in ("h2d", "d2h")}


@pytest.mark.parametrize("overlap", [False, True])
def test_resident_layers_cross_no_link_take_no_cpu_time_and_lengthen_the_gpu_step(overlap):
    table = device_table()
    k = 2
    plan = resident(checkpoint_all_plan(table.num_layers, table.batch_size, table.seq_len), 0)
    none = simulate(plan, table, optimizer_overlap=overlap)
    some = simulate(resident(plan, k), table, optimizer_overlap=overlap)
    for j in range(table.num_layers):
        copies = {f"w {j}", f"w {j} bwd", f"grad {j}"}
        assert copies <= layer_copies(none)
        assert (copies <= layer_copies(some)) == (j >= k) and (copies & layer_copies(some)) == (
            copies if j >= k else set())
    params = sum(lc.params for lc in table.layers[:k])
    ns = table.optimizer_ns_per_param * 1e-9
    assert none.busy_s["cpu"] - some.busy_s["cpu"] == pytest.approx(ns * params)
    ops = {label: end - start for _, start, end, label in some.timeline}
    gpu_step_s = table.const_update_ms * (1 + params / table.const_params) * 1e-3
    assert ops["const update"] == pytest.approx(gpu_step_s)
    assert some.busy_s["compute"] - none.busy_s["compute"] == pytest.approx(
        table.const_update_ms * params / table.const_params * 1e-3)
    if overlap:
        # the CPU starts on the first streamed layer at once; the resident ones it never steps
        assert {f"optim {j}" for j in range(k)}.isdisjoint(ops)
        start = {label: s for _, s, _, label in some.timeline}
        assert start[f"optim {k}"] == 0.0


def test_resident_layers_hold_weights_and_state_all_step_and_gradients_from_their_backward():
    table = device_table()
    L, k = table.num_layers, 2
    plan = resident(checkpoint_all_plan(L, table.batch_size, table.seq_len), 0)
    none = simulate(plan, table)
    some = simulate(resident(plan, k), table)
    st = _Stages(L)
    lay = table.layers
    more = [0.0] * (st.embed_bwd + 1)
    for j in range(k):
        state = table.const_update_bytes * lay[j].params / table.const_params
        grad = lay[j].weight_bytes * table.grad_share
        for s in range(len(more)):
            more[s] += lay[j].weight_bytes + state + (grad if s >= st.bwd(j) else 0.0)
        # no longer streamed: its forward weights (double buffered), its backward weights
        for s in range(max(st.embed, st.fwd(j) - 1), st.fwd(j) + 1):
            more[s] -= lay[j].weight_bytes
        for s in range(st.bwd(j) - 1, st.bwd(j) + 1):
            more[s] -= lay[j].weight_bytes
    # the embedding stage: the held gradients (the embedding's, head's and now the resident
    # layers') before the GPU step, or the embedding's output, whichever is larger
    grads = sum(lay[j].weight_bytes for j in range(k)) * table.grad_share
    x0 = lay[0].input_bytes
    more[0] += max(x0, table.const_grad_bytes + grads) - max(x0, table.const_grad_bytes)
    diff = [s - n for s, n in zip(some.gpu_bytes_by_stage, none.gpu_bytes_by_stage)]
    assert diff == pytest.approx(more, abs=1.0)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2, 5])
def test_the_milp_models_resident_layers_as_the_simulator_does(seed, overlap):
    table = device_table(seed, 7)
    for plan in (megatrain_plan(7, table.batch_size, table.seq_len, every=3),
                 checkpoint_all_plan(7, table.batch_size, table.seq_len, "host")):
        for k in (1, 4, 7):
            fixed = resident(plan, k)
            fixed.layers[-1].tier = "gpu"  # the MILP keeps the last layer on the GPU
            sim = simulate(fixed, table, optimizer_overlap=overlap)
            step_s, peak = milp_evaluate(fixed, table, optimizer_overlap=overlap)
            assert step_s == pytest.approx(sim.step_time_s, rel=1e-6)  # no copy slows compute: exact
            assert peak == pytest.approx(sim.peak_gpu_bytes, abs=4096)


@pytest.mark.parametrize("overlap", [False, True])
def test_auto_keeps_layers_resident_when_the_cpu_update_is_the_bottleneck(overlap):
    table = cpu_bound_table()
    plan = solve_plan(table, optimizer_overlap=overlap, const_update="device", device_layers=None)
    predicted = plan.notes["device_layers"]
    assert plan.device_layers > 0
    assert predicted[str(plan.device_layers)] == plan.predicted_step_time_s < predicted["0"]
    assert plan.predicted_step_time_s == min(s for s in predicted.values() if s is not None)
    sim = simulate(plan, table)
    assert sim.feasible, sim.violations
    assert_milp_within_its_bound(plan.predicted_step_time_s, sim, plan, table, overlap)
    forced = solve_plan(table, optimizer_overlap=overlap, const_update="device", device_layers=0)
    assert forced.device_layers == 0 and set(forced.notes["device_layers"]) == {"0"}
    assert sim.step_time_s < simulate(forced, table).step_time_s
    # const_update=None: the host (no resident layers) against the device with the chosen number
    either = solve_plan(table, optimizer_overlap=overlap, device_layers=None)
    assert (either.const_update, either.device_layers) == ("device", plan.device_layers)
    assert either.notes["const_update"]["host"] > either.predicted_step_time_s


def test_with_little_memory_auto_keeps_few_or_none_resident_and_a_forced_number_that_does_not_fit_says_so():
    table = cpu_bound_table()
    least = min_gpu_bytes(table, const_update="device")
    tight = replace(table, gpu_bytes=least + table.layers[0].weight_bytes // 2)
    plan = solve_plan(tight, optimizer_overlap=True, const_update="device", device_layers=None)
    assert plan.device_layers == 0
    assert plan.notes["device_layers"] == {"0": plan.predicted_step_time_s, "1": None}
    assert simulate(plan, tight).feasible
    with pytest.raises(PlanInfeasible, match=r"keep fewer layers resident on the GPU \(device_layers=8 hold"):
        solve_plan(tight, optimizer_overlap=True, const_update="device", device_layers=8)
    # a little more room: a few, not all of them
    roomier = replace(table, gpu_bytes=least + int(3.5 * table.device_resident_bytes(1)))
    plan = solve_plan(roomier, optimizer_overlap=True, const_update="device", device_layers=None)
    assert 0 < plan.device_layers < table.num_layers
    assert simulate(plan, roomier).feasible


def test_the_plan_file_keeps_the_resident_layers(tmp_path):
    plan = solve_plan(cpu_bound_table(), optimizer_overlap=True, device_layers=None)
    assert plan.device_layers > 0
    plan.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json") == plan
    older = plan.to_dict()
    del older["device_layers"]  # a plan.json written before the field: none
    assert Plan.from_dict(older).device_layers == 0


def test_errors_say_what_to_do():
    table = device_table()
    L, b, s = table.num_layers, table.batch_size, table.seq_len
    plan = resident(checkpoint_all_plan(L, b, s), 2)
    lacking = replace(table, const_update_ms=None)
    for call in (lambda: simulate(plan, lacking), lambda: milp_evaluate(plan, lacking),
                 lambda: solve_plan(lacking, device_layers=2),
                 lambda: solve_plan(lacking, const_update="device", device_layers=None)):
        with pytest.raises(CostTableMismatch, match=r"no const_update_ms .* profile again .* const_update=host"):
            call()
    with pytest.raises(ValueError, match="device_layers=2 .* needs const_update='device' \\(or None\\), got 'host'"):
        solve_plan(table, const_update="host", device_layers=2)
    with pytest.raises(ValueError, match=f"device_layers={L + 1} is not in 0..{L}"):
        solve_plan(table, device_layers=L + 1)
    with pytest.raises(ValueError, match="needs const_update='device', got 'host'"):
        Plan(policy="x", batch_size=b, seq_len=s, layers=plan.layers, device_layers=1)
    with pytest.raises(ValueError, match="device_layers=3 .* set const_update=device \\(or auto\\), or device_layers=0"):
        PolicyOptions(device_layers=3)
    with pytest.raises(ValueError, match="device_layers must be >= 0, or None to choose; got -1"):
        PolicyOptions(const_update="device", device_layers=-1)


def test_the_batch_search_and_the_policies_pass_the_number_on():
    table = cpu_bound_table()
    found = search_batch(table, 1024, batch_sizes=[2, 4], optimizer_overlap=True, device_layers=None)
    assert found.plan.device_layers > 0
    assert all(t["device_layers"] > 0 for t in found.tried)
    forced = search_batch(table, 1024, batch_sizes=[2], optimizer_overlap=True, const_update="device",
                          device_layers=3)
    assert forced.plan.device_layers == 3
    assert policy_plan("solved", table, PolicyOptions(const_update="auto", device_layers=None)).device_layers > 0
    assert policy_plan("solved", table, PolicyOptions(const_update="device", device_layers=2)).device_layers == 2
    assert policy_plan("solved", table, PolicyOptions(const_update="device")).device_layers == 0
    L, b, s = table.num_layers, table.batch_size, table.seq_len
    assert baseline_plan("megatrain", L, b, s, PolicyOptions(const_update="device", device_layers=2)).device_layers == 2
    for options in (PolicyOptions(const_update="device", device_layers=None),
                    PolicyOptions(const_update="auto", device_layers=2)):
        assert baseline_plan("keep_all", L, b, s, options).device_layers == 0


def test_the_search_for_k_stops_where_the_neighbours_are_within_the_tolerance():
    from lazytrain.plan.milp import DEVICE_LAYER_TOLERANCE, _search_device_layers

    def search(objective, layers=40):
        calls = []
        found = _search_device_layers(layers, lambda k: calls.append(k) or objective(k))
        fits = {k: v for (_, k), v in found.items() if v is not None}
        return min(fits, key=fits.__getitem__), calls

    # a sharp minimum at 5: bisected down to it
    best, calls = search(lambda k: 100.0 + abs(k - 5.4) * 10)
    assert best == 5 and calls == [0, 1, 2, 4, 8, 12, 3, 6, 5, 7]
    # a flat bottom (the 7B table's shape): 2 and 8 are within the tolerance of 4, nothing between
    flat = {0: 101.8, 1: 100.8, 2: 100.0 * (1 + DEVICE_LAYER_TOLERANCE / 3), 4: 100.0, 8: 100.0 * (1 + DEVICE_LAYER_TOLERANCE / 2), 12: 102.0}
    best, calls = search(lambda k: flat.get(k, 100.0))
    assert best == 4 and calls == [0, 1, 2, 4, 8, 12]
    # the 12-05 7B table's curve at 0.2715 ns/param (predicted s by k; its exhaustive search in
    # bench/results/device_layers_search_cpu-amd-epyc_2026-12-05.json): 8 is 0.35% behind 4, and
    # the minimum lies between them, where the CPU update stops pacing the forward
    h200 = {0: 5.486, 1: 5.425, 2: 5.399, 3: 5.366, 4: 5.331, 5: 5.312, 6: 5.317, 7: 5.338, 8: 5.350,
            12: 5.397}
    best, calls = search(lambda k: h200[k], layers=28)
    assert best == 5 and 6 in calls
    # a neighbour that does not fit is bisected toward whatever its distance
    best, calls = search(lambda k: None if k > 9 else 100.0 - k * 0.01)
    assert best == 9 and calls[:6] == [0, 1, 2, 4, 8, 12] and 10 in calls and 9 in calls
    # a solve that ran out of time (inf: one may exist) neither stops the search nor counts as
    # slower: it went on past 1 and 2 to the sharp minimum at 5 (it stopped at 1 until 2026-12-07)
    best, calls = search(lambda k: math.inf if k in (1, 2) else 100.0 + abs(k - 5.4) * 10)
    assert best == 5 and calls[:6] == [0, 1, 2, 4, 8, 12]


@pytest.mark.parametrize("workers", [2, 3, 8])
def test_the_search_for_k_with_solves_at_once_keeps_what_one_at_a_time_keeps(workers):
    """``workers`` solves at once (`_search_device_layers`): the same k kept with the same
    values as one after another, on the shapes above and random ones; the objective is called
    from that many threads at once (a barrier only they pass)."""
    import random
    import threading

    from lazytrain.plan.milp import _search_device_layers

    shapes = [lambda k: 100.0 + abs(k - 5.4) * 10, lambda k: None if k > 9 else 100.0 - k * 0.01,
              lambda k: 100.0 - k * 0.5, lambda k: None if k > 0 else 100.0]
    rng = random.Random(0)
    for _ in range(30):
        table = {k: (None if rng.random() < 0.05 else rng.uniform(90, 110)) for k in range(41)}
        shapes.append(table.get)
    for objective in shapes:
        for layers in (1, 5, 28, 40):
            assert _search_device_layers(layers, objective, workers) == _search_device_layers(layers, objective)
    together = threading.Barrier(2, timeout=10)

    def meets(k):
        if k in (0, 1):  # the first two candidates: solved at once or the barrier breaks
            together.wait()
        return 100.0 - k

    assert _search_device_layers(4, meets, workers)[("device", 4)] == 96.0
    assert not together.broken


def test_solve_plan_searches_k_with_solves_at_once(monkeypatch):
    """`solve_plan` with ``device_layers=None`` runs `search_workers` solves at once and gives
    the plan, notes and prediction of one solve at a time (solves that end at their optimum)."""
    from lazytrain.plan import milp

    for costs in (cpu_bound_table(), device_table(5, 12)):
        plans = []
        for workers in (1, 3):
            monkeypatch.setattr(milp, "search_workers", lambda w=workers: w)
            plans.append(solve_plan(costs, tiers=("gpu", "host"), optimizer_overlap=True, const_update="device",
                                    device_layers=None, device_steps=0, time_limit_s=60))
        one, many = plans
        assert one.layers == many.layers and one.device_layers == many.device_layers
        assert one.notes["device_layers"] == many.notes["device_layers"] and len(one.notes["device_layers"]) > 2
        assert one.notes["device_steps"].keys() == one.notes["device_layers"].keys() == many.notes["device_steps"].keys()
        assert one.predicted_step_time_s == many.predicted_step_time_s
    monkeypatch.undo()
    assert 1 <= milp.search_workers() <= milp.SEARCH_WORKERS


def test_recalibrate_re_solves_on_the_measured_update_rate():
    from lazytrain.plan.policies import RECALIBRATE_TOLERANCE, recalibrate

    options = PolicyOptions(const_update="auto", device_layers=None)
    table = cpu_bound_table()
    # room for a few resident layers, which then push activations off the card
    roomy = replace(table, gpu_bytes=min_gpu_bytes(table, const_update="device")
                    + int(3.5 * table.device_resident_bytes(1)))
    fast = replace(roomy, optimizer_ns_per_param=0.001)  # the profile: the update almost free
    plan = policy_plan("solved", fast, options)
    assert plan.device_layers == 0
    # the run measured 1 ns/param: the CPU update paces the forward, resident layers win
    found = recalibrate(plan, fast, 1.0, options)
    assert found.changed and found.plan.device_layers > 0
    assert found.costs == replace(fast, optimizer_ns_per_param=1.0)
    assert found.resolved_s < found.current_s == simulate(plan, found.costs, optimizer_overlap=True).step_time_s
    # within the tolerance, or not a solved plan: nothing to do
    assert recalibrate(plan, fast, 0.001 * (1 + RECALIBRATE_TOLERANCE / 2), options) is None
    megatrain = policy_plan("megatrain", fast, options)
    assert recalibrate(megatrain, fast, 1.0, options) is None
    # a rate the plan already suits: the table is corrected, the plan kept
    plan = found.plan
    kept = recalibrate(plan, found.costs, 1.2, options)
    assert not kept.changed and kept.plan is plan and kept.costs.optimizer_ns_per_param == 1.2
    assert kept.resolved_s >= kept.current_s * 0.99
    with pytest.raises(ValueError, match="must be > 0"):
        recalibrate(plan, fast, 0.0, options)


def test_a_re_solve_that_finds_nothing_keeps_the_running_plan(monkeypatch):
    from lazytrain.plan import milp
    from lazytrain.plan.policies import recalibrate

    table = cpu_bound_table()
    plan = policy_plan("solved", table)

    def nothing(*args, **kwargs):
        raise PlanInfeasible("no solution within the time limit")

    monkeypatch.setattr(milp, "solve_plan", nothing)
    found = recalibrate(plan, table, 2.0)
    assert not found.changed and found.plan is plan and found.resolved_s == float("inf")
    assert found.costs.optimizer_ns_per_param == 2.0

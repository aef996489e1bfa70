"""The embedding and head stepped on the GPU (`Plan.const_update="device"`): the simulator's
timeline, CPU time and memory; the MILP's agreement with the simulator; where the planner
steps them when it may choose; and the errors when a table cannot say what that costs."""

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lazytrain.plan.costs import CostTableMismatch
from lazytrain.plan.milp import PlanInfeasible, milp_evaluate, min_gpu_bytes, solve_plan
from lazytrain.plan.plan import Plan, checkpoint_all_plan, keep_all_plan
from lazytrain.plan.policies import PolicyOptions, baseline_plan, policy_plan
from lazytrain.plan.search import search_batch
from lazytrain.plan.simulate import simulate
from lazytrain.plan.synthetic import DecoderShape, random_cost_table, synthetic_cost_table

LARGE_VOCAB = DecoderShape(num_layers=4, hidden=2048, intermediate=5632, num_heads=16, num_kv_heads=4,
                           vocab=152064)
"""Few layers, a large vocabulary: the embedding and head are most of the parameters."""


def device_table(seed: int = 3, num_layers: int = 6):
    """A random table with the GPU step's time and bytes; compute not slowed by copies, so
    every compute op takes exactly its time."""
    return replace(random_cost_table(seed, num_layers, const_update=True), copy_slowdown=1.0)


def stepped(plan: Plan, const_update: str) -> Plan:
    out = Plan.from_dict(plan.to_dict())
    out.const_update = const_update
    return out


def cpu_bound_table():
    """The CPU update of the embedding and head (2 ns/param) is what the step waits for; their
    GPU step takes 20 ms and 4 bytes per parameter."""
    table = synthetic_cost_table(LARGE_VOCAB, 4, 1024)
    return replace(table, optimizer_ns_per_param=2.0, const_update_ms=20.0,
                   const_update_bytes=4 * table.const_params)


def const_copies(result) -> set[str]:
    return {label for stream, _, _, label in result.timeline
            if stream in ("h2d", "d2h") and ("embed" in label or "head" in label)}


@pytest.mark.parametrize("overlap", [False, True])
def test_stepped_on_the_gpu_the_constants_cross_no_link_take_no_cpu_time_and_hold_their_state(overlap):
    table = device_table()
    plan = checkpoint_all_plan(6, table.batch_size, table.seq_len)
    host = simulate(plan, table, optimizer_overlap=overlap)
    device = simulate(stepped(plan, "device"), table, optimizer_overlap=overlap)
    assert const_copies(host) and not const_copies(device)
    ns = table.optimizer_ns_per_param * 1e-9
    assert host.busy_s["cpu"] - device.busy_s["cpu"] == pytest.approx(ns * table.const_params)
    assert device.busy_s["compute"] - host.busy_s["compute"] == pytest.approx(table.const_update_ms * 1e-3)
    assert device.metrics()["predicted_gpu_compute_s"] == pytest.approx(device.busy_s["compute"])
    # GPU memory: their master remainders and states in every stage; in the embedding's, before
    # its output exists, their gradients too (held since the head, until the GPU step)
    more = [d - h for d, h in zip(device.gpu_bytes_by_stage, host.gpu_bytes_by_stage)]
    embed_output = table.layers[0].input_bytes
    assert more[0] == table.const_update_bytes + max(table.const_grad_bytes - embed_output, 0)
    assert more[1:] == [table.const_update_bytes] * (len(more) - 1)


def test_overlapped_the_gpu_step_runs_ahead_of_the_embedding_while_the_cpu_steps_the_layers():
    table = device_table()
    L = table.num_layers
    result = simulate(stepped(checkpoint_all_plan(L, table.batch_size, table.seq_len), "device"), table,
                      optimizer_overlap=True)
    ops = {label: (start, end) for _, start, end, label in result.timeline}
    stage = dict(zip(result.stage_names, result.stage_start_s))
    assert ops["const update"] == pytest.approx((0.0, table.const_update_ms * 1e-3))
    assert stage["embed"] == pytest.approx(ops["const update"][1])
    assert ops["optim 0"][0] == 0.0  # the CPU starts on the layers at once
    assert ops["w 0"][0] >= ops["optim 0"][1]
    assert not {"optim embed", "optim head", "optim embed/head"} & set(ops)


def test_without_overlap_the_gpu_step_follows_the_cpu_step_of_the_layers():
    table = device_table()
    L = table.num_layers
    result = simulate(stepped(checkpoint_all_plan(L, table.batch_size, table.seq_len), "device"), table,
                      optimizer_overlap=False)
    ops = {label: (start, end) for _, start, end, label in result.timeline}
    layer_params = sum(lc.params for lc in table.layers)
    assert ops["optimizer"][1] - ops["optimizer"][0] == pytest.approx(
        table.optimizer_ns_per_param * 1e-9 * layer_params)
    assert ops["const update"][0] == pytest.approx(ops["optimizer"][1])
    assert result.step_time_s == pytest.approx(ops["const update"][1])


def constrained(table, squeeze: float):
    """``table`` with GPU memory between what the least plan needs (host update) and what keeping
    everything with the device update needs (squeeze 0 .. 1), or beyond."""
    least = min_gpu_bytes(table)
    keep = simulate(stepped(keep_all_plan(table.num_layers, table.batch_size, table.seq_len), "device"), table)
    return replace(table, gpu_bytes=int(least + squeeze * max(keep.peak_gpu_bytes - least, 0)) + 1)


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), num_layers=st.integers(1, 8), squeeze=st.floats(0.0, 1.2))
def test_the_planner_keeps_the_faster_update_and_predicts_what_the_simulator_does(seed, num_layers, squeeze):
    table = constrained(random_cost_table(seed, num_layers, const_update=True), squeeze)
    plan = solve_plan(table, mip_rel_gap=1e-7)
    sim = simulate(plan, table)
    assert sim.feasible, sim.violations
    assert plan.predicted_step_time_s == pytest.approx(sim.step_time_s, rel=1e-6)
    predicted = plan.notes["const_update"]
    assert set(predicted) == {"host", "device"}
    assert predicted[plan.const_update] == plan.predicted_step_time_s
    assert plan.predicted_step_time_s == min(s for s in predicted.values() if s is not None)
    for where, step_s in predicted.items():
        if step_s is None:
            with pytest.raises(PlanInfeasible):
                solve_plan(table, const_update=where)
            continue
        forced = solve_plan(table, const_update=where, mip_rel_gap=1e-7)
        assert forced.const_update == where and set(forced.notes["const_update"]) == {where}
        assert simulate(forced, table).step_time_s == pytest.approx(step_s, rel=1e-6)
        assert milp_evaluate(forced, table)[0] == pytest.approx(step_s, rel=1e-6)


@pytest.mark.parametrize("overlap", [False, True])
def test_auto_steps_them_on_the_gpu_when_the_cpu_update_is_the_bottleneck(overlap):
    table = cpu_bound_table()
    plan = solve_plan(table, optimizer_overlap=overlap)
    assert plan.const_update == "device"
    assert plan.notes["const_update"]["device"] < plan.notes["const_update"]["host"]
    assert simulate(plan, table).step_time_s < simulate(stepped(plan, "host"), table).step_time_s


def test_auto_keeps_them_on_the_host_when_their_state_does_not_fit_or_their_gpu_step_is_slow():
    table = cpu_bound_table()
    host_least = min_gpu_bytes(table, const_update="host")
    assert min_gpu_bytes(table) == host_least  # the GPU step only adds memory
    assert min_gpu_bytes(table, const_update="device") >= host_least + table.const_update_bytes
    tight = replace(table, gpu_bytes=host_least + table.const_update_bytes // 2)
    plan = solve_plan(tight, optimizer_overlap=True)
    assert plan.const_update == "host" and plan.notes["const_update"]["device"] is None
    with pytest.raises(PlanInfeasible, match="const_update=host"):
        solve_plan(tight, optimizer_overlap=True, const_update="device")
    slow = replace(table, const_update_ms=1e5)
    plan = solve_plan(slow, optimizer_overlap=True)
    assert plan.const_update == "host"
    assert plan.notes["const_update"]["host"] < plan.notes["const_update"]["device"]


def test_a_table_without_the_gpu_steps_time_plans_the_host_and_refuses_the_device():
    table = replace(device_table(), const_update_ms=None)
    plan = solve_plan(table)
    assert plan.const_update == "host" and set(plan.notes["const_update"]) == {"host"}
    device = stepped(checkpoint_all_plan(table.num_layers, table.batch_size, table.seq_len), "device")
    for call in (lambda: simulate(device, table), lambda: milp_evaluate(device, table),
                 lambda: solve_plan(table, const_update="device"),
                 lambda: min_gpu_bytes(table, const_update="device")):
        with pytest.raises(CostTableMismatch, match=r"no const_update_ms .* profile again .* const_update=host"):
            call()
    with pytest.raises(ValueError, match="const_update 'gpu' is not one of"):
        solve_plan(table, const_update="gpu")


def test_a_ranks_table_has_no_gpu_step():
    """The executor steps the embedding and head on the GPU in one process only."""
    table = device_table()
    assert table.for_ranks(1, 1).const_update_ms == table.const_update_ms
    assert table.for_ranks(2, 2).const_update_ms is None


def test_the_plan_file_keeps_where_they_are_stepped(tmp_path):
    plan = solve_plan(cpu_bound_table(), optimizer_overlap=True)
    assert plan.const_update == "device"
    assert Plan.from_dict(plan.to_dict()) == plan
    plan.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json").const_update == "device"
    older = plan.to_dict()
    del older["const_update"]  # a plan.json written before the field: the host
    assert Plan.from_dict(older).const_update == "host"
    with pytest.raises(ValueError, match="const_update 'gpu' is not one of"):
        Plan.from_dict({**older, "const_update": "gpu"})


def test_the_batch_search_and_the_policies_pass_the_choice_on():
    table = cpu_bound_table()
    found = search_batch(table, 1024, batch_sizes=[2, 4], optimizer_overlap=True, const_update="device")
    assert found.plan.const_update == "device"
    assert {t["const_update"] for t in found.tried} == {"device"}
    assert search_batch(table, 1024, batch_sizes=[2, 4], optimizer_overlap=True).plan.const_update == "device"
    fitted = search_batch(table, 1024, goal="max_batch", batch_sizes=[1, 2, 4], const_update="host")
    assert fitted.plan.const_update == "host"
    # the policies keep the host unless told otherwise (auto: the solved plan chooses)
    assert policy_plan("solved", table).const_update == "host"
    assert policy_plan("solved", table, PolicyOptions(const_update="auto")).const_update == "device"
    assert policy_plan("solved", table, PolicyOptions(const_update="device")).const_update == "device"
    L, b, s = table.num_layers, table.batch_size, table.seq_len
    assert baseline_plan("megatrain", L, b, s, PolicyOptions(const_update="auto")).const_update == "host"
    assert baseline_plan("keep_all", L, b, s, PolicyOptions(const_update="device")).const_update == "device"
    with pytest.raises(ValueError, match="const_update 'gpu' is not one of auto, host, device"):
        PolicyOptions(const_update="gpu")


def test_a_table_measured_in_other_pieces_scales_the_gpu_steps_temporaries(tmp_path, caplog):
    """`CostTable.for_device_step_chunk`: the temporaries (one piece's) scale with a layer's
    piece when the run's optimizer steps in other pieces than the table measured (tables
    without ``device_step_chunk``: 2^23), the time is kept; nothing changes where the pieces
    match, nothing was measured, or the optimizer has no device step. A session on such a
    saved table (``plan.costs``) plans with the scaled bytes and says so."""
    import logging

    from lazytrain.config import load_config
    from lazytrain.optim.hybrid8bit import COMPILED_CHUNK
    from lazytrain.plan.costs import OLD_DEVICE_STEP_CHUNK, CostTable
    from lazytrain.train.session import build_session

    layer = 3 * OLD_DEVICE_STEP_CHUNK + 5
    table = device_table()
    table = replace(table, device_step_work_bytes=1000, layers=[replace(lc, params=layer) for lc in table.layers])
    scaled = table.for_device_step_chunk(4 * OLD_DEVICE_STEP_CHUNK)
    assert scaled.device_step_work_bytes == round(1000 * layer / OLD_DEVICE_STEP_CHUNK)
    assert scaled.device_step_chunk == 4 * OLD_DEVICE_STEP_CHUNK and scaled.const_update_ms == table.const_update_ms
    assert table.device_step_work_bytes == 1000 and table.device_step_chunk is None  # a copy
    assert scaled.for_device_step_chunk(4 * OLD_DEVICE_STEP_CHUNK) is scaled
    assert scaled.for_device_step_chunk(2 * OLD_DEVICE_STEP_CHUNK).device_step_work_bytes == 2000
    assert CostTable.from_dict(scaled.to_dict()) == scaled
    for same in (table.for_device_step_chunk(OLD_DEVICE_STEP_CHUNK), table.for_device_step_chunk(None),
                 replace(table, device_step_work_bytes=0).for_device_step_chunk(1 << 26)):
        assert same.device_step_work_bytes in (1000, 0) and same.device_step_chunk is None

    overrides = [f"training.output_dir={tmp_path / 'run'}", "training.batch_size=2", "data.max_seq_len=32",
                 "optimizer.kind=hybrid8bit"]
    session = build_session(load_config(None, overrides))
    profiled = session.cost_table()
    assert profiled.device_step_chunk == COMPILED_CHUNK and profiled.device_step_work_bytes == 0  # on the CPU
    old = replace(profiled, device_step_work_bytes=4096, device_step_chunk=None)
    old.save(tmp_path / "costs.json")
    later = build_session(load_config(None, [*overrides, f"plan.costs={tmp_path / 'costs.json'}"]))
    with caplog.at_level(logging.WARNING, logger="lazytrain.train.session"):
        costs = later.cost_table()
    piece = max(lc.params for lc in old.layers)  # the tiny model's layer: one piece either way
    assert costs.device_step_work_bytes == round(4096 * min(COMPILED_CHUNK, piece) / min(OLD_DEVICE_STEP_CHUNK, piece))
    assert costs.device_step_chunk == COMPILED_CHUNK
    assert "pieces of 8388608 elements, this version steps 67108864" in caplog.text

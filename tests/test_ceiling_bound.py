"""bench/studies/ceiling_bound.py: each scenario frees one resource of a cost table and re-solves; a
freed resource never makes the predicted step longer, and with everything free but the card's
memory only recompute separates the step from compute-only."""

import dataclasses
import json

import pytest

from bench.studies.ceiling_bound import (
    FAST,
    LARGE,
    compute_only_s,
    row,
    scenarios,
    with_recompute_ms,
)
from lazytrain.plan.milp import min_gpu_bytes
from lazytrain.plan.plan import Plan, keep_all_plan
from lazytrain.plan.simulate import simulate
from lazytrain.plan.synthetic import random_cost_table


def squeezed_table(seed: int, layers: int = 5):
    """A random table whose card holds about half of what keeping every layer needs: some
    recompute is forced."""
    table = random_cost_table(seed, layers, options=False)
    least = min_gpu_bytes(table)
    keep = simulate(keep_all_plan(layers, table.batch_size, table.seq_len), table)
    table.gpu_bytes = int(least + 0.3 * (keep.peak_gpu_bytes - least))
    table.optimizer_ns_per_param = 0.5  # an update slow enough to show on the critical path
    return table


@pytest.mark.parametrize("seed", [1, 2])
def test_each_freed_resource_shortens_or_keeps_the_step(seed, tmp_path):
    table = squeezed_table(seed)
    floor = compute_only_s(table)
    rows = {name: row(name, t, "t.json", 10.0, const_update=where) for name, t, where in scenarios(table, [2.0], [1.0])}
    # the GPU-update row takes card memory away: on a squeezed card it may leave no plan
    on_gpu = rows.pop("embedding + head updated on the GPU")
    assert on_gpu["status"] == "ok" or on_gpu["status"].startswith("no plan")
    assert all(r["status"] == "ok" for r in rows.values())
    step = {name: r["predicted_step_time_s"] for name, r in rows.items()}
    tol = 1 + 1e-3  # the MILP's relative gap
    assert step["free CPU update"] <= step["CPU update x 2"] * tol <= step["as profiled"] * tol**2
    assert step["free CPU update and transfers"] <= min(step["free CPU update"], step["free transfers"]) * tol
    assert rows["free CPU update"]["predicted_gpu_idle_other_s"] == pytest.approx(0.0, abs=1e-9)
    # the card squeezed: recompute is forced; with no memory limit nothing is recomputed
    assert rows["as profiled"]["recompute_s"] > 0.01 * floor
    assert step["no memory limit"] <= step["as profiled"] * tol
    # all free: the simulator's GPU compute is compute-only, nothing recomputed or exposed
    free = dataclasses.replace(table, optimizer_ns_per_param=0.0, gpu_bytes=LARGE, host_bytes=LARGE,
                               **{k: getattr(table, k) * FAST for k in ("h2d_gbps", "d2h_gbps", "bidir_gbps")})
    everything = row("all free", free, "t.json", 10.0)
    # (compute runs copy_slowdown times slower while a copy is in flight: the 1000x faster
    # links still leave a trace)
    assert everything["recompute_s"] == pytest.approx(0.0, abs=1e-3 * floor)
    assert everything["modes"] == {"keep gpu": 5}
    assert everything["step_over_compute_only"] == pytest.approx(1.0, rel=2e-3)
    # every scenario's step is at least compute-only
    assert all(s >= floor * (1 - 1e-9) for s in step.values())
    json.dumps(list(rows.values()))  # a record file can hold them


def test_the_gpu_update_scenario_takes_the_constants_off_the_cpu_and_their_states_off_the_card():
    """A table without the device step's time: the scenario is estimated by editing the table."""
    table = squeezed_table(3)
    named = {name: t for name, t, _ in scenarios(table, [], [], [1.5], device_update_bytes=4.0)}
    assert {where for *_, where in scenarios(table, [], [], [1.5])} == {"host"}
    on_gpu = named["embedding + head updated on the GPU"]
    assert on_gpu.const_params == 0 and table.const_params > 0 and not on_gpu.head_params
    assert on_gpu.gpu_bytes == table.gpu_bytes - 4 * table.const_params
    assert on_gpu.optimizer_ns_per_param == table.optimizer_ns_per_param
    slow = named["embedding + head updated on the GPU, CPU update 1.5 x slower"]
    assert slow.optimizer_ns_per_param == pytest.approx(1.5 * table.optimizer_ns_per_param)
    assert named["CPU update 1.5 x slower"].const_params == table.const_params
    rows = {name: row(name, t, "t.json", 10.0) for name, t in named.items()}
    step = {name: r["predicted_step_time_s"] for name, r in rows.items() if r["status"] == "ok"}
    tol = 1 + 1e-3
    assert step["as profiled"] <= step["CPU update 1.5 x slower"] * tol
    # the as-profiled plan, not re-solved, under a scenario's costs
    profiled = Plan.from_dict(rows["as profiled"]["plan"])
    slower = named["CPU update 1.5 x slower"]
    again = row("CPU update 1.5 x slower", slower, "t.json", 10.0, profiled)
    assert again["profiled_plan_step_s"] == pytest.approx(simulate(profiled, slower, optimizer_overlap=True).step_time_s)
    assert again["profiled_plan_step_s"] > step["as profiled"] * tol  # the same plan, a slower update


def test_a_table_with_the_device_steps_time_plans_the_gpu_scenario_with_const_update_device():
    table = dataclasses.replace(squeezed_table(3), const_update_ms=2.0, const_update_bytes=10**6)
    named = scenarios(table, [], [], [1.5])
    where = {name: w for name, _, w in named}
    assert where["embedding + head updated on the GPU"] == "device"
    assert where["embedding + head updated on the GPU, CPU update 1.5 x slower"] == "device"
    assert {w for name, w in where.items() if "on the GPU" not in name} == {"host"}
    tables = {name: t for name, t, _ in named}
    assert tables["embedding + head updated on the GPU"] == table  # the real option: the table as profiled
    on_gpu = row("embedding + head updated on the GPU", table, "t.json", 10.0, const_update="device")
    profiled = row("as profiled", table, "t.json", 10.0)
    assert on_gpu["const_update"] == "device" and Plan.from_dict(on_gpu["plan"]).const_update == "device"
    assert profiled["const_update"] == "host" and Plan.from_dict(profiled["plan"]).const_update == "host"
    # the update is on the critical path here (0.5 ns/param): off the CPU, the step is shorter
    assert on_gpu["predicted_step_time_s"] < profiled["predicted_step_time_s"]


def test_the_resident_layers_row_lets_the_planner_choose_how_many():
    table = dataclasses.replace(random_cost_table(4, 5, options=False, const_update=True), optimizer_ns_per_param=0.5)
    device = row("embedding + head updated on the GPU", table, "t.json", 10.0, const_update="device")
    resident = row("resident", table, "t.json", 10.0, const_update="device", device_layers=None)
    assert device["device_layers"] == 0 and set(device["device_layers_tried"]) == {"0"}
    assert resident["device_layers_tried"]["0"] == pytest.approx(device["predicted_step_time_s"], rel=1e-3)
    assert resident["predicted_step_time_s"] <= device["predicted_step_time_s"] * (1 + 1e-3)
    assert str(resident["device_layers"]) in resident["device_layers_tried"]


def test_a_cheaper_recompute_shortens_or_keeps_the_step_and_is_used_when_it_pays():
    """``--recompute-ms``: the option retimed in every layer, its bytes as they were; made nearly
    free on a squeezed card, the planner takes it and the step gets no longer."""
    table = random_cost_table(6, 5, uniform=True)  # every layer may recompute its attention or MLP
    least = min_gpu_bytes(table)
    keep = simulate(keep_all_plan(5, table.batch_size, table.seq_len), table)
    table.gpu_bytes = int(least + 0.3 * (keep.peak_gpu_bytes - least))
    option = "mlp"
    cheap = with_recompute_ms(table, option, 1e-3)
    assert all(layer.recompute_options[option].recompute_ms == 1e-3 for layer in cheap.layers)
    assert [layer.recompute_options[option].saved_bytes for layer in cheap.layers] == \
        [layer.recompute_options[option].saved_bytes for layer in table.layers]
    assert table.layers[0].recompute_options[option].recompute_ms != 1e-3  # the table itself unchanged
    before, after = row("a", table, "t.json", 10.0), row("b", cheap, "t.json", 10.0)
    assert after["predicted_step_time_s"] <= before["predicted_step_time_s"] * (1 + 1e-3)
    assert any(f"(recompute {option})" in mode for mode in after["modes"])

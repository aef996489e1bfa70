"""The simulator's GPU memory per stage against the H200's: recorded plan runs (committed JSON,
``bench/studies/stage_memory_check.py``) and each term the executor holds, on tables alone."""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from bench.studies.stage_memory_check import check_file
from lazytrain.plan.costs import CostTable
from lazytrain.plan.plan import LayerPlan, Plan, checkpoint_all_plan
from lazytrain.plan.simulate import simulate
from lazytrain.plan.synthetic import random_cost_table

RESULTS = Path(__file__).parent.parent / "bench" / "results"
MAX = RESULTS / "plan_qwen3.5-9b_h200_2026-12-02_s1024_max.json"
FIRST_TRIES = ("qwen3.5-9b_megatrain_b206_s1024_torch_max", "qwen3.5-9b_megatrain_b323_s1024_max",
               "qwen3.5-9b_solved_b206_s1024_torch_max", "qwen3.5-9b_solved_b386_s1024_max")
"""Runs that did not follow an out-of-memory try (a retry starts with ~5.1 GB of the failed
try's memory still allocated, about 1.2 GB more than the predictions below allow)."""


def within(row: dict) -> bool:
    error = abs(row["measured_gb"] - row["predicted_gb"])
    return error <= 2.0 or error <= 0.02 * row["measured_gb"]


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return [r for r in check_file(MAX) if r["record"] in FIRST_TRIES]


@pytest.mark.parametrize("kind", ["fwd checkpoint", "bwd checkpoint", "embed bwd"])
def test_recorded_stages_are_predicted(rows, kind):
    """Checkpointed and dropped layers: within 2 GB or 2% on the H200 (the solved plans' forward
    stages were 3.4-6.7 GB over before: resident gradients and offloaded inputs counted where the
    executor holds none). The embedding's stage is not checked: its peak window spans the step
    boundary (the previous step's end)."""
    picked = [r for r in rows if r["kind"] == kind]
    assert picked
    bad = [(r["record"], r["stage"], r["measured_gb"], r["predicted_gb"]) for r in picked if not within(r)]
    assert not bad


def test_head_of_the_torch_runs_is_predicted(rows):
    picked = [r for r in rows if r["kind"] == "head" and r["record"].endswith("torch_max")]
    assert len(picked) == 2 and all(within(r) for r in picked), picked


@pytest.mark.xfail(strict=True, reason="recorded before the fix: a kept layer's backward (torch b206 bwd 31: +8.6 GB) "
                   "ran with the executor holding its saved tensors to the end of its backward (now freed at their "
                   "last read); the head after fla layers (+8.1 GB at b323, +12.7 at b386; with the 12-01 tables' "
                   "older head, 8.14 GB larger, counted: 49-53 KB per token in every 9B record since, torch 39) is "
                   "unexplained")
def test_kept_layers_and_the_fla_head_are_predicted(rows):
    picked = [r for r in rows if r["kind"] in ("bwd keep", "head")]
    assert all(within(r) for r in picked)


def test_every_recorded_plan_is_simulated():
    records = [r for r in json.loads(MAX.read_text()) if r.get("stage_memory_gb")]
    assert {r["record"] for r in check_file(MAX)} == {r["name"] for r in records if "plan" in r}


def test_a_version_1_table_gets_the_layer_output_in_its_backward_working_set():
    table = random_cost_table(3, 4)
    d = table.to_dict()
    del d["version"]
    old = CostTable.from_dict(d)
    assert old.version == 2
    for lc, before in zip(old.layers, table.layers):
        assert lc.backward_work_bytes == before.backward_work_bytes + before.input_bytes
        for k, rc in lc.recompute_options.items():
            assert rc.backward_work_bytes == before.recompute_options[k].backward_work_bytes + before.input_bytes
    assert CostTable.from_dict(old.to_dict()) == old  # upgraded once


def test_weight_gradients_keep_their_size_when_the_batch_grows():
    table = random_cost_table(5, 2)
    lc = replace(table.layers[0], backward_work_bytes=3 * table.layers[0].weight_bytes)
    table = replace(table, layers=[lc, replace(table.layers[1])])
    twice = table.at(2 * table.batch_size, table.seq_len)
    assert twice.layers[0].backward_work_bytes == pytest.approx(lc.weight_bytes + 2 * 2 * lc.weight_bytes, rel=1e-9)


def test_resident_gradients_count_after_the_head():
    """The head's working set holds its gradient (the profiler allocates it there); from the
    backward on both resident gradients are counted."""
    table = random_cost_table(7, 3)
    table = replace(table, gpu_fixed_bytes=table.const_grad_bytes + 10**9)
    plan = checkpoint_all_plan(3, table.batch_size, table.seq_len)
    sim = simulate(plan, table)
    without = simulate(plan, replace(table, const_grad_bytes=0, gpu_fixed_bytes=10**9))
    names = sim.stage_names
    for name, got, base in zip(names, sim.gpu_bytes_by_stage, without.gpu_bytes_by_stage):
        up_to_head = name in ("embed", "head") or name.startswith("fwd")
        assert got - base == (0 if up_to_head else table.const_grad_bytes), name


def test_an_offloaded_input_is_freed_in_its_own_stage():
    table = replace(random_cost_table(11, 3), host_bytes=2**40)
    on_gpu = checkpoint_all_plan(3, table.batch_size, table.seq_len)
    host = Plan(policy="t", batch_size=table.batch_size, seq_len=table.seq_len,
                layers=[LayerPlan(mode="checkpoint", tier="host")] + [LayerPlan(mode="checkpoint")] * 2)
    a, b = (dict(zip(s.stage_names, s.gpu_bytes_by_stage)) for s in (simulate(on_gpu, table), simulate(host, table)))
    assert a["fwd 0"] == b["fwd 0"]  # the input is on the GPU while layer 0 runs
    assert a["fwd 1"] - b["fwd 1"] == table.layers[0].input_bytes  # then only the GPU tier holds it


def test_the_embedding_stage_holds_its_output():
    table = random_cost_table(13, 2)
    sim = simulate(checkpoint_all_plan(2, table.batch_size, table.seq_len), table)
    assert sim.gpu_bytes_by_stage[0] >= table.forward_fixed_bytes + table.layers[0].input_bytes


def test_a_kept_forward_counts_its_own_measured_working_set():
    """A kept layer's forward runs under autograd: what it allocates beyond its saved tensors
    (`LayerCosts.keep_forward_work_bytes`) is its stage's transient, not the no-grad forward's
    peak (which holds intermediates a kept forward counts as saved: the H200's 9B kept forwards
    measured 35-44 KB/token below the prediction on average). The simulator counts it per stage, and the
    MILP finds the keep-everything plan that fits only with it."""
    from lazytrain.plan.milp import solve_plan
    from lazytrain.plan.plan import keep_all_plan

    base = random_cost_table(17, 3, uniform=True, options=False, keep_forward=False)
    # compute-bound (fast copies, no CPU step): a recompute makes the step slower
    base = replace(base, h2d_gbps=1e4, d2h_gbps=1e4, bidir_gbps=1e4, optimizer_ns_per_param=0.0)
    big = [replace(lc, forward_work_bytes=40 * lc.input_bytes) for lc in base.layers]
    unmeasured = replace(base, layers=big)
    measured = replace(base, layers=[replace(lc, keep_forward_work_bytes=lc.input_bytes) for lc in big])
    plan = keep_all_plan(3, base.batch_size, base.seq_len)
    before, after = simulate(plan, unmeasured), simulate(plan, measured)
    for name, old, new in zip(before.stage_names, before.gpu_bytes_by_stage, after.gpu_bytes_by_stage):
        assert old - new == (39 * base.layers[0].input_bytes if name.startswith("fwd") else 0), name
    # GPU memory for the keep-all plan as measured: the MILP must see that it fits (nothing
    # recomputes, nothing is faster), which it does not without the measured working set
    measured.gpu_bytes = unmeasured.gpu_bytes = after.peak_gpu_bytes + 2**20
    assert not simulate(plan, unmeasured).feasible
    solved = solve_plan(measured, tiers=("gpu",), recompute=(), mip_rel_gap=1e-7)
    assert simulate(solved, measured).feasible
    assert solved.predicted_step_time_s <= after.step_time_s * (1 + 1e-6)
    assert solve_plan(unmeasured, tiers=("gpu",), recompute=()).predicted_step_time_s > after.step_time_s

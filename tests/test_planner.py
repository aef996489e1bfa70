"""The planner front door on cost tables alone: the first plan, the re-plans after running out
of GPU memory and the recalibration, as plain data in and out (the trainer's side of each is in
test_oom_replan.py and test_recalibrate.py)."""

from __future__ import annotations

import pytest

from lazytrain.config import PlanConfig
from lazytrain.plan.planner import OutOfGpuMemory, Planner
from lazytrain.plan.policies import UPDATE_RATE_MARGIN
from lazytrain.plan.search import MAX_OOM_REPLANS
from lazytrain.plan.synthetic import DecoderShape, synthetic_cost_table

SMALL = DecoderShape(num_layers=6, hidden=1024, intermediate=4096, num_heads=16, num_kv_heads=4, vocab=32000)


def _solved(**settings) -> tuple[Planner, object]:
    costs = synthetic_cost_table(SMALL, 4, 1024)
    planner = Planner(PlanConfig(policy="solved", device_layers=0, **settings))
    assert planner.resolve_policy(on_gpu=False) == "solved" and planner.needs_costs("solved")
    plan, notes = planner.initial("solved", costs, SMALL.num_layers, 4, 1024)
    assert notes.changed and plan is planner.plan and planner.costs is costs
    assert planner.predicted["predicted_step_time_s"] > 0 and "plan 'solved'" in planner.table
    return planner, costs


def test_running_out_of_memory_re_solves_smaller_up_to_the_cap_then_stops_with_what_to_do():
    planner, costs = _solved()
    released = []
    budgets = [costs.gpu_bytes]
    for n in range(MAX_OOM_REPLANS):
        peak = int(planner.predicted["predicted_peak_gpu_gb"] * 1e9)
        plan, notes = planner.after_oom(peak, "CUDA out of memory", release=lambda n=n: released.append(n))
        assert notes.changed and plan is planner.plan and f"(try {n + 1} of {MAX_OOM_REPLANS})" in notes.message
        budgets.append(planner.costs.gpu_bytes)
        assert planner.predicted["predicted_peak_gpu_gb"] * 1e9 <= budgets[-1]
    assert budgets == sorted(budgets, reverse=True) and len(set(budgets)) == len(budgets)
    with pytest.raises(OutOfGpuMemory, match=f"{MAX_OOM_REPLANS} smaller plans did not fit either.*batch_size"):
        planner.after_oom(0, "CUDA out of memory", release=lambda: released.append("late"))
    assert released == list(range(MAX_OOM_REPLANS))  # refused: the caller's executor left as it is
    # an update that runs out is counted apart from the steps
    plan, notes = planner.after_update_oom(0, before_solve=lambda: released.append("update"))
    assert notes.changed and released[-1] == "update" and planner.update_oom_replans == 1


def test_what_the_failed_step_left_allocated_comes_off_the_re_solved_budget():
    """``release`` returns the bytes still allocated after it beyond the failed plan's start
    (the 27B's H100 try: 0.75 GB); the re-solve gets that much less than without them."""
    (plain, _), (leaky, _) = _solved(), _solved()
    peak = int(plain.predicted["predicted_peak_gpu_gb"] * 1e9)
    plain.after_oom(peak, "CUDA out of memory", release=lambda: None)
    _, notes = leaky.after_oom(peak, "CUDA out of memory", release=lambda: 75_000_000)
    assert leaky.costs.gpu_bytes == plain.costs.gpu_bytes - 75_000_000
    assert "and 0.07 GB stayed allocated after its release" in notes.message


def test_a_baseline_goes_on_after_an_update_ran_out_and_stops_after_a_step_did():
    planner = Planner(PlanConfig(policy="megatrain"))
    plan, _ = planner.initial(planner.resolve_policy(on_gpu=True), None, 4, 2, 64)
    assert plan.policy == "megatrain" and planner.costs is None and not planner.needs_costs("megatrain")
    kept, notes = planner.after_update_oom(10**9, before_solve=pytest.fail)
    assert kept is plan and not notes.changed and "(plan 'megatrain' is not re-solved)" in notes.message
    with pytest.raises(OutOfGpuMemory, match="plan 'megatrain' is not re-solved"):
        planner.after_oom(10**9, "CUDA out of memory", release=pytest.fail)
    data_parallel = Planner(PlanConfig(policy="solved", device_layers=0), data_parallel=True)
    data_parallel.initial("solved", synthetic_cost_table(SMALL, 4, 1024), SMALL.num_layers, 4, 1024)
    with pytest.raises(OutOfGpuMemory, match="data parallel"):
        data_parallel.after_oom(10**9, "CUDA out of memory", release=pytest.fail)


def test_auto_takes_keep_all_on_the_cpu_when_its_activations_fit_half_the_free_memory():
    planner = Planner(PlanConfig())
    assert planner.resolve_policy(on_gpu=True) == "solved"
    assert planner.resolve_policy(on_gpu=False, keep_all_bytes=10, free_bytes=22) == "keep_all"
    assert planner.resolve_policy(on_gpu=False, keep_all_bytes=10, free_bytes=20) == "megatrain"
    assert Planner(PlanConfig(file="plan.json")).resolve_policy(on_gpu=True) == "file"


def test_recalibration_is_due_after_the_timed_updates_and_corrects_the_table_once_per_plan():
    planner, costs = _solved(recalibrate_after=3)
    params = 10**9
    for seconds in (9.0, 1.0, 2.0):  # the first warms up; the slowest of the rest: 2 ns/param
        assert not planner.recalibration_due()
        planner.timed_update(seconds)
    assert planner.recalibration_due()
    plan, notes = planner.recalibrate(params)
    planned = 2.0 * (1 + UPDATE_RATE_MARGIN)
    assert notes.record["update_ns_per_param_measured"] == pytest.approx(2.0)
    assert notes.record["update_ns_per_param_planned"] == pytest.approx(planned)
    assert notes.record["update_ns_per_param_table"] == costs.optimizer_ns_per_param
    assert planner.costs.optimizer_ns_per_param == pytest.approx(planned) and planner.recalibrations == 1
    assert plan is planner.plan and ("switching to it" if notes.changed else "keeping the current one") in notes.message
    # measured once per plan: a switch starts the count again, a kept plan is not re-checked
    assert not planner.recalibration_due()
    assert planner.update_seconds == ([] if notes.changed else [9.0, 1.0, 2.0])


def test_a_plan_file_runs_as_saved_with_the_configured_prefetch_or_is_refused_clearly(tmp_path):
    from lazytrain.config import ConfigError
    from lazytrain.plan.plan import megatrain_plan

    megatrain_plan(4, 2, 64, every=2).save(tmp_path / "plan.json")
    planner = Planner(PlanConfig(file=str(tmp_path / "plan.json"), weight_prefetch=2))
    policy = planner.resolve_policy(on_gpu=True)
    plan, _ = planner.initial(policy, None, 4, 2, 64)
    assert (plan.policy, plan.weight_prefetch, planner.costs) == ("megatrain", 2, None)
    assert not planner.recalibration_due()
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ConfigError, match=f"plan.file={tmp_path / 'bad.json'}: not a readable plan.json"):
        Planner(PlanConfig(file=str(tmp_path / "bad.json"))).initial("file", None, 4, 2, 64)

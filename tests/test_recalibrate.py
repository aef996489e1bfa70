"""The solved plan re-solved once on the CPU update rate the first steps measured
(`plan.recalibrate_after`, `policies.recalibrate`): the trainer's side, on the CPU."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest
from test_oom_replan import _failing, _losses, _trainer, fixed_costs  # noqa: F401 (a fixture)

from lazytrain.plan import planner as planner_module
from lazytrain.plan.plan import megatrain_plan
from lazytrain.plan.policies import UPDATE_RATE_MARGIN, Recalibration
from lazytrain.plan.simulate import simulate


def _records(folder):
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def test_the_measured_rate_is_recorded_and_a_faster_plan_taken_without_changing_the_training(
        tmp_path, monkeypatch, caplog, fixed_costs):  # noqa: F811
    expected = _losses(_trainer(tmp_path / "plain", "plan.policy=solved", "plan.recalibrate_after=0",
                                fixed_costs), 6)
    seen = []

    def recalibrate(plan, costs, measured, options):
        seen.append((plan, costs, measured, list(trainer.planner.update_seconds)))
        other = megatrain_plan(plan.num_layers, plan.batch_size, plan.seq_len, every=2)
        other.policy = "solved"
        seen.append(other)
        return Recalibration(costs=dataclasses.replace(costs, optimizer_ns_per_param=measured), plan=other,
                             changed=True, current_s=2.0, resolved_s=1.0)

    monkeypatch.setattr(planner_module, "recalibrate", recalibrate)
    trainer = _trainer(tmp_path / "re", "plan.policy=solved", "plan.recalibrate_after=3", fixed_costs)
    first = trainer.executor
    with caplog.at_level(logging.INFO, logger="lazytrain"):
        losses = _losses(trainer, 6)
    assert losses == pytest.approx(expected, rel=1e-6, abs=0)
    # once, after the step whose start saw the third finished update, on updates 2 and 3 (the
    # fourth is finished by the switch, the new updater's first is the fifth; the new plan is
    # not re-checked before three of its own)
    (plan, costs, planned, timed), other = seen
    assert len(timed) == 3 and plan.layers != trainer.plan.layers
    params = sum(w.numel() for w in trainer.store.weights)
    measured = max(timed[1:3]) * 1e9 / params
    assert planned == pytest.approx(measured * (1 + UPDATE_RATE_MARGIN))  # the slowest, with the margin
    assert len(trainer.planner.update_seconds) == 1  # the new plan's own, measured afresh
    assert trainer.executor is not first and trainer.plan is other and trainer.executor.plan is other
    assert trainer.costs.optimizer_ns_per_param == planned
    assert "switching to it" in caplog.text and f"{measured:.3f} ns/param in the plan's updates 2-3" in caplog.text
    assert f"planned for {planned:.3f})" in caplog.text
    trainer._close()
    record, = [r for r in _records(tmp_path / "re") if "replanned" in r]
    assert record["replanned"] and record["update_ns_per_param_measured"] == pytest.approx(measured)
    assert record["update_ns_per_param_planned"] == pytest.approx(planned)
    assert record["update_ns_per_param_table"] == costs.optimizer_ns_per_param


def test_the_rate_is_the_slowest_update_after_the_first():
    from lazytrain.plan.policies import measured_update_rate

    # the first (warm-up) left out however slow; the slowest of the rest, not their median (2 s)
    assert measured_update_rate([10.0, 1.0, 3.0, 2.0], 10**9) == pytest.approx(3.0)
    assert measured_update_rate([1.0, 0.5], 2 * 10**9) == pytest.approx(0.25)
    assert measured_update_rate([1.0], 10**9) is None and measured_update_rate([1.0, 2.0], 0) is None


def test_each_plan_a_recalibration_switched_to_is_measured_again_planning_for_the_slower_rate(
        tmp_path, monkeypatch, fixed_costs):  # noqa: F811
    from lazytrain.plan.policies import MAX_RECALIBRATIONS

    seen = []

    def recalibrate(plan, costs, planned, options):  # switches every time it is asked
        seen.append((planned, costs.optimizer_ns_per_param, len(trainer.planner.update_seconds)))
        other = megatrain_plan(plan.num_layers, plan.batch_size, plan.seq_len, every=1 + len(seen) % 2)
        other.policy = "solved"
        # the first re-solve's table says the update is very slow: the next ones plan for that
        rate = 1e6 if len(seen) == 1 else planned
        return Recalibration(costs=dataclasses.replace(costs, optimizer_ns_per_param=rate), plan=other,
                             changed=True, current_s=2.0, resolved_s=1.0)

    monkeypatch.setattr(planner_module, "recalibrate", recalibrate)
    trainer = _trainer(tmp_path, "plan.policy=solved", "plan.recalibrate_after=2", fixed_costs)
    expected = _losses(_trainer(tmp_path / "plain", "plan.policy=solved", "plan.recalibrate_after=0", fixed_costs),
                       14)
    assert _losses(trainer, 14) == pytest.approx(expected, rel=1e-6, abs=0)
    # once on the profiled plan, then once on each plan switched to, with its own updates (the
    # list started afresh), up to the cap although every re-solve switched
    assert len(seen) == MAX_RECALIBRATIONS == 3 and all(n == 2 for _, _, n in seen)
    (first, profiled, _), (second, table, _), (third, _, _) = seen
    assert first < 1e6 and profiled < 1e6  # a tiny CPU model's measured rate, against the profiled table
    assert table == second == third == 1e6  # measured faster than the table's 1e6: planned for the slower
    records = [r for r in _records(tmp_path) if "replanned" in r]
    assert len(records) == 3 and records[1]["update_ns_per_param_measured"] < records[1]["update_ns_per_param_planned"]
    trainer._close()


def test_later_recalibrations_plan_for_the_slower_of_the_measured_and_the_tables_rate(fixed_costs):  # noqa: F811
    from lazytrain.plan.costs import CostTable
    from lazytrain.plan.policies import PolicyOptions, planned_update_rate, policy_plan, recalibrate

    table = dataclasses.replace(CostTable.load(fixed_costs.partition("=")[2]), optimizer_ns_per_param=2.0)
    m = 1 + UPDATE_RATE_MARGIN
    assert UPDATE_RATE_MARGIN > 0
    # the first: as measured with the margin, faster or slower than the table's
    assert planned_update_rate(1.0, table, earlier=False) == pytest.approx(m)
    assert planned_update_rate(3.0, table, earlier=False) == pytest.approx(3 * m)
    assert planned_update_rate(1.0, table, earlier=True) == 2.0  # later: never below the table's
    assert planned_update_rate(1.9, table, earlier=True) == pytest.approx(1.9 * m)  # above it with the margin
    assert planned_update_rate(3.0, table, earlier=True) == pytest.approx(3 * m)
    # an update measured faster than the table's after a re-solve: nothing to re-solve
    plan = policy_plan("solved", table, PolicyOptions())
    assert recalibrate(plan, table, planned_update_rate(1.0, table, earlier=True), PolicyOptions()) is None
    # a first round: an update measured as the table has it is planned for 10% slower, so
    # re-solved; one measured 10% faster is planned for within the tolerance, so kept
    found = recalibrate(plan, table, planned_update_rate(2.0, table, earlier=False), PolicyOptions())
    assert found is not None and found.costs.optimizer_ns_per_param == pytest.approx(2.0 * m)
    assert recalibrate(plan, table, planned_update_rate(2.0 / m, table, earlier=False), PolicyOptions()) is None


def test_a_plan_started_after_running_out_of_memory_is_timed_afresh(tmp_path, monkeypatch, fixed_costs):  # noqa: F811
    seen = []
    monkeypatch.setattr(planner_module, "recalibrate",
                        lambda plan, costs, planned, options: seen.append((planned, list(trainer.planner.update_seconds))))
    trainer = _trainer(tmp_path, "plan.policy=solved", "plan.recalibrate_after=3", fixed_costs)
    _losses(trainer, 3)
    before = list(trainer.planner.update_seconds)
    assert len(before) == 2 and not seen
    _failing(monkeypatch, times=1)  # the next forward runs out: the plan is re-solved smaller
    first = trainer.executor
    _losses(trainer, 5)
    assert trainer.executor is not first
    # the re-solve on the smaller plan's own updates (its first, warming up, left out), none of the old plan's
    (planned, timed), = seen
    assert len(timed) == 3 and not set(timed) & set(before)
    params = trainer.updater.cpu_params
    assert planned == pytest.approx(max(timed[1:]) * 1e9 / params * (1 + UPDATE_RATE_MARGIN))
    trainer._close()


def test_no_recalibration_when_the_rate_is_right_or_it_is_off(tmp_path, monkeypatch, fixed_costs):  # noqa: F811
    calls = []
    monkeypatch.setattr(planner_module, "recalibrate", lambda *a: calls.append(a))
    for after in (0, 3):
        trainer = _trainer(tmp_path / str(after), "plan.policy=solved", f"plan.recalibrate_after={after}",
                           fixed_costs)
        first = trainer.executor
        _losses(trainer, 5)
        assert trainer.executor is first
    assert len(calls) == 1  # recalibrate returned None: the plan and table stay
    megatrain = _trainer(tmp_path / "m", "plan.policy=megatrain", "plan.recalibrate_after=2")
    _losses(megatrain, 4)
    assert megatrain.costs is None and len(calls) == 1  # a baseline has no table to correct


def test_a_table_far_off_the_measured_rate_is_corrected_and_training_goes_on(tmp_path, fixed_costs):  # noqa: F811
    from lazytrain.plan.costs import CostTable

    path = fixed_costs.partition("=")[2]
    table = CostTable.load(path)
    off = tmp_path / "off.json"
    dataclasses.replace(table, optimizer_ns_per_param=table.optimizer_ns_per_param * 1e-4).save(off)
    expected = _losses(_trainer(tmp_path / "plain", "plan.policy=solved", "plan.recalibrate_after=0",
                                f"plan.costs={off}"), 5)
    trainer = _trainer(tmp_path / "re", "plan.policy=solved", "plan.recalibrate_after=2", f"plan.costs={off}")
    assert _losses(trainer, 5) == pytest.approx(expected, rel=1e-6, abs=0)
    trainer._close()
    record, = [r for r in _records(tmp_path / "re") if "replanned" in r]
    assert record["step"] == 3 and record["update_ns_per_param_table"] == pytest.approx(
        table.optimizer_ns_per_param * 1e-4)
    assert trainer.costs.optimizer_ns_per_param == record["update_ns_per_param_planned"] > 0
    assert record["update_ns_per_param_planned"] == pytest.approx(
        record["update_ns_per_param_measured"] * (1 + UPDATE_RATE_MARGIN))
    # the step records after it carry the prediction on the corrected table
    predicted = simulate(trainer.plan, trainer.costs, optimizer_overlap=True).step_time_s
    assert trainer.predicted["predicted_step_time_s"] == pytest.approx(predicted)
    assert predicted != pytest.approx(simulate(trainer.plan, table, optimizer_overlap=True).step_time_s)


def test_the_update_time_read_after_start_is_the_previous_updates(tmp_path):
    """`HostUpdater.last_step_seconds` is published when an update is joined: read right after
    `start`, as the trainer reads it, it is the update before's, even when the new update's
    worker has already finished (on a tiny model it often had, and the trainer then took the
    new update's time for the old one's)."""
    trainer = _trainer(tmp_path, "plan.policy=megatrain")
    updater, previous = trainer.updater, 0.0  # no update before the first
    for _ in range(3):
        stats = trainer.executor.forward_backward(*_batch(trainer))
        updater.start(1.0, 1e-5)
        updater._thread.join()  # the worker done before the read
        assert updater.last_step_seconds == previous
        previous = updater._worker_seconds
        assert previous > 0 and stats.loss > 0
    updater.finish()
    assert updater.last_step_seconds == previous  # finish joins the last one


def _batch(trainer):
    batch = next(trainer.batches)
    return batch.input_ids, batch.labels, batch.attention_mask


def test_the_solved_plan_takes_the_configured_offload_window(tmp_path, fixed_costs):  # noqa: F811
    trainer = _trainer(tmp_path, "plan.policy=solved", "plan.offload_window=2", fixed_costs)
    assert trainer.session.policy_options().offload_window == 2 and trainer.plan.offload_window == 2
    _losses(trainer, 2)
    trainer._close()


def test_an_offload_window_with_the_nvme_tier_is_refused(tmp_path):
    from lazytrain.config import ConfigError, load_config
    from lazytrain.train.session import build_session

    session = build_session(load_config(None, [f"training.output_dir={tmp_path}", "model.source=builtin:tiny",
                                               f"memory.nvme_dir={tmp_path / 'nvme'}", "plan.offload_window=2"]))
    with pytest.raises(ConfigError, match="plan.offload_window=2 models host-tier offloads only"):
        session.policy_options()

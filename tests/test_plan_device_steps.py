"""Streamed layers stepped on the GPU with their states copied in and out (`Plan.device_steps`):
the simulator's copies, streams and memory; the MILP's agreement with it; how many the planner
takes when it may choose; the plan file; the errors."""

from dataclasses import replace

import pytest
from test_plan_device_layers import cpu_bound_table, device_table, layer_copies

from lazytrain.config import ConfigError, load_config
from lazytrain.plan.milp import PlanInfeasible, hiding_device_steps, milp_evaluate, solve_plan
from lazytrain.plan.plan import Plan, PlanError, checkpoint_all_plan, megatrain_plan
from lazytrain.plan.policies import PolicyOptions, baseline_plan, policy_plan
from lazytrain.plan.render import format_plan_table
from lazytrain.plan.simulate import STREAMED_STEP_SLOTS, _Stages, simulate


def stepped(plan: Plan, device_layers: int, device_steps: int) -> Plan:
    out = Plan.from_dict(plan.to_dict())
    out.const_update, out.device_layers, out.device_steps = "device", device_layers, device_steps
    return out


def ops(result, stream: str) -> dict[str, tuple[float, float]]:
    return {label: (start, end) for s, start, end, label in result.timeline if s == stream}


@pytest.mark.parametrize("overlap", [False, True])
def test_streamed_steps_take_no_cpu_time_copy_no_gradients_and_stream_their_states(overlap):
    table = device_table()
    L, k, s = table.num_layers, 1, 2
    plan = checkpoint_all_plan(L, table.batch_size, table.seq_len)
    none = simulate(stepped(plan, k, 0), table, optimizer_overlap=overlap)
    some = simulate(stepped(plan, k, s), table, optimizer_overlap=overlap)
    for j in range(k, L):
        assert {f"w {j}", f"w {j} bwd"} <= layer_copies(some)  # still streamed
        assert f"grad {j}" in layer_copies(some)  # to the host in the backward, as the others'
    params = sum(table.layers[j].params for j in range(k, k + s))
    ns = table.optimizer_ns_per_param * 1e-9
    assert none.busy_s["cpu"] - some.busy_s["cpu"] == pytest.approx(ns * params)
    ins, outs, steps = ops(some, "h2d_opt"), ops(some, "d2h_opt"), ops(some, "gpu_opt")
    assert set(ins) == {f"state {j} in" for j in range(k, k + s)}
    assert set(outs) == {f"state {j} out" for j in range(k, k + s)}
    for j in range(k, k + s):
        begin, end = steps[f"step {j}"]
        assert end - begin == pytest.approx(table.streamed_step_ms(j) * 1e-3)
        assert ins[f"state {j} in"][1] <= begin and end <= outs[f"state {j} out"][0]
        if overlap:  # the forward's copy of the new weights after they are out
            assert ops(some, "h2d")[f"w {j}"][0] >= outs[f"state {j} out"][1]
        else:  # after the CPU step, at the end
            assert begin >= ops(some, "cpu")["optimizer"][1]
    out = table.layers[k].weight_bytes + table.const_update_bytes * table.layers[k].params / table.const_params
    assert table.streamed_out_bytes(k) == pytest.approx(out)
    assert table.streamed_in_bytes(k) == pytest.approx(out + table.layers[k].weight_bytes * table.grad_share)
    for label, (begin, end) in {**ins, **outs}.items():
        j = int(label.split()[1])
        nbytes = table.streamed_in_bytes(j) if label.endswith("in") else table.streamed_out_bytes(j)
        assert (end - begin) * max(table.h2d_gbps, table.d2h_gbps) * 1e9 >= nbytes * (1 - 1e-9)  # at most a link's rate


@pytest.mark.parametrize("work", [0, 3 * 10**8])
def test_streamed_steps_hold_two_slots_through_their_forwards_and_no_gradients(work):
    """The two slots and, measured, the GPU step's temporaries (`device_step_work_bytes`), from
    the first streamed step to the forward of the last streamed layer."""
    table = replace(device_table(), device_step_work_bytes=work)
    L, k = table.num_layers, 1
    plan = checkpoint_all_plan(L, table.batch_size, table.seq_len)
    st = _Stages(L)
    for s in (1, 3):
        none = simulate(stepped(plan, k, 0), table)
        some = simulate(stepped(plan, k, s), table)
        more = [0.0] * (st.embed_bwd + 1)
        slots = min(STREAMED_STEP_SLOTS, s) * max(table.streamed_in_bytes(j) for j in range(k, k + s))
        for stage in range(st.embed, st.fwd(k + s - 1) + 1):
            more[stage] += slots + work
        diff = [a - b for a, b in zip(some.gpu_bytes_by_stage, none.gpu_bytes_by_stage)]
        assert diff == pytest.approx(more, abs=1.0)
    with pytest.raises(ValueError, match="device_step_work_bytes must be >= 0"):
        replace(table, device_step_work_bytes=-1)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2, 5])
def test_the_milp_models_streamed_steps_as_the_simulator_does(seed, overlap):
    """Exactly in memory, and in time without the overlap (the streamed steps run after the CPU
    step, alone). With it, the MILP runs the streamed steps' copies as the simulator does but
    alone, not sharing the H2D link with the forward's weights: a lower bound, within 10% on
    these random tables, whose forwards take tens of ms against hundreds for a layer's states
    (copies exposed for 0.4-1.2 s of 1-5 s steps). Odd seeds with the GPU step's temporaries."""
    table = replace(device_table(seed, 7), device_step_work_bytes=(seed % 2) * 4 * 10**8)
    for plan in (megatrain_plan(7, table.batch_size, table.seq_len, every=3),
                 checkpoint_all_plan(7, table.batch_size, table.seq_len, "host")):
        for k, s in ((0, 2), (1, 3), (2, 5)):
            fixed = stepped(plan, k, s)
            fixed.layers[-1].tier = "gpu"  # the MILP keeps the last layer on the GPU
            sim = simulate(fixed, table, optimizer_overlap=overlap)
            step_s, peak = milp_evaluate(fixed, table, optimizer_overlap=overlap)
            if overlap:
                assert 0.9 * sim.step_time_s <= step_s <= sim.step_time_s * (1 + 1e-6)
            else:
                assert step_s == pytest.approx(sim.step_time_s, rel=1e-6)
            assert peak == pytest.approx(sim.peak_gpu_bytes, abs=4096)
            # every other layer's gradient held on the GPU, streamed steps' included: memory
            # exact; the MILP still copies a held gradient in with its streamed step's state
            # (its schedule of those copies is fixed before the solve), at most 10% long here
            # (1-6% on these tables)
            for j in range(k, 7, 2):
                fixed.layers[j].grad = "gpu"
            sim = simulate(fixed, table, optimizer_overlap=overlap)
            step_s, peak = milp_evaluate(fixed, table, optimizer_overlap=overlap)
            assert (0.9 if overlap else 1 - 1e-6) * sim.step_time_s <= step_s <= 1.1 * sim.step_time_s
            assert peak == pytest.approx(sim.peak_gpu_bytes, abs=4096)


def test_auto_steps_enough_streamed_layers_on_the_gpu_to_hide_the_cpu_update():
    table = cpu_bound_table()  # the CPU update of a layer takes far longer than its forward
    L = table.num_layers
    # nothing hides it (the streamed layers' copies take longer than their forwards too): the
    # least late, most of the layers
    most = hiding_device_steps(table, 0)
    assert L // 2 < most <= L
    assert hiding_device_steps(replace(table, optimizer_ns_per_param=1e-6), 0) == 0  # the CPU keeps up
    plan = solve_plan(table, optimizer_overlap=True, const_update="device", device_layers=0, device_steps=None)
    assert plan.device_steps == most and plan.notes["device_steps"] == {"0": most}
    none = solve_plan(table, optimizer_overlap=True, const_update="device", device_layers=0)
    assert none.device_steps == 0
    assert plan.predicted_step_time_s < none.predicted_step_time_s
    assert simulate(plan, table).step_time_s < simulate(none, table).step_time_s
    # gradients placed (auto) where the host has room for 2 or 4 of the 8 gradient buffers: a
    # streamed step's layer may hold its gradient on the GPU like a CPU-stepped one (until
    # 2026-12-07 it took a host buffer, so the hiding count did not fit such a host), and the
    # hiding count fits; every buffer on the host does not
    grad = table.layers[0].weight_bytes * table.grad_share
    for room in (2.5, 4.5):
        tight = replace(table, host_bytes=int(room * grad), host_grads=False)
        some = solve_plan(tight, optimizer_overlap=True, const_update="device", device_layers=0, device_steps=None,
                          gradients="auto")
        assert some.device_steps == most
        hosted = [j for j, lp in enumerate(some.layers) if lp.grad == "host"]
        assert len(hosted) <= int(room) and any(lp.grad == "gpu" for lp in some.layers[:most])
        # the MILP counts a held gradient into its streamed step's copy in (an upper bound); the
        # simulator does not copy it; memory the same
        sim = simulate(some, tight, optimizer_overlap=True)
        step_s, peak = milp_evaluate(some, tight, optimizer_overlap=True)
        assert sim.violations == [] and sim.step_time_s <= step_s * (1 + 1e-6)
        assert step_s == pytest.approx(some.predicted_step_time_s, rel=1e-6)
        assert peak == pytest.approx(sim.peak_gpu_bytes, abs=4096)
        with pytest.raises(PlanInfeasible):
            solve_plan(tight, optimizer_overlap=True, const_update="device", device_layers=0, device_steps=most,
                       gradients="host")
    # without the overlap nothing is hidden: none; forced, at most the layers left
    assert solve_plan(table, optimizer_overlap=False, const_update="device", device_steps=None).device_steps == 0
    forced = solve_plan(table, optimizer_overlap=True, const_update="device", device_layers=None, device_steps=L)
    assert forced.device_layers + forced.device_steps == L
    assert policy_plan("solved", table, PolicyOptions(const_update="device", device_steps=2)).device_steps == 2
    b, s = table.batch_size, table.seq_len
    assert baseline_plan("megatrain", L, b, s, PolicyOptions(const_update="device", device_layers=L - 2,
                                                              device_steps=4)).device_steps == 2
    assert baseline_plan("megatrain", L, b, s, PolicyOptions(const_update="auto", device_steps=4)).device_steps == 0


def test_the_plan_file_and_table_keep_the_streamed_steps(tmp_path):
    table = cpu_bound_table()
    plan = solve_plan(table, optimizer_overlap=True, const_update="device", device_layers=1, device_steps=2)
    plan.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json") == plan
    older = plan.to_dict()
    del older["device_steps"]  # a plan.json written before the field: none
    assert Plan.from_dict(older).device_steps == 0
    assert "layers 1..2 stepped on the GPU (states streamed)" in format_plan_table(plan, simulate(plan, table))


def test_errors_say_what_to_do(tmp_path):
    table = device_table()
    L, b, s = table.num_layers, table.batch_size, table.seq_len
    layers = checkpoint_all_plan(L, b, s).layers
    with pytest.raises(ValueError, match="device_steps=2 steps streamed layers .* needs const_update='device'"):
        Plan(policy="x", batch_size=b, seq_len=s, layers=layers, device_steps=2)
    with pytest.raises(ValueError, match="device_steps must be >= 0, got -1"):
        Plan(policy="x", batch_size=b, seq_len=s, layers=layers, const_update="device", device_steps=-1)
    with pytest.raises(PlanError, match=f"device_layers=2 \\+ device_steps={L - 1} exceeds the model's {L} layers"):
        stepped(checkpoint_all_plan(L, b, s), 2, L - 1).check(L)
    with pytest.raises(ValueError, match=f"device_steps={L} is not in 0..{L - 1}"):
        solve_plan(table, const_update="device", device_layers=1, device_steps=L)
    with pytest.raises(ValueError, match="device_steps=2 .* needs const_update='device' \\(or None\\), got 'host'"):
        solve_plan(table, const_update="host", device_steps=2)
    with pytest.raises(ValueError, match="device_steps=3 .* set const_update=device \\(or auto\\), or device_steps=0"):
        PolicyOptions(device_steps=3)
    with pytest.raises(ValueError, match="device_steps must be >= 0, or None to choose; got -1"):
        PolicyOptions(const_update="device", device_steps=-1)
    (tmp_path / "c.yaml").write_text("plan:\n  const_update: host\n  device_steps: 2\n")
    with pytest.raises(ConfigError, match="plan.device_steps=2 .* set plan.const_update=device"):
        load_config(tmp_path / "c.yaml")
    (tmp_path / "c.yaml").write_text("plan:\n  device_steps: -1\n")
    with pytest.raises(ConfigError, match="plan.device_steps must be >= 0 or null"):
        load_config(tmp_path / "c.yaml")


def test_a_plan_with_streamed_gpu_steps_is_drawn_with_their_streams(tmp_path):
    """`render_plan_png` colours every simulated stream, the streamed steps' copies and steps
    among them (``lazytrain plan`` stopped at the picture of such a plan until 2026-12-07)."""
    pytest.importorskip("matplotlib")
    from lazytrain.plan.render import STREAM_COLORS, render_plan_png
    from lazytrain.plan.simulate import STREAMS

    assert set(STREAM_COLORS) == set(STREAMS)
    table = device_table()
    plan = stepped(checkpoint_all_plan(table.num_layers, table.batch_size, table.seq_len), 1, 2)
    sim = simulate(plan, table, optimizer_overlap=True)
    assert {"h2d_opt", "d2h_opt", "gpu_opt"} <= {stream for stream, *_ in sim.timeline}
    render_plan_png(plan, sim, tmp_path / "plan.png", table)
    assert (tmp_path / "plan.png").stat().st_size > 0



def test_the_most_streamed_steps_that_fit_by_bisection():
    """`_most_that_fit` (what ``device_steps=None`` falls back on where the hiding count does
    not fit): the most counts below it that fit, a count whose solve ran out of time taken as
    not fitting; none fitting gives 0's result."""
    from lazytrain.plan.milp import _most_that_fit

    def solver(fit, timed_out, calls):
        def solve(s):
            calls.append(s)
            if s in timed_out:
                return float("inf"), None
            return (100.0 - s, f"plan {s}") if s <= fit else (None, None)
        return solve

    for over, fit, timed_out in ((33, 21, ()), (33, 0, ()), (2, 1, ()), (40, 12, (13, 20))):
        calls = []
        assert _most_that_fit(solver(fit, timed_out, calls), over) == (100.0 - fit, f"plan {fit}", fit)
        assert len(calls) <= 2 + over.bit_length() and over not in calls
    assert _most_that_fit(lambda s: (None, None), 5) == (None, None, 0)
    assert _most_that_fit(lambda s: (float("inf"), None), 5) == (float("inf"), None, 0)

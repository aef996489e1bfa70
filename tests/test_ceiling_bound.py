"""bench/ceiling_bound.py: each scenario frees one resource of a cost table and re-solves; a
freed resource never makes the predicted step longer, and with everything free but the card's
memory only recompute separates the step from compute-only."""

import dataclasses
import json

import pytest

from bench.ceiling_bound import FAST, LARGE, compute_only_s, row, scenarios
from lazytrain.plan.milp import min_gpu_bytes
from lazytrain.plan.plan import keep_all_plan
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
    rows = {name: row(name, t, "t.json", 10.0) for name, t in scenarios(table, [2.0], [1.0])}
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

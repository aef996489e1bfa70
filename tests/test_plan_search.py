"""Batch-size search and rendering."""

import sys

import pytest

from lazytrain.plan.milp import PlanInfeasible, min_gpu_bytes
from lazytrain.plan.render import format_plan_table, render_plan_png
from lazytrain.plan.search import candidate_batches, search_batch
from lazytrain.plan.simulate import simulate
from lazytrain.plan.synthetic import QWEN25_32B, DecoderShape, synthetic_cost_table

SMALL = DecoderShape(
    num_layers=8, hidden=2048, intermediate=5632, num_heads=16, num_kv_heads=4, vocab=32000
)


def small_table(gpu_gb: float = 24.0):
    table = synthetic_cost_table(SMALL, 1, 2048)
    table.gpu_bytes = int(gpu_gb * 1e9)
    return table


def test_candidate_batches():
    assert candidate_batches(16) == [1, 2, 3, 4, 6, 8, 12, 16]


def test_throughput_search_picks_the_fastest_feasible_batch():
    result = search_batch(small_table(), 2048, max_batch=16)
    feasible = [t for t in result.tried if t["feasible"]]
    assert result.sim.tokens_per_s == max(t["tokens_per_s"] for t in feasible)
    assert result.plan.batch_size == result.costs.batch_size
    assert result.sim.feasible


def test_max_batch_search_finds_the_largest_batch_that_fits():
    table = small_table()
    result = search_batch(table, 2048, goal="max_batch", max_batch=64)
    batches = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]
    b = result.plan.batch_size
    assert min_gpu_bytes(table.at(b, 2048)) <= table.gpu_bytes
    if b != batches[-1]:
        bigger = batches[batches.index(b) + 1]
        assert min_gpu_bytes(table.at(bigger, 2048)) > table.gpu_bytes
    assert simulate(result.plan, result.costs).feasible


def test_nothing_fits_is_a_clear_error():
    with pytest.raises(PlanInfeasible, match="the cheapest plan needs"):
        search_batch(small_table(gpu_gb=1.0), 2048, max_batch=4)


def test_a_batch_the_solver_runs_out_of_time_on_is_no_plan_and_says_so(monkeypatch):
    """HiGHS' time limit with no plan found is not a crash (2026-12-07: Qwen3-30B-A3B's sweep in
    78 GiB on 2 cores ended in a traceback): the solve says so, and a sweep stops there with it."""
    from lazytrain.plan import milp, search
    from lazytrain.plan.render import format_batch_sweep

    with pytest.raises(milp.SolverTimeLimit, match=r"no plan for batch 4 x seq 2048 within its time limit"):
        milp.solve_plan(small_table().at(4, 2048), time_limit_s=1e-9)
    solve = milp.solve_plan
    monkeypatch.setattr(search, "solve_plan", lambda table, **kw: solve(
        table, **{**kw, "time_limit_s": 1e-9 if table.batch_size > 2 else 10.0}))
    result = search_batch(small_table(), 2048, max_batch=16)
    assert [(t["batch_size"], t["feasible"], t.get("time_limit")) for t in result.tried][1:] == [(2, True, None),
                                                                                                  (3, False, True)]
    assert "no plan found within the solver's time limit (one may exist)" in format_batch_sweep(result.tried, 2)
    # the largest-batch bisect takes a least-memory solve that runs out of time as not fitting
    least = milp.min_gpu_bytes

    def out_of_time_above_8(table, **kw):
        if table.batch_size > 8:
            raise milp.SolverTimeLimit("no plan within the time limit")
        return least(table, **kw)

    monkeypatch.setattr(search, "min_gpu_bytes", out_of_time_above_8)
    monkeypatch.setattr(search, "solve_plan", solve)
    result = search_batch(small_table(gpu_gb=1000.0), 2048, goal="max_batch", max_batch=64)
    assert result.plan.batch_size == 8 and any(t.get("time_limit") for t in result.tried)


def test_table_and_png(tmp_path):
    table = synthetic_cost_table(QWEN25_32B, 1, 4096)
    result = search_batch(table, 4096, batch_sizes=[1])
    text = format_plan_table(result.plan, result.sim, result.costs)
    assert "plan 'solved': batch 1 x seq 4096" in text
    assert "GPU   peak" in text and "compute" in text
    pytest.importorskip("matplotlib")
    path = tmp_path / "plan.png"
    render_plan_png(result.plan, result.sim, path)
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_png_without_matplotlib_says_how_to_install(monkeypatch, tmp_path):
    table = small_table()
    result = search_batch(table, 2048, batch_sizes=[1])
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        render_plan_png(result.plan, result.sim, tmp_path / "x.png")


def test_max_batch_search_counts_gradients_held_on_the_gpu():
    """Layers without a host gradient buffer (placed by a run's first plan) hold theirs on the GPU:
    the largest-batch bisect's least-memory bound counts them, so the batch it settles on
    solves (2026-12-07: a 30B-A3B re-search after an out-of-memory settled on batch 117, whose
    plan the held gradients made infeasible, and gave no batch at all; 112 fits)."""
    table = small_table(gpu_gb=7.3)  # batch 32 fits without held gradients, 24 with
    table.host_grads = False
    held = tuple(range(SMALL.num_layers))
    free = search_batch(table, 2048, goal="max_batch", max_batch=64, gradients="auto")
    result = search_batch(table, 2048, goal="max_batch", max_batch=64, gradients="auto", hold_grads=held)
    b = result.plan.batch_size
    assert b < free.plan.batch_size and all(lp.grad == "gpu" for lp in result.plan.layers)
    assert simulate(result.plan, result.costs).feasible
    bigger = candidate_batches(64)[candidate_batches(64).index(b) + 1]
    assert min_gpu_bytes(table.at(bigger, 2048), gradients="auto", hold_grads=held) > table.gpu_bytes
    table.gpu_bytes = int(3.7e9)  # batch 1 needs 3.73 GB with them
    with pytest.raises(PlanInfeasible, match=r"needs 3.4\d GiB .* or give the 8 layers whose gradients are held"):
        search_batch(table, 2048, goal="max_batch", max_batch=4, gradients="auto", hold_grads=held)

"""Outer search over the batch size: solve the MILP at each candidate batch, keep the best.

Memory grows with the batch (every activation size is linear in tokens), so the search walks
the candidates upwards and stops at the first batch no plan fits. `scipy.optimize.milp` takes
no starting solution, so each solve starts cold (at L = 64 one solve is well under a second).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from lazytrain.plan.costs import RECOMPUTE_OPTIONS, CostTable
from lazytrain.plan.milp import (
    DEFAULT_MAX_SEGMENT,
    PlanInfeasible,
    SolverTimeLimit,
    min_gpu_bytes,
    solve_plan,
)
from lazytrain.plan.plan import Plan
from lazytrain.plan.simulate import SimResult, simulate

GOALS = ("throughput", "max_batch")

MAX_OOM_REPLANS = 3
"""Solved plans re-solved with less GPU memory after a step ran out of it (the trainer's
fallback, and the largest-batch bench's)."""


def gpu_budget_after_oom(budget: int, predicted_peak: int, seen_peak: int, left: int = 0) -> int:
    """The planner's GPU budget for the plan re-solved after a step of a plan predicted to peak
    at ``predicted_peak`` bytes ran out of memory needing ``seen_peak`` (allocated, plus the
    allocation that failed): the predicted peak (or the budget, if lower: from the budget a plan
    with slack would be solved again) less the excess seen plus 1 GiB (a lower bound: the step
    would have gone on allocating), and at least 4% less; less ``left`` too, the bytes still
    allocated after the failed step was released beyond what its plan started with (the 27B's
    H100 try of 2026-12-07 left 0.75 GB, held by what, not known). 0 when nothing is left. The
    simulator is measured per layer, not per step, and a real step can need more than it
    predicts (Qwen3.5-9B's kept layers on the H200: up to ~9 GB more in their backward)."""
    base = min(budget, predicted_peak) if predicted_peak > 0 else budget
    excess = seen_peak - predicted_peak
    return max(base - max(excess + 2**30 if excess > 0 else 0, int(0.04 * base)) - max(left, 0), 0)


def candidate_batches(max_batch: int) -> list[int]:
    """1, 2, 3, 4, 6, 8, 12, 16, 24, ...: powers of two and the midpoints between them."""
    out, b = [1], 2
    while b <= max_batch:
        out.append(b)
        if b + b // 2 <= max_batch and b >= 2:
            out.append(b + b // 2)
        b *= 2
    return sorted(set(out))


@dataclass(kw_only=True, slots=True)
class SearchResult:
    plan: Plan
    sim: SimResult
    costs: CostTable
    """The cost table at the chosen batch shape."""
    tried: list[dict] = field(default_factory=list)
    """One record per batch tried: batch_size, feasible, step_time_s, tokens_per_s, the resource
    that binds the step (``bound``, `SimResult.bound`) and where its time goes (``compute_s``,
    ``h2d_s``, ``d2h_s``, ``cpu_update_s``, ``other_s``: `SimResult.time_breakdown`), ..."""


def search_batch(
    costs: CostTable,
    seq_len: int,
    *,
    goal: str = "throughput",
    batch_sizes: Sequence[int] | None = None,
    max_batch: int = 256,
    gpu_bytes: int | None = None,
    tiers: tuple[str, ...] = ("gpu", "host", "nvme"),
    optimizer_overlap: bool = False,
    max_segment: int = DEFAULT_MAX_SEGMENT,
    head_chunk_tokens: int = 4096,
    time_limit_s: float = 10.0,
    mip_rel_gap: float = 1e-4,
    recompute: tuple[str, ...] = RECOMPUTE_OPTIONS,
    const_update: str | None = None,
    device_layers: int | None = 0,
    device_steps: int | None = 0,
    offload_window: int = 1,
    gradients: str = "host",
    hold_grads: tuple[int, ...] = (),
) -> SearchResult:
    """Pick the batch size (and its plan) for ``seq_len``.

    ``goal="throughput"`` maximises predicted tokens/s; ``goal="max_batch"`` takes the
    largest batch that fits ``gpu_bytes`` (default: the table's GPU memory). ``const_update``,
    ``device_layers`` and ``device_steps`` are `solve_plan`'s (None: at each batch the faster of host and device,
    the number of resident layers chosen; the largest batch is found with none), as are ``gradients``
    and ``hold_grads`` (where each layer's gradient waits). Raises
    `PlanInfeasible` when not even the smallest candidate fits.
    """
    if goal not in GOALS:
        raise ValueError(f"search goal {goal!r} is not one of {GOALS}")
    batches = sorted(set(batch_sizes or candidate_batches(max_batch)))
    if not batches or batches[0] < 1:
        raise ValueError(f"batch sizes must be >= 1, got {batches}")
    budget = costs.gpu_bytes if gpu_bytes is None else gpu_bytes
    solve_kw = {
        "gpu_bytes": gpu_bytes,
        "tiers": tiers,
        "optimizer_overlap": optimizer_overlap,
        "max_segment": max_segment,
        "head_chunk_tokens": head_chunk_tokens,
        "time_limit_s": time_limit_s,
        "mip_rel_gap": mip_rel_gap,
        "recompute": recompute,
        "const_update": const_update,
        "device_layers": device_layers,
        "device_steps": device_steps,
        "offload_window": offload_window,
        "gradients": gradients,
        "hold_grads": hold_grads,
    }
    tried: list[dict] = []

    if goal == "max_batch":
        # Feasibility is monotone in the batch: bisect on the least-memory MILP.
        lo, hi = -1, len(batches)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            table = costs.at(batches[mid], seq_len)
            try:
                need = min_gpu_bytes(table, tiers=tiers, max_segment=max_segment, recompute=recompute,
                                     const_update=const_update, offload_window=offload_window, gradients=gradients,
                                     hold_grads=hold_grads)
            except SolverTimeLimit:  # taken as not fitting: the search settles on a batch it could solve
                need = None
            fits = need is not None and need <= budget
            tried.append({"batch_size": batches[mid], "min_gpu_bytes": need, "feasible": fits,
                          **({"time_limit": True} if need is None else {})})
            lo, hi = (mid, hi) if fits else (lo, mid)
        if lo < 0:
            solve_plan(costs.at(batches[0], seq_len), **solve_kw)  # raises PlanInfeasible
        table = costs.at(batches[lo], seq_len)
        plan = solve_plan(table, **solve_kw)
        sim = simulate(plan, table)
        return SearchResult(plan=plan, sim=sim, costs=table, tried=tried)

    best: SearchResult | None = None
    for batch in batches:
        table = costs.at(batch, seq_len)
        try:
            plan = solve_plan(table, **solve_kw)
        except PlanInfeasible as why:
            if best is None:
                raise
            tried.append({"batch_size": batch, "feasible": False,
                          **({"time_limit": True} if isinstance(why, SolverTimeLimit) else {})})
            break
        sim = simulate(plan, table)
        tried.append(
            {
                "batch_size": batch,
                "feasible": True,
                "step_time_s": sim.step_time_s,
                "tokens_per_s": sim.tokens_per_s,
                "solve_time_s": plan.notes["milp"]["solve_time_s"],
                "const_update": plan.const_update,
                "device_layers": plan.device_layers,
                "device_steps": plan.device_steps,
                "bound": sim.bound,
                **{f"{part}_s": seconds for part, seconds in sim.time_breakdown().items()},
            }
        )
        if best is None or sim.tokens_per_s > best.sim.tokens_per_s:
            best = SearchResult(plan=plan, sim=sim, costs=table)
    assert best is not None
    best.tried = tried
    return best

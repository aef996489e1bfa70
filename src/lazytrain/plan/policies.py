"""The one map from a policy name to a `Plan`.

Every caller that turns a name into a plan (the trainer, ``lazytrain plan``'s baseline table,
the benchmarks) goes through `policy_plan`, so a policy means the same thing everywhere.

Names: ``solved`` (the MILP's plan for a `CostTable`), and the fixed baselines ``megatrain``
(every ``every``-th layer input kept on the GPU, the rest recomputed), ``keep_all`` (no
recompute), ``checkpoint_gpu`` / ``checkpoint_host`` / ``checkpoint_nvme`` (every layer input
checkpointed on that tier; ``checkpoint_all`` is ``checkpoint_`` + ``tier``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from lazytrain.plan.costs import RECOMPUTE_OPTIONS, CostTable
from lazytrain.plan.plan import (
    CONST_UPDATES,
    DEVICE_STEPPED,
    GRAD_PLACES,
    Plan,
    checkpoint_all_plan,
    keep_all_plan,
    megatrain_plan,
)

BASELINE_POLICIES = ("megatrain", "keep_all", "checkpoint_gpu", "checkpoint_host", "checkpoint_nvme")
POLICIES = ("solved", *BASELINE_POLICIES, "checkpoint_all")


@dataclass(kw_only=True, slots=True)
class PolicyOptions:
    """What the policies take besides the batch shape (the `PlanConfig` fields of the same names)."""

    megatrain_every: int = 4
    checkpoint_tier: str = "gpu"
    head_chunk_tokens: int = 4096
    weight_prefetch: int = 1
    tiers: tuple[str, ...] = ("gpu", "host")
    """Activation tiers the MILP may use (``solved`` only)."""
    optimizer_overlap: bool = True
    recompute: tuple[str, ...] = RECOMPUTE_OPTIONS
    """Blocks a kept layer may recompute in its backward (``solved`` only)."""
    const_update: str = "host"
    """Where the embedding and head take their optimizer step (`Plan.const_update`): host,
    device, or auto (the solved plan the faster of them by the MILP; a baseline, host)."""
    device_layers: int | None = 0
    """With the embedding and head stepped on the GPU, how many of the first decoder layers are
    resident and stepped there too (`Plan.device_layers`); None: the solved plan chooses (a
    baseline, none)."""
    device_steps: int | None = 0
    """With the embedding and head stepped on the GPU, how many streamed layers after the
    resident ones are stepped there too, their states streamed (`Plan.device_steps`); None: the
    solved plan takes the fewest that hide the CPU update (`milp.hiding_device_steps`; a
    baseline, none)."""
    offload_window: int = 1
    """Stages a host-tier offload's copy may take in the solved plan's model (`Plan.offload_window`)."""
    gradients: str = "host"
    """Where the CPU-stepped streamed layers' gradients wait (`LayerPlan.grad`, ``memory.gradients``):
    host, gpu, or auto (the solved plan places each one; a baseline, host)."""
    hold_grads: tuple[int, ...] = ()
    """Layers whose gradients every plan holds on the GPU: the run made them no host buffer."""

    def __post_init__(self) -> None:
        if self.const_update not in ("auto", *CONST_UPDATES):
            raise ValueError(
                f"const_update {self.const_update!r} is not one of auto, {', '.join(CONST_UPDATES)}"
            )
        if self.gradients not in ("auto", *GRAD_PLACES):
            raise ValueError(f"gradients {self.gradients!r} is not one of auto, {', '.join(GRAD_PLACES)}")
        for name, what in DEVICE_STEPPED.items():
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, or None to choose; got {value}")
            if value and self.const_update == "host":
                raise ValueError(f"{name}={value} {what}: set const_update=device (or auto), or {name}=0")


def baseline_plan(name: str, num_layers: int, batch_size: int, seq_len: int,
                  options: PolicyOptions | None = None) -> Plan:
    """The fixed plan of baseline policy ``name`` (no cost table needed)."""
    o = options or PolicyOptions()
    if name == "checkpoint_all":
        name = f"checkpoint_{o.checkpoint_tier}"
    if name == "megatrain":
        plan = megatrain_plan(num_layers, batch_size, seq_len, o.megatrain_every, o.head_chunk_tokens)
    elif name == "keep_all":
        plan = keep_all_plan(num_layers, batch_size, seq_len, o.head_chunk_tokens)
    elif name.startswith("checkpoint_") and name in BASELINE_POLICIES:
        plan = checkpoint_all_plan(num_layers, batch_size, seq_len, name.removeprefix("checkpoint_"),
                                   o.head_chunk_tokens)
    else:
        raise ValueError(
            f"policy {name!r} is not a baseline; baselines are {', '.join(BASELINE_POLICIES)} "
            "(checkpoint_all takes its tier from plan.checkpoint_tier)"
        )
    plan.weight_prefetch = o.weight_prefetch
    plan.const_update = "host" if o.const_update == "auto" else o.const_update
    plan.device_layers = (o.device_layers or 0) if plan.const_update == "device" else 0
    plan.device_steps = min(o.device_steps or 0, num_layers - plan.device_layers) if plan.const_update == "device" else 0
    first = plan.device_layers + plan.device_steps  # the CPU-stepped layers (`milp._add_gradient_rows`)
    for i, lp in enumerate(plan.layers):
        if i >= first and (o.gradients == "gpu" or i in o.hold_grads):
            lp.grad = "gpu"
    return plan


def policy_plan(name: str, costs: CostTable, options: PolicyOptions | None = None,
                gpu_bytes: int | None = None) -> Plan:
    """The plan of policy ``name`` at ``costs``' batch shape: the MILP's for ``solved``.

    ``gpu_bytes`` caps the solved plan's GPU memory (default: the table's).
    """
    o = options or PolicyOptions()
    if name != "solved":
        return baseline_plan(name, costs.num_layers, costs.batch_size, costs.seq_len, o)
    from lazytrain.plan.milp import solve_plan

    plan = solve_plan(costs, gpu_bytes=gpu_bytes, tiers=o.tiers, optimizer_overlap=o.optimizer_overlap,
                      head_chunk_tokens=o.head_chunk_tokens, recompute=o.recompute,
                      const_update=None if o.const_update == "auto" else o.const_update,
                      device_layers=o.device_layers, device_steps=o.device_steps,
                      offload_window=o.offload_window, gradients=o.gradients,
                      hold_grads=o.hold_grads)
    plan.weight_prefetch = o.weight_prefetch
    return plan


def comparison_plans(num_layers: int, batch_size: int, seq_len: int,
                     options: PolicyOptions | None = None) -> list[Plan]:
    """The baselines a solved plan is shown against (NVMe only when the MILP may use it)."""
    o = options or PolicyOptions()
    names = [n for n in BASELINE_POLICIES if n != "checkpoint_nvme" or "nvme" in o.tiers]
    return [baseline_plan(n, num_layers, batch_size, seq_len, o) for n in names]


RECALIBRATE_TOLERANCE = 0.05
"""`recalibrate` leaves a table whose CPU update rate is within this fraction of the one planned for
(the measured one with `UPDATE_RATE_MARGIN`: a first round re-solves when the update measures as
profiled, and keeps the plan when it measures 4.5-13.6% faster).
Small: on the H200 at 7B (2026-12-05, `bench/results/plan_qwen2.5-7b_h200_2026-12-05_as_trained.json`)
an update 9.9% slower than profiled was within the old 15%, and the plan kept (1 resident layer)
left the GPU waiting 0.30 s of a 5.55 s step for it; a re-solve costs seconds, a few times per
process, and `RECALIBRATE_GAIN` keeps a plan that re-solving does not improve."""

RECALIBRATE_GAIN = 0.01
"""... and keeps the current plan unless the re-solved one is predicted this much faster."""

MAX_RECALIBRATIONS = 3
"""Re-solves on a measured update rate per process: the first on the profiled plan's updates, and
one more on each plan started since (a re-solve's switch, an out-of-memory re-plan), once its
own updates are timed (its rate per parameter need not be the old plan's: on the H200 at 7B,
2026-12-05, a plan re-solved on 0.279 ns/param measured on 1 resident layer then updated at 0.311
with 6, and its forward waited 0.18 s per step for it)."""


UPDATE_RATE_MARGIN = 0.10
"""A recalibration plans for the measured CPU update rate this fraction slower (`planned_update_rate`).
The in-step rate drifts after it is measured, and the two errors cost differently. On the H200 at
7B (2026-12-05, `bench/results/plan_qwen2.5-7b_h200_2026-12-05_as_trained.json`) the same plan
(6 resident layers) updated at 0.308 ns/param in its measured steps against 0.296 in the
calibration just before, and a plan re-solved on 0.279 then ran at 0.311; plans whose update ran
past what they had slack for left the GPU waiting 0.16-0.30 s of a 5.3-5.6 s step, those with
slack 0.01 s; in a later process the in-step rate rose 20% over the calibration's (0.289 to
0.348, `bench/results/plan_qwen2.5-7b_h200_2026-12-05_margin.json`), beyond any margin that
costs little. Slack is cheap: on the first table each resident layer more covers ~4-5% of
update rate for 0.2-0.4% of step (`bench/results/device_layers_search_cpu-amd-epyc_2026-12-05.md`: at 0.313
ns/param k = 6 5.391 s, k = 8 5.350 s; at 0.2715, k = 8 costs 0.7% over the best, k = 5)."""


def planned_update_rate(measured_ns_per_param: float, costs: CostTable, earlier: bool) -> float:
    """The CPU update rate a recalibration plans for: the ``measured`` one `UPDATE_RATE_MARGIN`
    slower, or with ``earlier`` (``costs`` already holds the rate an earlier recalibration planned
    for) the slower of that and the table's, so that re-planning only ever adds slack for the
    update (more resident layers) and cannot alternate between plans whose updates run at
    different rates per parameter."""
    with_margin = measured_ns_per_param * (1 + UPDATE_RATE_MARGIN)
    return max(with_margin, costs.optimizer_ns_per_param) if earlier else with_margin


@dataclass(frozen=True, slots=True)
class Recalibration:
    """What `recalibrate` found: the table with the CPU update rate planned for, the plan to run on
    it (``plan`` is the current one when the re-solved one is not predicted faster) and both
    plans' predicted step times (s) on that table."""

    costs: CostTable
    plan: Plan
    changed: bool
    current_s: float
    resolved_s: float


def measured_update_rate(update_seconds: list[float], params: int) -> float | None:
    """The CPU update's ns per parameter that recalibration uses: of a run's update times in
    order (``update_seconds``; the first warms up and is left out), the slowest, over the
    ``params`` the CPU stepped; None without a time after the first or without parameters.

    The slowest, not a median: the overlapped update paces the next forward, and a step whose
    update runs slower than planned leaves the GPU waiting for the whole shortfall, while a plan
    with slack (more resident layers) costs little. On the H200 at 7B (2026-12-05) a plan
    re-solved on the median of updates 2..4 (0.272 ns/param) left the GPU waiting 0.16 s per step
    for updates at 0.284. As a forecast of the same plan's later steps the slowest was the closer
    in 2 of 3 runs (its errors 0.3-4.0%, the median's 1.1-6.8%): a rule that leans toward slack
    more than a better estimate."""
    seconds = update_seconds[1:]
    if not seconds or not params:
        return None
    return max(seconds) * 1e9 / params


def recalibrate(plan: Plan, costs: CostTable, planned_ns_per_param: float,
                options: PolicyOptions | None = None) -> Recalibration | None:
    """A solved ``plan`` re-solved with the CPU update rate to plan for (ns per parameter of the
    groups the CPU steps: what a run measured, with `planned_update_rate`'s margin), or None when
    there is nothing to correct: not a solved plan, or the table's rate within
    `RECALIBRATE_TOLERANCE` of it. The predictions it returns are on that rate (a margin slower
    than measured, so a plan with slack for the update is predicted as measured and one without
    it slower).

    The profile times the update alone; inside a step it shares the host's memory bus with the
    PCIe copies and ran up to 1.5x slower on the H200 (docs/planning.md), which moves the best plan (how
    many layers the GPU steps, what is offloaded to the host). The table's GPU budget stays as
    it is (a budget lowered after an out-of-memory stays lowered)."""
    from lazytrain.plan.simulate import simulate

    if plan.policy != "solved":
        return None
    if not planned_ns_per_param > 0:
        raise ValueError(f"planned_ns_per_param must be > 0, got {planned_ns_per_param}")
    if abs(planned_ns_per_param / costs.optimizer_ns_per_param - 1) <= RECALIBRATE_TOLERANCE:
        return None
    o = options or PolicyOptions()
    corrected = replace(costs, optimizer_ns_per_param=planned_ns_per_param)
    current_s = simulate(plan, corrected, optimizer_overlap=o.optimizer_overlap).step_time_s
    from lazytrain.plan.milp import PlanInfeasible

    try:
        resolved = policy_plan("solved", corrected, o)
    except PlanInfeasible:  # no solution within the solver's time limit: the running plan stays
        return Recalibration(costs=corrected, plan=plan, changed=False, current_s=current_s,
                             resolved_s=float("inf"))
    resolved_s = simulate(resolved, corrected, optimizer_overlap=o.optimizer_overlap).step_time_s
    changed = resolved_s < current_s * (1 - RECALIBRATE_GAIN)
    return Recalibration(costs=corrected, plan=resolved if changed else plan, changed=changed,
                         current_s=current_s, resolved_s=resolved_s)

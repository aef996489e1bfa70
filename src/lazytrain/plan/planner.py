"""The one front door to planning: which `Plan` runs, from start to finish.

A `Planner` holds a run's plan and the cost table it is predicted with, and makes every
decision about them: the policy ``plan.policy=auto`` means, the initial plan (a plan file, a
baseline, or the MILP's for a cost table), the re-plan after a step or an update ran out of
GPU memory, and the recalibration on the CPU update rate the run measured. The trainer and
the session talk to planning through it alone (and `Plan`): they measure (the profiler, the
allocator, the update's seconds) and run, and hand the numbers in as plain data.

Each decision returns the plan to run and `Notes`: a line for the log, the numbers for
``metrics.jsonl`` and whether the plan changed (the caller then starts an executor for it).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lazytrain.errors import ConfigError, LazyTrainError
from lazytrain.plan.costs import OLD_DEVICE_STEP_CHUNK, CostTable, usable_gpu_bytes
from lazytrain.plan.milp import PlanInfeasible
from lazytrain.plan.plan import Plan
from lazytrain.plan.policies import (
    MAX_RECALIBRATIONS,
    RECALIBRATE_TOLERANCE,
    PolicyOptions,
    baseline_plan,
    measured_update_rate,
    planned_update_rate,
    policy_plan,
    recalibrate,
)
from lazytrain.plan.render import format_plan_table
from lazytrain.plan.search import (
    MAX_OOM_REPLANS,
    SearchResult,
    candidate_batches,
    gpu_budget_after_oom,
    search_batch,
)
from lazytrain.plan.simulate import simulate
from lazytrain.plan.synthetic import (
    MachineGuess,
    estimated_cost_table,
    layer_shape,
    update_ns_per_param,
)

if TYPE_CHECKING:
    from lazytrain.config import PlanConfig

log = logging.getLogger(__name__)

GiB = 2**30


class OutOfGpuMemory(LazyTrainError, MemoryError):
    pass


@dataclass(frozen=True, slots=True)
class Notes:
    """What a decision of the `Planner` says besides the plan."""

    message: str = ""
    """What was decided and why (a line for the log; empty: nothing to say)."""
    record: dict = field(default_factory=dict)
    """Numbers for ``metrics.jsonl`` (empty: none)."""
    changed: bool = False
    """The plan is another than the one running: start an executor for it."""


def policy_options(settings: PlanConfig, *, data_parallel: bool = False, nvme_tier: bool = False,
                   gradients: str = "host") -> PolicyOptions:
    """The ``plan`` section as the policies take it, for a run that is data parallel or not and
    has an NVMe tier (``memory.nvme_dir``) or not, its gradients placed as ``gradients`` says
    (``memory.gradients``); raises `ConfigError` for choices that run cannot make."""
    pc = settings
    if data_parallel and (pc.const_update == "device" or pc.device_layers or pc.device_steps):
        raise ConfigError("plan.const_update=device, plan.device_layers and plan.device_steps step the "
                          "embedding, head and first layers on one GPU; a data-parallel run shards them over "
                          "its ranks' CPU optimizers: set plan.const_update=auto or host and "
                          "plan.device_layers=plan.device_steps=0")
    if pc.offload_window > 1 and nvme_tier:
        raise ConfigError(f"plan.offload_window={pc.offload_window} models host-tier offloads only, and "
                          "memory.nvme_dir lets the plan use the NVMe tier: set plan.offload_window=1 or leave "
                          "memory.nvme_dir unset")
    return PolicyOptions(
        megatrain_every=pc.megatrain_every, checkpoint_tier=pc.checkpoint_tier,
        head_chunk_tokens=pc.head_chunk_tokens, weight_prefetch=pc.weight_prefetch,
        tiers=("gpu", "host", "nvme") if nvme_tier else ("gpu", "host"),
        optimizer_overlap=pc.overlap_optimizer, recompute=tuple(pc.recompute_blocks),
        const_update=pc.const_update, device_layers=0 if data_parallel else pc.device_layers,
        device_steps=0 if data_parallel else pc.device_steps,
        offload_window=pc.offload_window, gradients=gradients,
    )


def keep_all_bytes(hidden_size: int, num_layers: int, batch_size: int, seq_len: int, dtype_bytes: int) -> int:
    """Activations keep_all holds: ~56 hidden-sized values per token and layer (measured on
    Qwen2.5-7B at bf16: 0.2 MB per token per layer)."""
    return 56 * hidden_size * dtype_bytes * batch_size * seq_len * num_layers


def costs_from_file(path: str, batch_size: int, seq_len: int, *, layer_types: list[str], attention: str | None,
                    elementwise: str | None, optimizer: str, device_step_chunk: int | None) -> CostTable:
    """The cost table saved at ``path`` (``plan.costs``) at this run's batch shape, checked
    against this run's model (``layer_types``), batches (``attention``), elementwise ops and CPU
    optimizer (`CostTableMismatch` otherwise; None: the table's is taken, as where the training
    machine decides), its GPU step's temporaries rescaled to this version's
    ``device_step_chunk`` (with a warning). Capacities stay the profiled machine's
    (`with_capacities`)."""
    source = f"plan.costs={path}"
    try:
        costs = CostTable.load(path).at(batch_size, seq_len)
    except (OSError, json.JSONDecodeError) as error:
        raise ConfigError(f"{source}: not a readable costs.json ({error}); write one with `lazytrain profile`") from None
    costs.check_layers(layer_types, source)
    if attention is not None:
        costs.check_attention(attention, source)
    if elementwise is not None:
        costs.check_elementwise(elementwise, source)
    costs.check_optimizer(optimizer, source)
    rescaled = costs.for_device_step_chunk(device_step_chunk)
    if rescaled is not costs:
        log.warning("plan.costs=%s measured the GPU optimizer step's temporaries in pieces of %d elements, this "
                    "version steps %d at a time: %.2f GB scaled to %.2f GB (profile again to measure them)", path,
                    costs.device_step_chunk or OLD_DEVICE_STEP_CHUNK, rescaled.device_step_chunk,
                    costs.device_step_work_bytes / 1e9, rescaled.device_step_work_bytes / 1e9)
    return rescaled


def with_capacities(costs: CostTable, *, host_bytes: int | None = None, gpu_gb: float | None = None,
                    host_grads: bool | None = None) -> CostTable:
    """``costs`` with this run's capacities: ``host_bytes`` of room for host activations (and,
    ``host_grads`` False, for the streamed layers' gradient buffers the plan leaves on the host:
    `CostTable.host_grads`), and a GPU of ``gpu_gb`` GiB (``memory.gpu_gb``; its usable part);
    None keeps the table's."""
    if host_bytes is not None:
        costs = dataclasses.replace(costs, host_bytes=host_bytes)
    if host_grads is not None:
        costs = dataclasses.replace(costs, host_grads=host_grads)
    if gpu_gb:
        costs = dataclasses.replace(costs, gpu_bytes=usable_gpu_bytes(int(gpu_gb * GiB)))
    return costs


def estimated_costs(layer_types: list[str], layer_params: dict[str, list[tuple[str, tuple[int, ...]]]], *,
                    hidden: int, vocab: int, embed_params: int, final_params: int, batch_size: int, seq_len: int,
                    head_chunk_tokens: int = 4096, gpu_gb: float | None = None,
                    gpu_source: str = "memory.gpu_gb", top_k: int = 0,
                    optimizer: tuple[str, str] | None = None,
                    device_state_bytes_per_param: float | None = None) -> tuple[CostTable, str]:
    """The built-in estimate of a cost table (`synthetic.estimated_cost_table`) for a model whose
    layer types have the parameters ``layer_params`` (name, shape), on the machine
    `synthetic.MachineGuess` assumes (its GPU, or one of ``gpu_gb`` GiB, which ``gpu_source``
    names), and a line saying so. Its ``host_bytes`` is the assumed host's memory, before the
    model state. ``top_k``: experts per token of the mixture-of-experts layers (0: none).
    ``optimizer``: the run's (``optimizer.kind``, resolved ``optimizer.state_rounding``), whose
    CPU rate the estimate takes (`synthetic.update_ns_per_param`; default the machine guess's).
    ``device_state_bytes_per_param``: what a parameter stepped on the GPU keeps there (master
    and states), for an optimizer with a GPU step; None: the estimate offers no GPU step."""
    machine = MachineGuess()
    if optimizer is not None:
        machine.optimizer_ns_per_param = update_ns_per_param(*optimizer)
    shapes = {kind: layer_shape(params, hidden, quadratic=not kind.startswith("linear_attention"), top_k=top_k)
              for kind, params in layer_params.items()}
    table = estimated_cost_table(layer_types, shapes, vocab=vocab, embed_params=embed_params,
                                 final_params=final_params, batch_size=batch_size, seq_len=seq_len, machine=machine,
                                 head_chunk_tokens=head_chunk_tokens,
                                 device_state_bytes_per_param=device_state_bytes_per_param)
    capacity = int(gpu_gb * GiB) if gpu_gb else machine.gpu_bytes
    table = dataclasses.replace(table, gpu_bytes=usable_gpu_bytes(capacity))
    return table, (
        f"built-in estimate, not measured: {machine.device}, {capacity / GiB:.0f} GiB of GPU memory"
        f"{f' ({gpu_source})' if gpu_gb else ''}, {machine.matmul_tflops:.0f} TFLOPS sustained bf16, PCIe "
        f"{machine.h2d_gbps:.0f} GB/s each way, CPU optimizer {machine.optimizer_ns_per_param} ns/param, "
        + ("no GPU optimizer step" if device_state_bytes_per_param is None
           else f"GPU optimizer step {machine.device_step_ps_per_param:g} ps/param")
        + f"{f', {machine.hbm_gbps / 1e3:.1f} TB/s GPU memory (MoE permutation)' if top_k else ''}; "
        "for a measured plan run `lazytrain profile` on the training machine and pass "
        "plan.costs=OUTPUT_DIR/costs.json")


class Planner:
    """One run's plan from start to finish (the ``plan`` section's choices, `policy_options`).

    `initial` picks the first plan; `after_oom` and `after_update_oom` re-solve a solved plan
    with less GPU memory (up to `MAX_OOM_REPLANS` times each); `timed_update` takes the CPU
    update times the run measures and `recalibrate` re-solves on them when `recalibration_due`.
    ``plan``, ``costs`` and ``predicted`` are the running plan, its table (None: a baseline or
    plan file without ``plan.costs``) and the simulator's prediction for it.
    """

    def __init__(self, settings: PlanConfig, *, data_parallel: bool = False, nvme_tier: bool = False,
                 gradients: str = "host"):
        self.settings = settings
        self.data_parallel = data_parallel
        self.options = policy_options(settings, data_parallel=data_parallel, nvme_tier=nvme_tier,
                                      gradients=gradients)
        self.plan: Plan | None = None
        self.costs: CostTable | None = None
        self.predicted: dict[str, float] = {}
        self.table = ""
        """The running plan's per-layer table with the simulator's figures (`format_plan_table`)."""
        self.update_seconds: list[float] = []
        """The running plan's CPU update times (s), in order: every plan is timed afresh (its rate
        per parameter is not another plan's, and its first update warms up)."""
        self.recalibrations = 0  # re-solves on a measured update rate in this process
        self.oom_replans = 0  # re-solves after a step ran out of GPU memory
        self.update_oom_replans = 0  # ... after an optimizer step planned on the GPU did (counted apart)
        self._recalibrate_due = False

    @property
    def places_gradients(self) -> bool:
        """Whether plans may hold streamed layers' gradients on the GPU (``memory.gradients``
        auto or gpu): the host's room for the plan is then measured without their host buffers
        (`with_capacities`' ``host_grads``)."""
        return self.options.gradients != "host"

    def hold_gradients(self, layers) -> None:
        """The run made no host gradient buffer for ``layers`` (its first plan holds them on the
        GPU): every later plan (a re-plan after running out of memory, a recalibration) holds
        them there too."""
        self.options = dataclasses.replace(self.options, hold_grads=tuple(sorted(layers)))

    # -- the first plan ---------------------------------------------------------------------

    def resolve_policy(self, *, on_gpu: bool, keep_all_bytes: int = 0, free_bytes: int = 0) -> str:
        """``plan.policy`` with ``auto`` decided: solved on a GPU; on the CPU keep_all when its
        activations (``keep_all_bytes``, `keep_all_bytes`) fit in half the ``free_bytes``, else
        megatrain. A plan file is ``file``."""
        policy = self.settings.policy
        if self.settings.file:
            return "file"
        if policy != "auto":
            return policy
        if on_gpu:
            return "solved"
        policy = "keep_all" if keep_all_bytes < free_bytes // 2 else "megatrain"
        log.info("plan.policy=auto: %s (keep_all would hold ~%.1f GiB of activations)", policy, keep_all_bytes / GiB)
        return policy

    def needs_costs(self, policy: str) -> bool:
        """Whether the plan of ``policy`` (`resolve_policy`) needs a cost table: a solved one
        does; any other is predicted with ``plan.costs`` when given."""
        return policy == "solved" or bool(self.settings.costs)

    def initial(self, policy: str, costs: CostTable | None, num_layers: int, batch_size: int,
                seq_len: int) -> tuple[Plan, Notes]:
        """The first plan: ``plan.file``'s, the MILP's for ``costs`` (``policy`` solved), or a
        baseline for ``num_layers`` at this batch shape; ``costs`` predicts it where given."""
        if policy == "solved" and costs is None:
            raise ValueError("the solved plan needs a cost table")
        if policy == "file":
            try:
                plan = Plan.load(self.settings.file)
            except (OSError, ValueError, TypeError) as error:
                raise ConfigError(f"plan.file={self.settings.file}: not a readable plan.json ({error})") from None
            plan.weight_prefetch = self.settings.weight_prefetch
        elif policy == "solved":
            plan = policy_plan("solved", costs, self.options)
        else:
            plan = baseline_plan(policy, num_layers, batch_size, seq_len, self.options)
        self.costs = costs
        self._started(plan)
        return plan, Notes(changed=True)

    def sweep(self, costs: CostTable, seq_len: int, max_batch: int) -> tuple[SearchResult | None, str | None]:
        """The solved plan at each candidate batch up to ``max_batch`` (`search.candidate_batches`)
        with this run's options, ``costs`` rescaled to each (`search.search_batch`: up to the
        first batch no plan fits, the fastest kept), or None and why not even the smallest fits."""
        o = self.options
        try:
            found = search_batch(costs, seq_len, batch_sizes=candidate_batches(max_batch), tiers=o.tiers,
                                 optimizer_overlap=o.optimizer_overlap, head_chunk_tokens=o.head_chunk_tokens,
                                 recompute=o.recompute, const_update=None if o.const_update == "auto" else o.const_update,
                                 device_layers=o.device_layers, device_steps=o.device_steps,
                                 offload_window=o.offload_window, gradients=o.gradients, hold_grads=o.hold_grads)
        except PlanInfeasible as infeasible:
            return None, str(infeasible)
        return found, None

    def _started(self, plan: Plan) -> None:
        """``plan`` runs from now: predicted, and timed afresh for recalibration."""
        self.plan = plan
        self.update_seconds = []
        # every plan's update is recalibrated on, up to the cap
        self._recalibrate_due = self.recalibrations < MAX_RECALIBRATIONS
        self._predict()

    def _predict(self) -> None:
        """``predicted`` (and ``table``) for the running plan on ``costs``."""
        if self.costs is None:
            self.predicted = {"predicted_step_time_s": self.plan.predicted_step_time_s}
            self.table = ""
            return
        sim = simulate(self.plan, self.costs, optimizer_overlap=self.options.optimizer_overlap)
        self.predicted = sim.metrics()
        self.table = format_plan_table(self.plan, sim, self.costs)

    # -- out of GPU memory ------------------------------------------------------------------

    def _not_resolved(self, tries: int) -> str | None:
        """Why this run's plan is not re-solved after running out of GPU memory (``tries``
        times re-solved already for that cause), or None."""
        if self.data_parallel:
            return "data parallel: the other ranks are in the step too"
        if self.costs is None or self.plan.policy != "solved" or self.settings.file is not None:
            return f"plan {self.plan.policy!r} is not re-solved"
        if tries >= MAX_OOM_REPLANS:
            return f"{MAX_OOM_REPLANS} smaller plans did not fit either"
        return None

    def _smaller_budget(self, need_bytes: int, left: int = 0) -> tuple[CostTable, str]:
        """The cost table with the GPU budget `gpu_budget_after_oom` gives after a step that
        needed ``need_bytes`` (allocated + the allocation that failed) and left ``left`` bytes
        allocated, and a line for the log."""
        predicted = int(self.predicted.get("predicted_peak_gpu_gb", 0.0) * 1e9)
        lower = gpu_budget_after_oom(self.costs.gpu_bytes, predicted, need_bytes, left)
        line = (f"the solved plan was predicted to peak at {predicted / 1e9:.1f} GB and needed {need_bytes / 1e9:.1f} "
                f"GB (allocated + the allocation that failed)"
                + (f", and {left / 1e9:.2f} GB stayed allocated after its release" if left > 0 else "")
                + f"; re-solving with {max(lower, 0) / 1e9:.1f} GB instead of {self.costs.gpu_bytes / 1e9:.1f} GB for "
                "the planner")
        return dataclasses.replace(self.costs, gpu_bytes=max(lower, 0)), line

    def _solve(self, costs: CostTable) -> tuple[Plan | None, str | None]:
        """The solved plan for ``costs``, or None and why there is none."""
        if costs.gpu_bytes <= 0:
            return None, "no GPU memory left to plan with"
        try:
            return policy_plan("solved", costs, self.options), None
        except PlanInfeasible as infeasible:
            return None, str(infeasible)

    def after_oom(self, need_bytes: int, error: str, release: Callable[[], int | None]) -> tuple[Plan, Notes]:
        """The plan to run the step again with after it ran out of GPU memory needing
        ``need_bytes`` (``error``: the allocator's message), or `OutOfGpuMemory`.

        A solved plan, in one process, is re-solved with the budget `gpu_budget_after_oom`
        gives (the failed step changed no weights, optimizer state or data position).
        ``release`` is called before the solve (the failed step's memory and the last update's
        CPU work done); it returns the GPU bytes still allocated after it beyond what the failed
        plan started with (None: not known), which the budget loses too."""
        plan = self.plan
        tries = self.oom_replans
        why = self._not_resolved(tries)
        if why is not None:
            raise OutOfGpuMemory(
                f"the step ran out of GPU memory with plan {plan.policy!r} at batch {plan.batch_size} x "
                f"seq {plan.seq_len} ({why}): {error}. Lower training.batch_size or "
                "data.max_seq_len, use plan.policy=megatrain, or give the planner less with memory.gpu_gb"
            ) from None
        self.oom_replans = tries + 1
        costs, line = self._smaller_budget(need_bytes, release() or 0)
        smaller, why = self._solve(costs)
        if smaller is None:
            raise OutOfGpuMemory(
                f"the step ran out of GPU memory with plan 'solved' at batch {plan.batch_size} x seq "
                f"{plan.seq_len}, and no plan fits the {costs.gpu_bytes / 1e9:.1f} GB left after it ({why}): "
                f"{error}. Lower training.batch_size or data.max_seq_len, or use plan.policy=megatrain"
            ) from None
        self.costs = costs
        self._started(smaller)
        return smaller, Notes(message=f"{line} (try {tries + 1} of {MAX_OOM_REPLANS})", changed=True)

    def after_update_oom(self, need_bytes: int, before_solve: Callable[[], None]) -> tuple[Plan, Notes]:
        """The plan to go on with after an optimizer step planned on the GPU ran out of its
        memory needing ``need_bytes`` (those groups were stepped on the CPU instead, the same
        update). A solved plan is re-solved with less GPU memory as in `after_oom` (counted
        apart: the update's tries do not use up the steps'); any other plan, or one with no
        smaller plan, goes on as it is (``changed`` False). ``before_solve`` is called before a
        solve (the update's CPU work done first, not beside it)."""
        tries = self.update_oom_replans
        why = self._not_resolved(tries)
        if why is None:
            self.update_oom_replans = tries + 1
            costs, line = self._smaller_budget(need_bytes)
            before_solve()
            smaller, why = self._solve(costs)
        if why is not None:
            return self.plan, Notes(message=f"the run goes on with the plan as it is ({why})")
        self.costs = costs
        self._started(smaller)
        return smaller, Notes(message=f"{line} (try {tries + 1} of {MAX_OOM_REPLANS})", changed=True)

    # -- recalibration ----------------------------------------------------------------------

    def timed_update(self, seconds: float) -> None:
        """The running plan's CPU update took ``seconds`` (the next finished one, in order)."""
        self.update_seconds.append(seconds)

    def recalibration_due(self) -> bool:
        """Whether `recalibrate` has what it needs now: ``plan.recalibrate_after`` updates of
        the running plan timed, and a solved plan of one process from a cost table not yet
        recalibrated on (``plan.file`` runs as it is)."""
        after = self.settings.recalibrate_after
        return bool(after and len(self.update_seconds) >= after and self._recalibrate_due
                    and self.costs is not None and not self.data_parallel and self.settings.file is None)

    def recalibrate(self, cpu_params: int) -> tuple[Plan, Notes]:
        """The plan re-solved with the CPU update rate its updates measured over the
        ``cpu_params`` the CPU steps, with a margin (`policies.recalibrate`,
        `policies.planned_update_rate`; after an earlier re-solve, never faster than the
        table's), taken when predicted faster. Each plan started (a switch, an out-of-memory
        re-plan) is measured in turn, up to `MAX_RECALIBRATIONS` re-solves in a process."""
        self._recalibrate_due = False
        measured = measured_update_rate(self.update_seconds, cpu_params)
        if measured is None:
            return self.plan, Notes()
        planned = planned_update_rate(measured, self.costs, earlier=self.recalibrations > 0)
        self.recalibrations += 1
        table = self.costs.optimizer_ns_per_param
        timed = len(self.update_seconds)
        started = time.perf_counter()
        found = recalibrate(self.plan, self.costs, planned, self.options)
        if found is None:
            return self.plan, Notes(message=(
                f"recalibration {self.recalibrations}: the CPU update ran at {measured:.3f} ns/param in the plan's "
                f"updates 2-{timed}, planned for {planned:.3f}, within {100 * RECALIBRATE_TOLERANCE:.0f}% of the "
                f"cost table's {table:.3f}: the plan kept"))
        self.costs = found.costs
        record = {"recalibration": self.recalibrations, "update_ns_per_param_measured": measured,
                  "update_ns_per_param_planned": planned, "update_ns_per_param_table": table,
                  "replanned": found.changed, "predicted_step_s_current_plan": found.current_s,
                  "predicted_step_s_resolved_plan": found.resolved_s}
        message = (
            f"recalibration {self.recalibrations}: the CPU update ran at {measured:.3f} ns/param in the plan's "
            f"updates 2-{timed} against {table:.3f} in the cost table (planned for {planned:.3f}); on that rate "
            f"the current plan is predicted at {found.current_s:.3f} s and the plan re-solved for it at "
            f"{found.resolved_s:.3f} s (solved in {time.perf_counter() - started:.0f} s): "
            + ("switching to it" if found.changed else "keeping the current one"))
        if found.changed:
            self._started(found.plan)
            return found.plan, Notes(message=message, record=record, changed=True)
        self._predict()  # the running plan's prediction on the corrected table
        return self.plan, Notes(message=message, record=record)

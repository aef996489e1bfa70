"""Event model of one training step: what a `Plan` costs on the machine a `CostTable` describes.

The step is a list of *stages*, one compute op each, in the order the executor runs them::

    embed, fwd 0 .. fwd L-1, head, bwd L-1 .. bwd 0, embed bwd, [optimizer]

A stage may also issue copies (H2D, D2H), NVMe reads and writes and CPU work. Every op runs on
one stream (compute, h2d, d2h, nvme, cpu); a stream runs its ops one at a time, in issue order.
An op starts when its stream is free, the compute of its issue stage has started (that is when
the executor enqueues it) and the ops it depends on have finished. Rates are fluid: a copy runs
at the single-direction bandwidth, or at ``bidir_gbps`` while the other direction is busy too;
compute runs ``copy_slowdown`` times slower while any PCIe copy is in flight.

Executor rules the dependencies encode (a stage "waits" = its compute does not start before):

- Weights: forward layer j's weights are copied ``weight_prefetch`` stages ahead; a backward
  unit's weights (one layer, or every layer of a recompute segment) arrive ``weight_prefetch``
  stages before the unit's first backward stage. The consuming stage waits for them.
- Offloaded tensors (tier host/nvme) are copied out in the next stage, and the stage after
  waits for that copy; a host-tier one may take ``Plan.offload_window`` stages (never past the
  head), the stage after them waiting (`simulate`). Their GPU memory is freed in their own stage
  (the allocator reuses it once the copy is done), with a longer window in all but the last of
  its stages. NVMe writes run one
  stage after the copy, from a pinned bounce buffer that the following stage waits for.
- Backward fetches them back ``LayerPlan.prefetch`` stages before the unit's first stage (an
  NVMe read one stage before that copy; the stage issuing the copy waits for the read).
- Each layer's gradient goes D2H in the stage after its backward; the stage after that waits.
  Unless the plan holds it on the GPU (`LayerPlan.grad` ``gpu``): then it lives there from its
  backward to the end of the step and, with the overlapped update, through the next forward up
  to the stage before its layer's (where its update, which copies it home through the
  executor's pinned ring, is done); a GPU-stepped streamed layer's is not copied in at its
  step. The ring's copies are not timed (`milp._add_gradient_rows` says why). Where
  `CostTable.host_grads` is False, each streamed layer's gradient left on the host counts in
  host memory for the whole step.
- The CPU optimizer runs after backward, or (``optimizer_overlap``) during the next step's
  forward: then layer j's weights are copied only after its update, and the embedding/head
  after theirs (so this model's step starts with the previous step's optimizer).
- ``plan.const_update == "device"``: the embedding and the final norm + head take their step
  on the GPU's compute stream (``CostTable.const_update_ms``), so they take no CPU time and
  their gradients and weights cross PCIe neither way. With the overlap the step runs ahead of
  the embedding while the CPU steps the layers (the embedding stage is reached at the start of
  the step: what it issues does not wait for the GPU step); without, after the CPU step.
- ``plan.device_layers`` (k): decoder layers 0..k-1 are resident on the GPU and stepped there
  too, in the same op (``const_update_ms`` scaled by their parameters over ``const_params``):
  their weights are never copied in, their gradients never out, and they take no CPU time, so
  the overlapped CPU update starts on layer k as the step starts. Layer k's weights are copied
  ``weight_prefetch`` stages ahead like any streamed layer's (the MILP's stage structure), not
  at the step's start, where the executor's weight stream may begin them.
- ``plan.device_steps`` (s): layers k..k+s-1 are streamed and stepped on the GPU: their
  gradients go to the host in the backward like the others', and at the step's start each
  one's weights, gradient, master remainder and state (`CostTable.streamed_in_bytes`) go in on
  a second H2D stream, its step runs on a GPU stream of its own (``streamed_step_ms``), and all
  but the gradient come out on a second D2H stream (``streamed_out_bytes``); two of them in
  flight at a time (the executor's two scratch slots, held until the last of them is out),
  the first two from the step's start and each later one with the forward's weight copy of the
  layer `STREAMED_LOOKAHEAD` before it (as the executor queues them). Layer j's forward weights
  are copied after its bytes are out. Copies in one direction share its bandwidth.

With every prefetch distance 1 each stage waits for everything the previous stage issued, so
the step time is a sum of per-stage maxima; that is what the MILP (``milp.py``) optimises.

GPU memory is counted per stage: the fixed part (before the head without the embedding's and
the head's gradients; with the device update also its master remainders and states,
``const_update_bytes``; the resident layers' weights, master remainders and states), every
buffer live in that stage (a resident layer's gradient from its backward to the end of the step)
and the largest transient phase of the stage (a layer's working set; in a segment's first
backward stage also each re-forward of the segment rebuild; stepped on the device, the
embedding's, head's and resident layers' gradients, held from the previous step's backward to
their update in the embedding stage).
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from dataclasses import dataclass, field

from lazytrain.plan.costs import CostTable
from lazytrain.plan.plan import Plan, is_offload_window

STREAMS = ("compute", "h2d", "d2h", "nvme", "cpu", "h2d_opt", "d2h_opt", "gpu_opt")
_H2D, _D2H = ("h2d", "h2d_opt"), ("d2h", "d2h_opt")
STREAMED_STEP_SLOTS = 2
"""Streamed GPU steps (`Plan.device_steps`) in flight at once: the executor's scratch slots."""
STREAMED_LOOKAHEAD = 2
"""How far ahead of the forward's weight copies the executor queues the streamed GPU steps
(`runtime.update.STREAMED_LOOKAHEAD`)."""
GiB = 2**30
BOUND_RESOURCES = {"compute": "GPU compute", "h2d": "PCIe H2D", "d2h": "PCIe D2H", "cpu_update": "the CPU update",
                   "nvme": "NVMe"}
"""The resources that may bind a step (`SimResult.bound`), as people call them."""
MEMORY_COMPONENTS = ("resident", "weights", "gradients", "optimizer step", "activations")
"""What GPU memory holds: the fixed part (embedding, head, allocator reserve, mask; with the
device update their and the resident layers' weights, masters and states), streamed weight
slots, gradients, the streamed GPU steps' slots and temporaries, activations (kept tensors,
checkpoints, working sets)."""


@dataclass(kw_only=True, slots=True)
class SimResult:
    """Predicted time and memory of one step (times in seconds, sizes in bytes)."""

    step_time_s: float
    tokens_per_s: float
    busy_s: dict[str, float]
    """Wall time each stream is busy (compute stretched by copy_slowdown included)."""
    exposed_s: dict[str, float]
    """Step time by what the critical path ran on: compute, or the stream compute waited on."""
    peak_gpu_bytes: int
    peak_gpu_stage: str
    peak_host_bytes: int
    """Host bytes the plan places at their peak: host-tier activations, and the streamed
    layers' gradient buffers where `CostTable.host_grads` is False."""
    peak_nvme_bytes: int
    stage_names: list[str]
    stage_start_s: list[float]
    """When each stage's compute started."""
    gpu_bytes_by_stage: list[int]
    peak_gpu_components: dict[str, float] = field(default_factory=dict)
    """The peak stage's GPU bytes by component (`MEMORY_COMPONENTS`; they add up to the peak)."""
    peak_host_components: dict[str, float] = field(default_factory=dict)
    """... the host's, of what the plan places there (activations; gradients where
    `CostTable.host_grads` is False): the model state's other parts are `memory.budget`'s."""
    timeline: list[tuple[str, float, float, str]]
    """(stream, start_s, end_s, label) of every op."""
    gpu_capacity_bytes: int = 0
    host_capacity_bytes: int = 0
    nvme_capacity_bytes: int = 0
    violations: list[str] = field(default_factory=list)
    """Capacities the plan exceeds (empty: the plan fits)."""

    @property
    def feasible(self) -> bool:
        return not self.violations

    def time_breakdown(self) -> dict[str, float]:
        """Where the step's time goes (seconds, adding up to the step): GPU compute (stretched
        while copies run), and what compute waited on: H2D and D2H copies (weights, activations,
        gradients, the streamed GPU steps' states), the CPU update, NVMe, and the rest (the
        streamed GPU steps, idle)."""
        e = self.exposed_s
        return {"compute": e["compute"], "h2d": e["h2d"] + e["h2d_opt"], "d2h": e["d2h"] + e["d2h_opt"],
                "cpu_update": e["cpu"], "nvme": e["nvme"], "other": e["gpu_opt"] + e["idle"]}

    def resource_busy_s(self) -> dict[str, float]:
        """Seconds each resource of `BOUND_RESOURCES` works in the step, exposed or hidden."""
        b = self.busy_s
        return {"compute": b["compute"], "h2d": b["h2d"] + b["h2d_opt"], "d2h": b["d2h"] + b["d2h_opt"],
                "cpu_update": b["cpu"], "nvme": b["nvme"]}

    @property
    def bound(self) -> str:
        """The resource that binds the step (`BOUND_RESOURCES`): the largest part of its
        critical path (`time_breakdown`). Compute: another plan gains little at this batch;
        PCIe or the CPU update: the step runs faster per token at a larger batch, whose compute
        grows and whose weight traffic and update do not (the overlapped update hides behind the
        next forward only: the backward needs the step's clip coefficient first)."""
        parts = self.time_breakdown()
        return max(BOUND_RESOURCES, key=parts.__getitem__)

    def metrics(self) -> dict[str, float]:
        """The prediction under the names the per-step metrics give the measured figures."""
        e = self.exposed_s
        return {
            "predicted_step_time_s": self.step_time_s,
            "predicted_gpu_compute_s": e["compute"],
            "predicted_exposed_h2d_s": e["h2d"] + e["h2d_opt"],
            "predicted_exposed_d2h_s": e["d2h"] + e["d2h_opt"],
            # the executor's trace sees no NVMe, CPU or streamed-step stream: their waits are GPU
            # idle without a copy
            "predicted_gpu_idle_other_s": e["cpu"] + e["nvme"] + e["gpu_opt"] + e["idle"],
            "predicted_peak_gpu_gb": self.peak_gpu_bytes / 1e9,
            "predicted_act_host_gb": self.peak_host_components.get("activations", 0.0) / 1e9,
            "predicted_act_nvme_gb": self.peak_nvme_bytes / 1e9,
        }


@dataclass(eq=False, slots=True)
class _Op:
    stream: str
    work: float
    """ms for compute and cpu, bytes for copies and NVMe."""
    label: str
    issue: int | None
    """Stage whose compute start this op waits for (None: ready at time 0)."""
    key: tuple = ()
    """Order on its stream."""
    after: list[_Op] = field(default_factory=list)
    nvme_write: bool = False
    start: float = math.nan
    end: float = math.nan
    left: float = 0.0


class _Stages:
    """Stage indices of a step with ``num_layers`` decoder layers."""

    def __init__(self, num_layers: int) -> None:
        self.L = num_layers
        self.embed = 0
        self.head = num_layers + 1
        self.embed_bwd = 2 * num_layers + 2
        self.optimizer = 2 * num_layers + 3

    def fwd(self, j: int) -> int:
        return 1 + j

    def bwd(self, j: int) -> int:
        return 2 * self.L + 1 - j

    def names(self) -> list[str]:
        return (
            ["embed"]
            + [f"fwd {j}" for j in range(self.L)]
            + ["head"]
            + [f"bwd {j}" for j in range(self.L - 1, -1, -1)]
            + ["embed bwd", "optimizer"]
        )


def units(plan: Plan) -> list[tuple[int, int]]:
    """Backward units as [start, end): a keep layer alone, or a checkpoint and its drop layers."""
    return plan.segments()


def simulate(plan: Plan, costs: CostTable, optimizer_overlap: bool | None = None,
             offload_window: int | None = None) -> SimResult:
    """Predict step time, stream usage and peak memories of ``plan`` on ``costs``.

    ``optimizer_overlap`` defaults to ``plan.notes["optimizer_overlap"]`` (False if absent).

    ``offload_window`` (default ``plan.offload_window``): stages a host-tier offload (its copy
    out, issued in the stage after its layer's) may take before a stage waits for it, its GPU
    memory counted through stage ``W - 1`` after its own (with 1, the block counts in its own
    stage only, the allocator reusing it once the copy is done), and never past the head: the
    MILP's model of `Plan.offload_window`, or a what-if (`bench/studies/offload_window.py`). NVMe-tier
    offloads, which a disk write follows, keep 1. The executor
    waits for no offload (its GPU block is reused once the copy is done), so its timing is
    nearer a long window; on the H200 (2026-12-05) a plan the model gave 0.333 s of exposed D2H
    at 1 measured 0.094 s.
    """
    if offload_window is None:
        offload_window = plan.offload_window
    if not is_offload_window(offload_window):
        raise ValueError(f"offload_window must be an integer >= 1, got {offload_window!r}")
    plan.check(costs.num_layers)
    if (plan.batch_size, plan.seq_len) != (costs.batch_size, costs.seq_len):
        raise ValueError(
            f"plan is for batch shape ({plan.batch_size}, {plan.seq_len}), the cost table for "
            f"({costs.batch_size}, {costs.seq_len}); use costs.at({plan.batch_size}, "
            f"{plan.seq_len})"
        )
    costs.check_const_update(plan.const_update)
    if optimizer_overlap is None:
        optimizer_overlap = bool(plan.notes.get("optimizer_overlap", False))
    step = _StepModel(plan, costs, optimizer_overlap, offload_window)
    return step.run()


class _StepModel:
    def __init__(self, plan: Plan, costs: CostTable, overlap: bool, offload_window: int = 1) -> None:
        self.plan, self.costs, self.overlap, self.window = plan, costs, overlap, offload_window
        self.device = plan.const_update == "device"
        self.resident = range(plan.device_layers)
        """Decoder layers resident on the GPU and stepped there (`Plan.device_layers`)."""
        self.dsteps = range(plan.device_layers, plan.device_layers + plan.device_steps)
        """Streamed decoder layers stepped on the GPU (`Plan.device_steps`)."""
        self.gpu_opt_ops: list[_Op] = []
        self.st = _Stages(costs.num_layers)
        self.compute: dict[int, _Op] = {}
        self.const_update: _Op | None = None
        """The embedding's and head's step on the GPU (``plan.const_update == "device"``)."""
        self.stage_begins: dict[int, _Op] = {}
        """Compute ops whose start marks a stage's issue where that is not the stage's own compute."""
        self.transfers: list[_Op] = []
        self.waits: dict[int, list[_Op]] = defaultdict(list)
        # buffers: (bytes, first stage, last stage, component); phases: (bytes, component), of
        # which each stage holds the largest
        self.gpu: list[tuple[int, int, int, str]] = []
        self.host: list[tuple[int, int, int, str]] = []
        self.nvme: list[tuple[int, int, int, str]] = []
        self.phases: dict[int, list[tuple[int, str]]] = defaultdict(list)
        self._build()

    # -- building ---------------------------------------------------------------------------

    def _copy(
        self,
        stream: str,
        nbytes: float,
        label: str,
        issue: int | None,
        *,
        prio: int = 0,
        order: int = 0,
        after: tuple[_Op | None, ...] = (),
        nvme_write: bool = False,
    ) -> _Op | None:
        if nbytes <= 0:
            return None
        op = _Op(
            stream=stream,
            work=float(nbytes),
            label=label,
            issue=issue,
            key=(-1 if issue is None else issue, order, prio, len(self.transfers)),
            after=[a for a in after if a is not None],
            nvme_write=nvme_write,
        )
        self.transfers.append(op)
        return op

    def _wait(self, stage: int, op: _Op | None) -> None:
        if op is not None:
            self.waits[stage].append(op)

    def _build(self) -> None:
        plan, c, st = self.plan, self.costs, self.st
        L, layers = c.num_layers, c.layers
        k = plan.weight_prefetch

        compute_ms = {st.embed: c.embed_forward_ms, st.head: c.head_ms}
        compute_ms.update({st.fwd(j): layers[j].forward_ms for j in range(L)})
        compute_ms[st.embed_bwd] = c.embed_backward_ms

        opt_ops: list[_Op | None] = [None] * L
        self.cpu_ops = []
        if self.device:
            self.const_update = _Op(stream="compute", work=c.device_update_ms(len(self.resident)),
                                    label="const update", issue=None)
        streamed = range(len(self.resident), L)
        on_cpu = range(self.dsteps.stop, L)
        stream_ins, stream_outs = self._streamed_steps()
        if self.overlap:
            for j, out in zip(self.dsteps, stream_outs):
                opt_ops[j] = out  # the forward's weights wait for the step's bytes out
            # the executor's order (`HostUpdater`): embedding, layers, final norm + head (the
            # layers only where those two are stepped on the GPU)
            ns = c.optimizer_ns_per_param * 1e-6
            for j in on_cpu:
                opt_ops[j] = _Op(stream="cpu", work=ns * layers[j].params, label=f"optim {j}", issue=None,
                                 key=(-1, 0, j, -1))
            self.cpu_ops = [opt_ops[j] for j in on_cpu]
            if self.device:
                # the GPU step is queued ahead of the embedding forward; the executor goes on at
                # once (layer 0's weights wait for its CPU step, not for the GPU)
                self.stage_begins[st.embed] = self.const_update
            else:
                self._host_const_update(ns)

        # Forward weights: slot for layer j is free once layer j-k-1 is done, i.e. when the
        # compute of stage fwd(j)-k starts.
        for j in range(L):
            if j in streamed:
                issue = max(st.embed, st.fwd(j) - k)
                op = self._copy(
                    "h2d", layers[j].weight_bytes, f"w {j}", issue, order=st.fwd(j), after=(opt_ops[j],)
                )
                self._wait(st.fwd(j), op)
                self.gpu.append((layers[j].weight_bytes, issue, st.fwd(j), "weights"))
            lp = plan.layers[j]
            # a kept layer's forward runs under autograd: its own transient beyond what it saves
            work = (layers[j].kept(lp.recompute).forward_work_bytes if lp.mode == "keep"
                    else layers[j].forward_work_bytes)
            self.phases[st.fwd(j)].append((work + (layers[j].input_bytes if lp.mode == "drop" else 0), "activations"))

        self.phases[st.embed].append((layers[0].input_bytes, "activations"))  # the embedding's output
        self.phases[st.head].append((layers[L - 1].input_bytes + c.head_work_bytes, "activations"))
        self.phases[st.embed_bwd].append((c.embed_backward_work_bytes, "activations"))

        for start, end in units(plan):
            self._unit(start, end, compute_ms)

        w_max = max(lc.weight_bytes for lc in layers)
        self.gpu.append((c.grad_buffers * w_max, st.bwd(L - 1), st.embed_bwd, "gradients"))
        for j in streamed:
            grad = layers[j].weight_bytes * c.grad_share
            if plan.layers[j].grad == "gpu":
                self.gpu.append((grad, st.bwd(j), st.embed_bwd, "gradients"))
                if self.overlap:  # until its update, before its next forward
                    self.gpu.append((grad, st.embed, max(st.embed, st.fwd(j) - 1), "gradients"))
                continue
            if not c.host_grads:
                self.host.append((grad, 0, st.embed_bwd, "gradients"))
            issue = st.bwd(j) + 1
            op = self._copy("d2h", grad, f"grad {j}", issue)
            self._wait(issue + 1, op)
        for j in self.resident:
            self.gpu.append((layers[j].weight_bytes * c.grad_share, st.bwd(j), st.embed_bwd, "gradients"))
        if not self.device:
            self._wait(
                st.embed_bwd + 1,
                self._copy("d2h", c.const_grad_bytes * c.grad_share, "grad embed/head", st.embed_bwd),
            )
        else:
            # their gradients (and the resident layers') wait on the GPU for the next step's
            # update, which runs before the embedding's output exists
            self.phases[st.embed].append((c.const_grad_bytes + self._resident_grad_bytes(), "gradients"))

        for stage, ms in compute_ms.items():
            self.compute[stage] = _Op(
                stream="compute", work=ms, label=self.st.names()[stage], issue=None, key=(stage,)
            )
        if not self.overlap:
            cpu_params = sum(layers[j].params for j in on_cpu) + (0 if self.device else c.const_params)
            optimizer = _Op(
                stream="cpu",
                work=c.optimizer_ns_per_param * cpu_params * 1e-6,
                label="optimizer",
                issue=None,
                key=(st.optimizer,),
            )
            optimizer.after = [self.compute[st.embed_bwd]] + [
                op for op in self.transfers if op.stream == "d2h"
            ]
            self.cpu_ops = [optimizer]
            for op in stream_ins:  # queued once the CPU step returns (`HostUpdater.start`)
                op.after.append(optimizer)
            if self.device:
                # queued on the compute stream once the CPU step returns (`HostUpdater.start`)
                self.const_update.after = [optimizer]
            else:
                upload = self._copy(
                    "h2d", c.const_weight_bytes, "w embed/head", None, after=(optimizer,)
                )
                if upload is not None:
                    upload.key = (st.optimizer, 0, 0, 0)

    def _resident_grad_bytes(self) -> float:
        return sum(self.costs.layers[j].weight_bytes for j in self.resident) * self.costs.grad_share

    def _streamed_steps(self) -> tuple[list[_Op], list[_Op]]:
        """In, step, out for each `Plan.device_steps` layer from the step's start, two at a time
        (a slot is free once its previous layer's bytes are out): (copies in, copies out)."""
        c, st = self.costs, self.st
        ins, outs = [], []
        for n, j in enumerate(self.dsteps):
            slot_free = outs[n - STREAMED_STEP_SLOTS] if n >= STREAMED_STEP_SLOTS else None
            # queued by the executor as the forward goes: the first ones as the step starts,
            # then each with the weight copy STREAMED_LOOKAHEAD layers before it
            ahead = j - STREAMED_LOOKAHEAD
            issue = None if ahead < self.dsteps.start else max(st.embed, st.fwd(ahead) - self.plan.weight_prefetch)
            held = c.layers[j].weight_bytes * c.grad_share if self.plan.layers[j].grad == "gpu" else 0.0
            up = self._copy("h2d_opt", c.streamed_in_bytes(j) - held, f"state {j} in", issue, order=j,
                            after=(slot_free,))
            step = _Op(stream="gpu_opt", work=c.streamed_step_ms(j), label=f"step {j}", issue=None,
                       key=(-1, 0, j, -1), after=[up])
            self.gpu_opt_ops.append(step)
            outs.append(self._copy("d2h_opt", c.streamed_out_bytes(j), f"state {j} out", None, order=j,
                                   after=(step,)))
            ins.append(up)
        if self.dsteps:
            slots = min(STREAMED_STEP_SLOTS, len(self.dsteps))
            largest = max(c.streamed_in_bytes(j) for j in self.dsteps)
            # and the step's temporaries, on its own stream, while the steps run
            self.gpu.append((slots * largest + c.device_step_work_bytes, st.embed, st.fwd(self.dsteps.stop - 1),
                             "optimizer step"))
        return ins, outs

    def _host_const_update(self, ns: float) -> None:
        """The overlapped CPU step of the embedding (before the layers') and of the final norm +
        head (after them), each group's weights uploaded after its step and before its stage."""
        c, st, L = self.costs, self.st, self.costs.num_layers
        (first_params, first_bytes), (head_params, head_bytes) = c.const_split()
        opt_const = _Op(
            stream="cpu",
            work=ns * first_params,
            label="optim embed" if head_params else "optim embed/head",
            issue=None,
            key=(-1, 0, -1, -1),
        )
        self.cpu_ops.append(opt_const)
        const_upload = self._copy(
            "h2d", first_bytes, "w embed" if head_params else "w embed/head", None, after=(opt_const,)
        )
        self._wait(st.embed, const_upload)
        if head_params:
            opt_head = _Op(stream="cpu", work=ns * head_params, label="optim head", issue=None,
                           key=(-1, 0, L, -1))
            self.cpu_ops.append(opt_head)
            # copied when the executor reaches the head (after the last forward is issued)
            head_upload = self._copy("h2d", head_bytes, "w head", st.fwd(L - 1), order=st.head,
                                     after=(opt_head,))
            self._wait(st.head, head_upload)

    def _unit(self, start: int, end: int, compute_ms: dict[int, float]) -> None:
        """Backward of layers [start, end): a keep layer, or a checkpoint and its drops."""
        plan, c, st = self.plan, self.costs, self.st
        layers = c.layers
        lp = plan.layers[start]
        first = st.bwd(end - 1)
        keep = lp.mode == "keep"

        # a kept layer may recompute one block in its backward: it keeps fewer bytes
        kept = layers[start].kept(lp.recompute) if keep else None
        for j in range(start, end):
            if keep:
                ms = layers[j].backward_ms + kept.recompute_ms
                self.phases[st.bwd(j)].append((kept.saved_bytes + kept.backward_work_bytes, "activations"))
            else:
                ms = layers[j].backward_ms + layers[j].recompute_ms
                self.phases[st.bwd(j)].append((layers[j].saved_bytes + layers[j].backward_work_bytes, "activations"))
            compute_ms[st.bwd(j)] = ms

        if end - start >= 2:
            # Segment: the first stage re-runs (no grad) start..end-2 to rebuild their inputs,
            # which stay on the GPU (segment cache) until each layer's own backward.
            compute_ms[first] += sum(layers[j].forward_ms for j in range(start, end - 1))
            cache = [layers[j].input_bytes for j in range(start + 1, end - 1)]
            self.phases[first] = [
                (sum(cache) + layers[end - 1].saved_bytes + layers[end - 1].backward_work_bytes, "activations")
            ]
            for j in range(start, end - 1):
                built = sum(layers[i].input_bytes for i in range(start + 1, j + 1))
                self.phases[first].append((built + layers[j].forward_work_bytes, "activations"))
            for j in range(start + 1, end - 2):
                self.gpu.append((layers[j].input_bytes, first + 1, st.bwd(j) - 1, "activations"))

        issue_w = max(st.head, first - plan.weight_prefetch)
        for j in range(max(start, len(self.resident)), end):
            op = self._copy("h2d", layers[j].weight_bytes, f"w {j} bwd", issue_w, order=first)
            self._wait(first, op)
            self.gpu.append((layers[j].weight_bytes, issue_w, st.bwd(j), "weights"))

        nbytes = kept.saved_bytes if keep else layers[start].input_bytes
        what = "acts" if keep else "ckpt"
        fwd = st.fwd(start)
        last_gpu = st.bwd(start) - 1
        if lp.tier == "gpu":
            self.gpu.append((nbytes, fwd, last_gpu, "activations"))
            return
        # the GPU copy is freed in its own stage, once the layer's forward is queued (the copy
        # out, on the D2H stream, keeps the block from reuse until it is done); a host-tier copy
        # may take up to the window's stages, never past the head, the block counted through
        # all but the last
        window = min(self.window, st.head - fwd) if lp.tier == "host" else 1
        self.gpu.append((nbytes, fwd, fwd + window - 1, "activations"))
        out = self._copy("d2h", nbytes, f"{what} {start}", fwd + 1, order=fwd)
        self._wait(fwd + 1 + window, out)
        if lp.tier == "host":
            fetch_at = max(first - lp.prefetch, st.head, fwd + 1)
            self.host.append((nbytes, fwd + 1, fetch_at, "activations"))
            fetch = self._copy(
                "h2d", nbytes, f"{what} {start}", fetch_at, prio=1, order=first, after=(out,)
            )
        else:
            write_at = fwd + 2
            fetch_at = max(first - lp.prefetch, st.head, write_at)
            if fetch_at >= first:
                raise ValueError(
                    f"layer {start}: tier 'nvme' is too close to the end of the forward for its "
                    "tensors to reach the disk and come back before backward needs them; use "
                    "tier 'host' or 'gpu' for this layer"
                )
            write = self._copy(
                "nvme",
                nbytes,
                f"write {what} {start}",
                write_at,
                order=fwd,
                after=(out,),
                nvme_write=True,
            )
            self._wait(write_at + 1, write)
            read_at = max(fetch_at - 1, write_at)
            self.nvme.append((nbytes, write_at, read_at, "activations"))
            read = self._copy(
                "nvme", nbytes, f"read {what} {start}", read_at, prio=1, order=first, after=(write,)
            )
            if read_at < fetch_at:
                self._wait(fetch_at, read)
            fetch = self._copy(
                "h2d", nbytes, f"{what} {start}", fetch_at, prio=1, order=first, after=(read,)
            )
        self._wait(first, fetch)
        self.gpu.append((nbytes, fetch_at, last_gpu, "activations"))

    # -- running ----------------------------------------------------------------------------

    def _rate(self, op: _Op, active: dict[str, _Op]) -> float:
        """Work per millisecond of ``op`` given the other active ops."""
        c = self.costs
        if op.stream == "compute":
            copying = any(s in active for s in (*_H2D, *_D2H))
            return 1.0 / c.copy_slowdown if copying else 1.0
        if op.stream in ("cpu", "gpu_opt"):
            return 1.0
        if op.stream == "nvme":
            return (c.nvme_write_gbps if op.nvme_write else c.nvme_read_gbps) * 1e6
        same, other = (_H2D, _D2H) if op.stream in _H2D else (_D2H, _H2D)
        sharing = sum(s in active for s in same)  # copies one way share its bandwidth
        if any(s in active for s in other):
            return c.bidir_gbps * 1e6 / sharing
        return (c.h2d_gbps if op.stream in _H2D else c.d2h_gbps) * 1e6 / sharing

    def _schedule(self) -> list[_Op]:
        queues: dict[str, list[_Op]] = {s: [] for s in STREAMS}
        for stage in sorted(self.compute):
            op = self.compute[stage]
            op.after = op.after + self.waits.get(stage, [])
            queues["compute"].append(op)
        if self.const_update is not None:
            # with the overlap ahead of the embedding, else after the CPU step at the end
            at = 0 if self.overlap else len(queues["compute"])
            queues["compute"].insert(at, self.const_update)
        for op in sorted(self.transfers, key=lambda o: o.key):
            queues[op.stream].append(op)
        queues["cpu"] = sorted(self.cpu_ops, key=lambda o: o.key)
        queues["gpu_opt"] = sorted(self.gpu_opt_ops, key=lambda o: o.key)
        all_ops = [op for q in queues.values() for op in q]
        for op in all_ops:
            op.left = op.work
        head = {s: 0 for s in STREAMS}
        active: dict[str, _Op] = {}
        t = 0.0
        done = 0
        while done < len(all_ops):
            started = True
            while started:
                started = False
                for s in STREAMS:
                    if s in active or head[s] >= len(queues[s]):
                        continue
                    op = queues[s][head[s]]
                    if op.issue is not None and math.isnan(
                        self.stage_begins.get(op.issue, self.compute[op.issue]).start
                    ):
                        continue
                    if any(math.isnan(a.end) for a in op.after):
                        continue
                    op.start = t
                    head[s] += 1
                    if op.left <= 0:
                        op.end = t
                        done += 1
                    else:
                        active[s] = op
                    started = True
            if not active:
                if done < len(all_ops):
                    stuck = [queues[s][head[s]].label for s in STREAMS if head[s] < len(queues[s])]
                    raise RuntimeError(f"step model deadlocked at {t:.3f} ms waiting in {stuck}")
                break
            rates = {s: self._rate(op, active) for s, op in active.items()}
            dt = min(op.left / rates[s] for s, op in active.items())
            t += dt
            for s in list(active):
                op = active[s]
                op.left -= rates[s] * dt
                if op.left <= 1e-9 * max(op.work, 1.0):
                    op.left = 0.0
                    op.end = t
                    del active[s]
                    done += 1
        return all_ops

    def _exposure(self, ops: list[_Op], step_ms: float) -> dict[str, float]:
        """Split the step along its critical path: compute time, and what compute waited on."""
        exposed = dict.fromkeys(STREAMS, 0.0)
        exposed["idle"] = 0.0
        prev_on_stream: dict[int, _Op] = {}
        by_stream: dict[str, list[_Op]] = defaultdict(list)
        for op in ops:
            by_stream[op.stream].append(op)
        for q in by_stream.values():
            q.sort(key=lambda o: o.start)
            for a, b in itertools.pairwise(q):
                prev_on_stream[id(b)] = a

        def blame(lo: float, hi: float, op: _Op) -> None:
            # [lo, hi] ends inside op: op's stream gets the part op ran, the rest goes to
            # whatever op waited for (a dependency, or the op before it on its stream).
            while hi - lo > 1e-12:
                begin = max(lo, op.start)
                exposed[op.stream] += hi - begin
                if begin <= lo:
                    return
                hi = begin
                preds = list(op.after)
                if id(op) in prev_on_stream:
                    preds.append(prev_on_stream[id(op)])
                preds = [p for p in preds if p.end <= hi + 1e-9 * max(hi, 1.0)]
                if not preds:
                    exposed["idle"] += hi - lo
                    return
                op = max(preds, key=lambda p: p.end)
                if op.end < hi:
                    exposed["idle"] += hi - max(op.end, lo)
                    hi = op.end

        compute = sorted((op for op in ops if op.stream == "compute"), key=lambda o: o.start)
        t = 0.0
        for op in compute:
            if op.start > t:
                preds = [p for p in op.after if p.end <= op.start + 1e-9 * max(op.start, 1.0)]
                if preds:
                    blame(t, op.start, max(preds, key=lambda p: p.end))
                else:
                    exposed["idle"] += op.start - t
            exposed["compute"] += op.end - op.start
            t = op.end
        if step_ms > t:
            blame(t, step_ms, max(ops, key=lambda o: o.end))
        return exposed

    def _memory(self) -> tuple[list[dict[str, float]], list[dict[str, float]], list[dict[str, float]]]:
        """Per stage, GPU, host and NVMe bytes by component (`MEMORY_COMPONENTS`)."""
        n = self.st.embed_bwd + 1
        c = self.costs
        gpu: list[dict[str, float]] = [defaultdict(float) for _ in range(n)]
        host: list[dict[str, float]] = [defaultdict(float) for _ in range(n)]
        nvme: list[dict[str, float]] = [defaultdict(float) for _ in range(n)]
        device = c.const_update_bytes + c.device_resident_bytes(len(self.resident)) if self.device else 0
        for s in range(n):
            # the embedding's and the head's gradients exist from the head on
            gpu[s]["resident"] += (c.forward_fixed_bytes if s <= self.st.head else c.step_fixed_bytes) + device
            nbytes, component = max(self.phases.get(s, [(0, "activations")]), key=lambda phase: phase[0])
            gpu[s][component] += nbytes
        for buffers, out in ((self.gpu, gpu), (self.host, host), (self.nvme, nvme)):
            for nbytes, first, last, component in buffers:
                for s in range(first, last + 1):
                    out[s][component] += nbytes
        return gpu, host, nvme

    def run(self) -> SimResult:
        ops = self._schedule()
        step_ms = max(op.end for op in ops)
        busy = dict.fromkeys(STREAMS, 0.0)
        for op in ops:
            busy[op.stream] += (op.end - op.start) * 1e-3
        exposed = {k: v * 1e-3 for k, v in self._exposure(ops, step_ms).items()}
        gpu_parts, host_parts, nvme_parts = self._memory()
        gpu, host, nvme = ([sum(parts.values()) for parts in stages] for stages in (gpu_parts, host_parts, nvme_parts))
        names = self.st.names()
        peak_stage = max(range(len(gpu)), key=gpu.__getitem__)
        host_peak = max(range(len(host)), key=host.__getitem__)
        c = self.costs
        violations = []
        for tier, peak, cap in (
            ("GPU", max(gpu), c.gpu_bytes),
            ("host", max(host), c.host_bytes),
            ("NVMe", max(nvme), c.nvme_bytes),
        ):
            if peak > cap:
                violations.append(
                    f"{tier} memory: plan needs {peak / GiB:.2f} GiB, {cap / GiB:.2f} GiB available"
                )
        step_s = step_ms * 1e-3
        stages = sorted(self.compute)
        return SimResult(
            step_time_s=step_s,
            tokens_per_s=c.tokens / step_s if step_s > 0 else math.inf,
            busy_s=busy,
            exposed_s=exposed,
            peak_gpu_bytes=max(gpu),
            peak_gpu_stage=names[peak_stage],
            peak_host_bytes=max(host),
            peak_nvme_bytes=max(nvme),
            stage_names=[names[s] for s in stages],
            stage_start_s=[self.compute[s].start * 1e-3 for s in stages],
            gpu_bytes_by_stage=gpu,
            peak_gpu_components=dict(gpu_parts[peak_stage]),
            peak_host_components=dict(host_parts[host_peak]),
            timeline=[
                (op.stream, op.start * 1e-3, op.end * 1e-3, op.label)
                for op in sorted(ops, key=lambda o: (o.start, STREAMS.index(o.stream)))
                if op.end > op.start
            ],
            gpu_capacity_bytes=c.gpu_bytes,
            host_capacity_bytes=c.host_bytes,
            nvme_capacity_bytes=c.nvme_bytes,
            violations=violations,
        )

"""One training step (forward, loss, backward) of a streamed model under a `Plan`.

Data flow (DESIGN.md section 1): the embedding and the final norm + LM head stay resident on
the GPU; decoder layers stream through GPU weight slots (``WeightStreamer``). Each layer is
called through the stateless HF layer template of its type whose parameters are views of the
slot (a hybrid stack has one template per layer type, and slots the size of the largest layer).

Per layer the plan says what survives from forward to backward:

- ``keep``: the layer runs with autograd; its saved tensors go through
  ``saved_tensors_hooks``. Saved *weights* are replaced by a reference (offset, size,
  stride) into the slot, so backward reads them from whichever slot holds the layer then
  and the slot can be reused in between. Saved activations go to the plan's tier, each
  storage once however many ops save it; a memory-lean norm's output is not stored but
  recomputed from the norm's input (``model.lean``). With ``LayerPlan.recompute`` (mlp |
  attention) that block keeps only its inputs (its weights among them, as slot references) and
  is re-run inside the layer's backward (``model.sublayer``), on the weights of the backward's
  slot; with ``mlp_up`` the MLP's up projection is.
- ``checkpoint``: the layer input is stored on the plan's tier and the layer runs without
  autograd; backward re-runs it with autograd.
- ``drop``: nothing is stored; backward re-runs the segment from its checkpoint without
  autograd to rebuild the inputs (the segment cache), using the same weight copies that
  backward then uses, so each layer's weights cross PCIe at most twice per step.

Packed batches (several samples per row) pass ``document_ids`` and ``position_ids``: the
layers' masks keep attention within each sample (``ModelAdapter.layer_masks``) and rotary uses
the positions, which restart per sample; the loss is the same sum over target tokens divided by
the same count, so each sample's contribution is what it is unpacked.

With ``plan.const_update == "device"`` the resident groups (embedding, final norm + head, and
the plan's first ``device_layers`` decoder layers, which are then resident too and not
streamed) are stepped on the GPU (`runtime.update`): their gradients stay there
(``device_grads``, the head's accumulated straight into its flat buffer) instead of going to
the host, and the step writes their resident weights, which are then never copied in again.
The plan's ``device_steps`` layers after them (``streamed_steps``) are streamed like the rest;
the optimizer steps them on the GPU with their states copied in.

Gradients of streamed layers go where the plan says (`LayerPlan.grad`): ``host``, copied in the
backward to the layer's pinned host buffer; ``gpu`` (``held_grads``), kept on the GPU as one
flat buffer of the layer's group in the compute dtype (``device_grads``), no D2H in the backward,
until the update steps it there (a ``device_steps`` layer) or copies it home through a small
pinned ring for the CPU worker (`runtime.update`). A held gradient costs GPU memory from its
backward to its update and saves the layer's host buffer (`HostStore.allocate_grads`: a
store whose buffers wait for the plan gets them from the first plan that runs a step, the
trainer's first; a later plan that sends to the host a gradient without a buffer is refused).
Either way its squared norm is taken in the backward, so clipping is unchanged, and the same
gradient bits reach the same step.

Mixture-of-experts models with the router's load-balancing loss (`lazytrain.model.moe.Routing`):
the step's forward collects every layer's routing of the real tokens, the loss term is known
once the last layer has run (`_forward`) and added once to the step's loss (`_finish_step`),
and its gradient, a constant of the step, is added inside each layer's backward, however the
plan runs it (kept graph, checkpoint re-run, block recompute); re-runs collect nothing.

The LM head and cross-entropy run on chunks of the target tokens only (prompt and padding
positions never reach the head), with backward per chunk, so the full logits never exist. Each
host-buffered gradient is copied to its pinned host buffer on the D2H stream, and every
gradient's squared norm is accumulated on the GPU, so clipping needs no pass over host
gradients. The host reads two numbers per step: the loss and the gradient norm.

Data parallel (``parallel``, see ``runtime.distributed``): the same step on this rank's rows;
the loss is divided by the global target count, each group's gradient is reduce-scattered
before the D2H copy (the host buffer holds this rank's shard), and the loss and squared norm
are summed over ranks. A gradient the plan holds on the GPU is this rank's reduce-scattered
shard, held until the update.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.autograd.graph import saved_tensors_hooks

from lazytrain.memory.host_store import HostStore
from lazytrain.memory.nvme import NvmeStore
from lazytrain.model import sublayer
from lazytrain.model.adapter import ModelAdapter, mask_tensors, right_padded
from lazytrain.model.lean import Recomputed, recomputed_read, saved_recipe
from lazytrain.plan.plan import Plan, PlanError
from lazytrain.runtime.activations import ActivationStore, Handle
from lazytrain.runtime.distributed import DataParallel
from lazytrain.runtime.streams import Streams, StreamTrace
from lazytrain.runtime.weights import WeightStreamer


@dataclass(slots=True)
class StepStats:
    loss: float
    grad_norm: float
    num_tokens: int
    """Real (non-pad) tokens of the global batch."""
    num_target_tokens: int
    num_slots: int
    """Token slots of the global batch, padding included."""
    h2d_weight_bytes: int
    peak_activation_bytes: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class _WeightRef:
    """A saved tensor that is a view of layer ``layer``'s weight slot."""

    layer: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclass(frozen=True, slots=True)
class _StoredRef:
    """A saved tensor as a view of a storage the activation store holds (``handle``)."""

    handle: Handle
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclass(frozen=True, slots=True)
class _RecomputedRef:
    """A saved tensor as a view of a value recomputed in backward (a lean norm's output)."""

    state: Recomputed
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclass(frozen=True, slots=True)
class _ConstRef:
    """A saved tensor viewing one that lives for the whole step (rotary cos/sin, mask)."""

    index: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclass(slots=True, eq=False)
class _StepState:
    """What the pieces of one step (`Executor._forward`, `_head`, `_backward`) hand each other.
    A piece lets go of a tensor (sets its field to None) where the step is done with it: held
    longer, it would sit in stages the simulator prices without it."""

    ids: torch.Tensor
    """The input ids, on the device."""
    valid: torch.Tensor
    """The flat positions with a target (the head's rows)."""
    targets: torch.Tensor
    num_targets: int
    """This rank's target tokens."""
    global_targets: int
    """The global batch's target tokens: the loss's denominator."""
    global_tokens: int
    global_slots: int
    mask: dict
    """Per layer type, its mask (`ModelAdapter.layer_masks`)."""
    rope: tuple[torch.Tensor, torch.Tensor]
    embed_leaf: dict[str, torch.Tensor] | None = None
    """The embedding's weights (a tied head's too)."""
    saved: list = field(default_factory=list)
    """Per layer, what its backward needs: a keep layer's (input, output, weights, stored
    handles), a checkpoint's stored input; None once its backward is done."""
    hidden: torch.Tensor | None = None
    """The last layer's output, from the forward to the head."""
    grad: torch.Tensor | None = None
    """The gradient of the hidden state, from the head back to the embedding."""
    head_grad: torch.Tensor | None = None
    """A tied head's weight gradient, added to the embedding's (None when untied)."""
    loss_sum: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None
    """The router's load-balancing loss term (``router_aux_loss_coef * aux``, global), known
    after the forward; None without one (`lazytrain.model.moe.Routing`)."""


def chunk_loss_and_grad(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                        denominator: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy of ``x @ weight.T`` against ``targets`` (summed, / ``denominator``) and its
    gradient with respect to the logits, in ``weight``'s dtype.

    Autograd's linear + fp32 cross-entropy held 16 bytes per logit at its peak (the logits, their
    fp32 copy, the fp32 log-softmax it saves and its fp32 gradient, and that gradient rounded);
    here the fp32 logits are turned into the gradient in place (softmax minus the one-hot
    target), 6 bytes per logit at the peak: at Qwen3.5's 248,320-token vocab and 4,096-token
    chunks, 6.1 GB instead of 16.3. The same math in fp32, one rounding of the gradient.
    """
    with torch.no_grad():
        logits = F.linear(x, weight).float()
        # logsumexp holds a temporary the size of its input: a block of rows at a time
        lse = torch.cat([torch.logsumexp(logits[r : r + 256], dim=-1) for r in range(0, len(logits), 256)])
        loss = (lse - logits.gather(1, targets[:, None]).squeeze(1)).sum() / denominator
        probs = logits.sub_(lse[:, None]).exp_()
        probs[torch.arange(len(targets), device=targets.device), targets] -= 1.0
        return loss, probs.mul_(1.0 / denominator).to(weight.dtype)


def held_grad_groups(plan: Plan) -> frozenset[int]:
    """The groups (layer i: group i + 1) of the streamed layers whose gradients ``plan`` holds
    on the GPU from their backward to the update (`LayerPlan.grad`; the resident device layers
    hold theirs whatever it says: `Executor.device_groups`)."""
    return frozenset(i + 1 for i, lp in enumerate(plan.layers) if lp.grad == "gpu" and i >= plan.device_layers)


def host_grad_groups(plan: Plan, num_groups: int) -> frozenset[int]:
    """The groups given a host gradient buffer when ``plan`` is the first to run
    (`HostStore.allocate_grads`): all but the streamed layers it holds on the GPU and its
    resident layers, whose gradients never leave the GPU (the planner counts no host buffer for
    them; until 2026-12-07 they had one: on the Qwen3.6-27B estimate for an H200 with a 118 GiB
    host budget, 47 resident layers' buffers, 33 GiB the plan's host room did not have). A
    later plan that streams one of those layers holds its gradient on the GPU
    (`Planner.hold_gradients`), as it was while resident. The embedding and head keep theirs
    even when the plan steps them on the GPU: a re-plan may step them on the CPU
    (``const_update=host``)."""
    resident = frozenset(range(1, plan.device_layers + 1))
    return frozenset(range(num_groups)) - held_grad_groups(plan) - resident


class Executor:
    """Runs forward + backward of one batch under ``plan``; the optimizer is separate."""

    def __init__(
        self,
        adapter: ModelAdapter,
        store: HostStore,
        plan: Plan,
        device: torch.device,
        before_load: Callable[[int], None] | None = None,
        nvme: NvmeStore | None = None,
        parallel: DataParallel | None = None,
        fetch_allocation: str = "compute",
    ):
        """``fetch_allocation``: the GPU memory pool of activations fetched back from the host or
        NVMe tier (`ActivationStore`)."""
        plan.check(adapter.num_layers)
        if plan.const_update == "device" and parallel is not None:
            raise ValueError(
                "plan const_update='device' steps the embedding and head on this GPU, which a data-parallel "
                "run (whose ranks each hold a shard of them) does not do; plan with const_update=host"
            )
        for i, lp in enumerate(plan.layers):
            if lp.mode == "keep":
                sublayer.check_option(adapter.templates[adapter.layer_types[i]], adapter.layer_types[i], lp.recompute)
        self.parallel = parallel
        """Data parallel: ``store`` is then a ``ShardedHostStore`` (gradients are shards)."""
        self.adapter = adapter
        self.store = store
        self.plan = plan
        self.device = device
        self.dtype = store.dtype
        self.streams = Streams(device)
        self.trace = StreamTrace(self.streams)
        self.stage_memory: list[tuple[str, int]] | None = None
        """Set to a list to record, per stage of the next steps, the peak bytes allocated (the
        simulator's stage names: ``embed``, ``fwd j``, ``head``, ``bwd j``, ``embed bwd``), to
        set against `SimResult.gpu_bytes_by_stage`. CUDA: the allocator's peak, reset at each
        stage's end (so ``max_memory_allocated`` then covers the last stage only)."""
        self.memory_probe: Callable[[], int] | None = None
        """What a stage's peak is read from (default on CUDA: the allocator's peak since the
        last reset, then reset); a test sets its own."""
        """Set ``trace.enabled`` to time compute and copies per step (benchmarks)."""
        self.num_groups = len(adapter.layouts)
        self.before_load = before_load
        """Called with a group index before its host weights are copied to the GPU (the
        optimizer may still be writing them)."""
        self.step_started: Callable[[], None] | None = None
        """Called once a step's inputs are queued to the GPU, before any layer's weights are
        (`HostUpdater` queues its first streamed GPU steps then)."""
        num_slots = plan.max_segment() + plan.weight_prefetch
        self.weights = WeightStreamer(
            host_weights=store.weights[1 : 1 + adapter.num_layers],
            num_slots=max(num_slots, 2),
            depth=plan.weight_prefetch,
            streams=self.streams,
            device=device,
            before_load=self._before_layer_load,
            trace=self.trace,
        )
        self.activations = ActivationStore(self.streams, device, self.trace, nvme, fetch_allocation)
        # Resident groups: the embedding (group 0), the final norm + head (last group) and the
        # plan's device layers (groups 1 .. device_layers), which are not streamed
        self.resident = {
            g: torch.empty(store.weights[g].numel(), dtype=self.dtype, device=device)
            for g in (0, *range(1, 1 + plan.device_layers), self.num_groups - 1)
        }
        self._resident_version = {g: -1 for g in self.resident}
        self.device_groups = frozenset(self.resident) if plan.const_update == "device" else frozenset()
        """Groups stepped on the GPU (`Plan.const_update`, `Plan.device_layers`): their resident
        weights are the ones the optimizer writes."""
        first = 1 + plan.device_layers
        self.streamed_steps = (frozenset(range(first, first + plan.device_steps)) if plan.const_update == "device"
                               else frozenset())
        """Streamed layers' groups stepped on the GPU, their states copied in and out
        (`Plan.device_steps`, `HostUpdater`)."""
        self.held_grads = held_grad_groups(plan)
        """Streamed layers' groups whose gradients stay on the GPU until the update
        (`LayerPlan.grad="gpu"`), in ``device_grads``."""
        self._check_grad_places()
        self.device_grads: dict[int, torch.Tensor] = {}
        """The last step's flat gradients of ``device_groups`` and ``held_grads``, until the
        optimizer (`HostUpdater.start`) takes them."""
        self.weight_version = [0] * self.num_groups
        self.grad_ready: list[torch.cuda.Event | None] = [None] * self.num_groups
        self.grad_norm_sq = torch.zeros(self.num_groups, dtype=torch.float32, device=device)
        self._bwd_slot: dict[int, torch.Tensor] = {}
        self._consts: list[torch.Tensor] = []
        self._reads_left: dict[int, int] = {}
        """Per stored storage of a keep layer (by its handle's id): saved tensors of it that
        backward has not read yet."""

    def _check_grad_places(self) -> None:
        """Refuse a plan that sends a gradient to the host where the store has no buffer for it
        (`HostStore.host_grad_groups`)."""
        buffered = self.store.host_grad_groups
        if buffered is None:  # allocated for this plan at its first step
            return
        missing = [g for g in range(self.num_groups) if g not in buffered | self.held_grads | self.device_groups]
        if missing:
            names = [f"layer {g - 1}" if 0 < g <= self.adapter.num_layers else self.adapter.layouts[g].name
                     for g in missing]
            raise PlanError(
                f"the plan sends the gradients of {', '.join(names)} to the host (grad='host'), where they have no "
                f"buffer: the first plan held them on the GPU and host buffers are allocated once (the store has "
                f"them for groups {sorted(buffered)}); plan grad='gpu' for those layers (the planner keeps to "
                "HostStore.host_grad_groups)")

    # -- weights --------------------------------------------------------------------------

    def _before_layer_load(self, layer: int) -> None:
        if self.before_load is not None:
            self.before_load(layer + 1)

    def abandon(self) -> None:
        """Let go of the GPU buffers this executor owns for the whole step (the weight slots,
        the resident groups, the step's constants), for one given up after a failed step; it
        cannot run a step afterwards. Something may still refer to the executor itself: on
        CUDA, plausibly the failed backward's graph, whose saved-tensor hooks refer to it, on
        the autograd engine's device thread (the H200's 9B retries of 2026-12-02 each started
        5.0 GB above their first try, what the last executor's resident groups, 4.07 GB, and
        its two weight slots hold). Dropped here, those bytes go whoever holds the executor, and
        so do the activation store's pinned host buffers."""
        self.weights.slots = []
        self.resident = {}
        self.device_grads = {}
        self._consts = []
        self._bwd_slot = {}
        self.activations.close()  # and its pinned host buffers

    def weights_updated(self, group: int) -> None:
        """The optimizer wrote new weights for ``group`` into the host buffer."""
        self.weight_version[group] += 1

    def _resident_weights(self, group: int) -> torch.Tensor:
        if self._resident_version[group] != self.weight_version[group]:
            if self.before_load is not None:
                self.before_load(group)
            span = self.trace.begin(self.streams.h2d)
            with self.streams.on(self.streams.h2d):
                self.resident[group].copy_(self.store.weights[group], non_blocking=True)
            self.trace.end("h2d", span, self.streams.h2d)
            self.streams.wait(self.streams.record(self.streams.h2d))
            self._resident_version[group] = self.weight_version[group]
        return self.resident[group]

    def _schedule(self) -> list[int]:
        """The streamed layers' uses in order (the device layers are resident, not streamed)."""
        forward = list(range(self.adapter.num_layers))
        backward = []
        for start, end in reversed(self.plan.segments()):
            backward.extend(range(start, end))
        return [i for i in forward + backward if i >= self.plan.device_layers]

    def _acquire(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s flat weights on the GPU: its resident copy, or a streamed slot."""
        if layer < self.plan.device_layers:
            return self._resident_weights(layer + 1)
        return self.weights.acquire(layer)

    def _release(self, layer: int) -> None:
        if layer >= self.plan.device_layers:
            self.weights.release(layer)

    # -- saved-tensor hooks for "keep" layers --------------------------------------------

    def _pack_hook(self, layer: int, slot: torch.Tensor, tier: str, handles: list[Handle],
                   stored: dict):
        """The saved-tensor pack hook of a keep layer's forward. ``stored``: each storage is
        stored once per layer, however many ops save it or views of it (the q/k/v projections
        all save the normed input): what the profiler counts. An entry holds the GPU storage,
        so its address is not reused for another tensor during the forward; the caller clears
        ``stored`` after it (autograd keeps a pack hook, and all it refers to, as long as the
        graph: an entry left there would keep an offloaded tensor's GPU copy until backward).
        A lean norm's output (`lean.saved_recipe`) is not stored: its inputs are (the norm's
        own input, stored for its backward anyway, and its weight), and `_unpack` recomputes
        it once for all the nodes that read it (``stored`` has its `Recomputed` by recipe)."""
        slot_ptr = slot.untyped_storage().data_ptr()
        const_ptrs = {c.untyped_storage().data_ptr(): i for i, c in enumerate(self._consts)}

        def pack(t: torch.Tensor):
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            where = (tuple(t.size()), tuple(t.stride()), t.storage_offset())
            recipe = saved_recipe(t)
            if recipe is not None:  # a lean norm's output: its inputs are stored, it is recomputed
                return _RecomputedRef(recomputed_read(recipe, stored, pack), *where)
            if ptr == slot_ptr:
                return _WeightRef(layer, *where)
            if ptr in const_ptrs:
                return _ConstRef(const_ptrs[ptr], *where)
            key = (ptr, t.dtype)
            if key not in stored:
                # detach: a handle holding an op's own output would close a reference cycle
                # (output -> grad_fn -> saved handle -> output) that no backward ever breaks
                # if the step is abandoned (an out-of-memory error, an interrupt)
                whole = t.detach().as_strided((storage.nbytes() // t.element_size(),), (1,), 0)
                # the layer's n-th stored tensor: the same slot every step of the plan
                stored[key] = (self.activations.put(whole, tier, slot=(layer, len(handles))), whole)
                handles.append(stored[key][0])
            handle = stored[key][0]
            self._reads_left[id(handle)] = self._reads_left.get(id(handle), 0) + 1
            return _StoredRef(handle, *where)

        return pack

    @staticmethod
    def _free_offloaded_input(x: torch.Tensor, previous_keep: tuple | None) -> None:
        """Free the GPU memory of a layer input whose copy went to the host or NVMe tier.

        The tensor object stays referenced without its data: as a keep layer's gradient leaf
        (``x_in``) and as the previous keep layer's output (``out``), the roots of their
        backward passes, which need only its shape and graph. Its bytes are already counted
        on the slower tier; held on the GPU until backward they were counted nowhere (one
        batch x seq x hidden tensor per such layer: 0.54 GB at 64 x 1024 x 4096, measured
        as the excess of the 9B's backward stages over the simulator's). Kept when the previous
        layer saved the same storage on the GPU tier (an op that saves its own output). The
        queued compute and the offload copy still read it: the caching allocator reuses the
        block only after them (same stream order; the copy stream's use is recorded)."""
        storage = x.untyped_storage()
        if previous_keep is not None and any(
            h.tier == "gpu" and h.tensor is not None and h.tensor.untyped_storage().data_ptr() == storage.data_ptr()
            for h in previous_keep[3]
        ):
            return
        storage.resize_(0)

    def _unpack(self, packed):
        """A saved tensor back for backward. After the last of a stored storage's saved tensors
        is read the store lets go of it, so a kept layer's saved tensors are freed during its
        backward as autograd is done with each (the view returned here holds the bytes while
        the node uses them), as they are without hooks and as the profiler measured; held to
        the end of the layer's backward they peaked 8-14 GB above the plan in the H200's
        Qwen3.5-9B runs of 2026-12-02 (a kept layer's backward, the first unpacks' share)."""
        if isinstance(packed, _WeightRef):
            slot = self._bwd_slot[packed.layer]
            return slot.as_strided(packed.size, packed.stride, packed.offset)
        if isinstance(packed, _ConstRef):
            return self._consts[packed.index].as_strided(packed.size, packed.stride, packed.offset)
        if isinstance(packed, _RecomputedRef):
            return packed.state.read(self._unpack).as_strided(packed.size, packed.stride, packed.offset)
        handle = packed.handle
        out = self.activations.get(handle).as_strided(packed.size, packed.stride, packed.offset)
        left = self._reads_left.pop(id(handle), 1) - 1
        if left > 0:
            self._reads_left[id(handle)] = left
        else:
            self.activations.free(handle)
        return out

    # -- gradients ------------------------------------------------------------------------

    def _stage_done(self, name: str) -> None:
        if self.stage_memory is None:
            return
        if self.memory_probe is not None:
            self.stage_memory.append((name, self.memory_probe()))
        elif self.device.type == "cuda":
            self.stage_memory.append((name, torch.cuda.max_memory_allocated(self.device)))
            torch.cuda.reset_peak_memory_stats(self.device)

    def _emit_grads(self, group: int, grads: dict[str, torch.Tensor], flat: torch.Tensor | None = None) -> None:
        """Squared norm on the GPU, then an async copy into the pinned host gradient buffer; for
        a group stepped on the GPU or whose gradient the plan holds there (``held_grads``), the
        flat gradient kept there instead (in ``flat`` where given: grads already viewing their
        place in it are not copied), with an event on the compute stream after it for a held one
        (``grad_ready``: the update's copy home waits for it)."""
        layout = self.adapter.layouts[group]
        ordered = [grads[p.name] for p in layout.params]
        if self.parallel is not None and self.parallel.world_size > 1:
            self._emit_grad_shard(group, ordered)
            return
        norms = torch._foreach_norm(ordered, 2, dtype=torch.float32)
        self.grad_norm_sq[group] = torch.stack(norms).square().sum()
        if group in self.device_groups or group in self.held_grads:
            if flat is None and len(ordered) == 1:
                flat = ordered[0].reshape(-1)
            else:
                if flat is None:
                    flat = torch.empty(layout.numel, dtype=ordered[0].dtype, device=self.device)
                for p, g in zip(layout.params, ordered):
                    place = flat[p.offset : p.offset + p.numel]
                    if g.data_ptr() != place.data_ptr():
                        place.copy_(g.reshape(-1))
            self.device_grads[group] = flat
            self.grad_ready[group] = None if group in self.device_groups else self.streams.record()
            return
        produced = self.streams.record()
        host = self.store.grads[group]
        self.streams.wait(produced, self.streams.d2h)
        span = self.trace.begin(self.streams.d2h)
        with self.streams.on(self.streams.d2h):
            for p, g in zip(layout.params, ordered):
                host[p.offset : p.offset + p.numel].copy_(g.reshape(-1), non_blocking=True)
        self.trace.end("d2h", span, self.streams.d2h)
        for g in ordered:
            self.streams.keep_alive(g, self.streams.d2h)
        self.grad_ready[group] = self.streams.record(self.streams.d2h)

    def _emit_grad_shard(self, group: int, ordered: list[torch.Tensor]) -> None:
        """Data parallel: the group's gradient as one flat buffer (padded to equal chunks),
        reduce-scattered; this rank's chunk is normed and copied to its host shard on the D2H
        stream, which waits for the collective (compute goes on meanwhile), or, where the plan
        holds the gradient on the GPU, kept there (``device_grads``; ``grad_ready``: the D2H
        stream's event after it)."""
        layout = self.adapter.layouts[group]
        r = self.store.ranges[group]
        flat = torch.empty(r.chunk * self.parallel.world_size, dtype=ordered[0].dtype, device=self.device)
        flat[layout.numel :].zero_()
        for p, g in zip(layout.params, ordered):
            flat[p.offset : p.offset + p.numel].copy_(g.reshape(-1))
        self.streams.wait(self.streams.record(), self.streams.d2h)
        with self.streams.on(self.streams.d2h):
            shard, work = self.parallel.reduce_scatter(flat)
        span = self.trace.begin(self.streams.d2h)
        with self.streams.on(self.streams.d2h):
            if work is not None:
                work.wait()
            mine = shard[: r.numel]
            self.grad_norm_sq[group] = mine.float().square().sum()
            if group in self.held_grads:  # gloo's shard is a view of the whole flat buffer: not held
                self.device_grads[group] = mine if self.parallel.backend == "nccl" else mine.clone()
            else:
                self.store.grads[group].copy_(mine, non_blocking=True)
        self.trace.end("d2h", span, self.streams.d2h)
        for t in (flat, shard):
            self.streams.keep_alive(t, self.streams.d2h)
        self.grad_ready[group] = self.streams.record(self.streams.d2h)

    def wait_grad(self, group: int) -> None:
        """Block the calling (optimizer) thread until ``group``'s host gradient is complete."""
        event = self.grad_ready[group]
        if event is not None:
            event.synchronize()

    def head_loss_backward(
        self,
        x: torch.Tensor,
        norm_weight: torch.Tensor,
        head_weight: torch.Tensor,
        valid: torch.Tensor,
        targets: torch.Tensor,
        num_targets: int,
        loss_denominator: int | None = None,
        head_grad: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Final norm, chunked LM head and cross-entropy over the target positions only,
        with backward per chunk: the full logits never exist.

        Returns the gradient of the last hidden states, of the norm weight and of the head
        weight (accumulated in ``head_grad`` where given, zeroed here), and the loss (sum over
        target tokens / ``loss_denominator``, by default ``num_targets``: the mean) as a device
        scalar.
        """
        denominator = loss_denominator or num_targets
        adapter = self.adapter
        batch, seq, hidden_size = x.shape
        x_last = x.detach().requires_grad_()
        with torch.enable_grad():
            normed = adapter.final_norm(norm_weight, x_last)
        hidden = normed.detach().reshape(-1, hidden_size).index_select(0, valid)
        grad_hidden = torch.empty_like(hidden)
        head_grad = torch.zeros_like(head_weight) if head_grad is None else head_grad.zero_()
        loss_sum = torch.zeros((), dtype=torch.float32, device=x.device)
        chunk = self.plan.head_chunk_tokens
        for a in range(0, num_targets, chunk):
            xc = hidden[a : a + chunk]
            loss, g_logits = chunk_loss_and_grad(xc, head_weight, targets[a : a + chunk], denominator)
            with torch.no_grad():
                torch.mm(g_logits, head_weight, out=grad_hidden[a : a + chunk])
                head_grad.addmm_(g_logits.t(), xc)  # accumulated in the matmul, rounded once per chunk
            loss_sum += loss
            del g_logits
        grad_normed = torch.zeros(batch * seq, hidden_size, dtype=x.dtype, device=x.device)
        grad_normed.index_copy_(0, valid, grad_hidden)
        del hidden, grad_hidden
        g, g_norm = torch.autograd.grad(normed, [x_last, norm_weight], grad_normed.view(batch, seq, -1))
        return g, g_norm, head_grad, loss_sum

    # -- the step -------------------------------------------------------------------------

    def forward_backward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> StepStats:
        """Loss and gradients of one batch; gradients land in ``store.grads``, or in
        ``device_grads`` for the groups stepped on the GPU and those the plan holds there.

        ``labels`` are unshifted (as HF takes them): position t predicts labels[t + 1];
        -100 marks positions without loss. The loss is the mean over target tokens. Padding
        may be on either side; a target predicted from a padding position (the first real
        token of a left-padded row) is rejected, as no real token precedes it.

        Packed rows: ``document_ids`` [B, S] (1, 2, ... per sample, 0 on padding; the padding
        mask is then ``document_ids != 0``) and ``position_ids`` [B, S] (default 0..S-1).
        """
        try:
            return self._forward_backward(input_ids, labels, attention_mask, position_ids, document_ids)
        except BaseException:
            self.activations.abandon()  # an abandoned step's copies still queued
            raise
        finally:
            if self.adapter.routing is not None:
                self.adapter.routing.end()

    def _forward_backward(self, input_ids, labels, attention_mask, position_ids, document_ids) -> StepStats:
        step = self._start_step(input_ids, labels, attention_mask, position_ids, document_ids)
        self._forward(step)
        self._head(step)
        self._backward(step)
        return self._finish_step(step)

    @staticmethod
    def _targets(labels: torch.Tensor, attention_mask: torch.Tensor | None, document_ids: torch.Tensor | None,
                 batch: int, seq: int) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """On the CPU: the padding mask (``document_ids != 0`` where given), the flat targets
        (position t predicts ``labels[t + 1]``; -100: none) and the flat positions with one.
        Rejects a mask that disagrees with ``document_ids`` and a target predicted from padding."""
        if document_ids is not None:
            real = (document_ids != 0).long()
            if attention_mask is not None and not torch.equal(attention_mask.long(), real):
                raise ValueError("attention_mask and document_ids disagree on which tokens are padding "
                                 "(document id 0); pass one of them, or both from the same batch")
            attention_mask = real
        targets_cpu = torch.full_like(labels, -100)
        targets_cpu[:, :-1] = labels[:, 1:]
        targets_cpu = targets_cpu.reshape(-1)
        valid_cpu = (targets_cpu != -100).nonzero().squeeze(1)
        if attention_mask is not None:
            # a target after a padding position (left padding, labelled first real token) would
            # be predicted from that padding position, which sees no real token
            from_padding = (targets_cpu.view(batch, seq) != -100) & (attention_mask == 0)
            if bool(from_padding.any()):
                row, pos = (int(i) for i in from_padding.nonzero()[0])
                raise ValueError(
                    f"labels[{row}, {pos + 1}] is a target whose prediction would come from padding "
                    f"position {pos} (left padding with a label on the first real token); set the "
                    "labels of each row's first real token to -100, or pad on the right"
                )
        return attention_mask, targets_cpu, valid_cpu

    def _start_step(self, input_ids, labels, attention_mask, position_ids, document_ids) -> _StepState:
        """The batch checked and counted, its inputs, targets, masks and rotary embeddings on
        the device, and the step's bookkeeping reset."""
        adapter, plan = self.adapter, self.plan
        batch, seq = input_ids.shape
        attention_mask, targets_cpu, valid_cpu = self._targets(labels, attention_mask, document_ids, batch, seq)
        num_targets = int(valid_cpu.numel())
        num_tokens = int(attention_mask.sum()) if attention_mask is not None else input_ids.numel()
        # the loss is the mean over the global batch's target tokens: with data parallel each
        # rank divides its sum by the global count, so the ranks' gradients sum to its gradient
        global_targets, global_tokens, global_slots = (
            self.parallel.sum_counts([num_targets, num_tokens, batch * seq]) if self.parallel is not None
            else (num_targets, num_tokens, batch * seq)
        )
        if global_targets == 0:
            raise ValueError("batch has no target tokens (all labels are -100)")

        dev = self.device
        ids = input_ids.to(dev, non_blocking=True)
        valid = valid_cpu.to(dev, non_blocking=True)
        targets = targets_cpu[valid_cpu].to(dev, non_blocking=True)
        # decided on the CPU copy (no device sync); the masks of each layer type (a [B, 1, S, S]
        # one for attention) are built on the device. Rows padded on the right need none: every
        # layer is causal, so no real position reads a later (padding) one, and the padding
        # positions' outputs reach no loss; they take the unmasked path the profiler measured
        # (sdpa's flash kernel with is_causal instead of a dense mask, no S x S mask per step)
        some_padding = attention_mask is not None and not bool(attention_mask.all())
        padded = some_padding and not right_padded(attention_mask)
        if document_ids is not None:
            mask = adapter.layer_masks(None, document_ids=document_ids)  # the CPU copy: see layer_masks
        else:
            mask = adapter.layer_masks(attention_mask.to(dev, non_blocking=True) if padded else None)
        if position_ids is None:
            position_ids = torch.arange(seq, device=dev).unsqueeze(0).expand(batch, -1)
        else:
            position_ids = position_ids.to(dev, non_blocking=True)
        cos, sin = adapter.rotary_embeddings(position_ids, self.dtype)
        self._consts = [cos, sin, *mask_tensors(mask)]
        if adapter.routing is not None:
            # the load-balancing loss counts the real tokens' routing, in every layer
            real = attention_mask if some_padding else None
            adapter.routing.start(real, dev)
        self.trace.start_step()
        if self.step_started is not None:
            self.step_started()
        if self.store.host_grad_groups is None:  # a store whose gradient buffers wait for the plan
            self.store.allocate_grads(host_grad_groups(plan, self.num_groups))
        self._reads_left.clear()  # an abandoned step's counts
        self.device_grads.clear()  # a skipped step's (not stepped): not held through this one
        self.grad_norm_sq.zero_()
        # the layer inputs the plan writes to NVMe (a keep layer's saved tensors add to it;
        # after the first step the measured peak is checked too)
        nvme_inputs = sum(1 for lp in plan.layers if lp.tier == "nvme") * batch * seq * adapter.hidden_size
        self.activations.start_step(nvme_inputs * self.dtype.itemsize)
        return _StepState(ids=ids, valid=valid, targets=targets, num_targets=num_targets,
                          global_targets=global_targets, global_tokens=global_tokens, global_slots=global_slots,
                          mask=mask, rope=(cos, sin))

    def _forward(self, step: _StepState) -> None:
        """The embedding's and every decoder layer's forward, each layer leaving in
        ``step.saved`` what its plan keeps for backward; the last output in ``step.hidden``."""
        adapter, plan, layouts = self.adapter, self.plan, self.adapter.layouts
        rope, mask = step.rope, step.mask
        step.embed_leaf = layouts[0].leaves(self._resident_weights(0))
        # with device layers, the first streamed layer's copy (which waits for its CPU update)
        # starts at its acquire, after the embedding's and the device layers' forwards are queued
        self.weights.begin(self._schedule(), prefetch=not plan.device_layers)
        with torch.no_grad():
            x = adapter.embed(step.embed_leaf["embed_tokens.weight"], step.ids)
        self._stage_done("embed")

        saved = step.saved = [None] * adapter.num_layers
        for i in range(adapter.num_layers):
            lp = plan.layers[i]
            slot = self._acquire(i)
            span = self.trace.begin()
            layer_input = x
            if lp.mode == "keep":
                x_in = x.requires_grad_()
                leaves = layouts[i + 1].leaves(slot)
                handles: list[Handle] = []
                stored: dict = {}
                with torch.enable_grad(), saved_tensors_hooks(
                    self._pack_hook(i, slot, lp.tier, handles, stored), self._unpack
                ):
                    out = adapter.layer_forward(i, leaves, x_in, rope, mask, recompute=lp.recompute)
                stored.clear()
                saved[i] = (x_in, out, leaves, handles)
                x = out.detach()
            else:
                if lp.mode == "checkpoint":
                    saved[i] = self.activations.put(x, lp.tier, slot=(i, "input"))
                with torch.no_grad():
                    x = adapter.layer_forward(i, layouts[i + 1].views(slot), x, rope, mask)
            if lp.mode != "drop" and lp.tier != "gpu":
                self._free_offloaded_input(layer_input, saved[i - 1] if i and plan.layers[i - 1].mode == "keep" else None)
            del layer_input
            self.trace.end("compute", span)
            self._release(i)
            self._stage_done(f"fwd {i}")
        step.hidden = x
        if adapter.routing is not None:
            # every layer's routing is known: the loss term, and what each backward adds
            step.aux_loss = adapter.routing.end_forward(None if self.parallel is None else self.parallel.sum_)

    def _head(self, step: _StepState) -> None:
        """The final norm + chunked LM head + loss, backward per chunk (`head_loss_backward`):
        ``step.loss_sum``, ``step.grad`` (of the last hidden state, which is let go here), the
        norm's and head's gradients emitted (a tied head's kept in ``step.head_grad``)."""
        adapter, layouts = self.adapter, self.adapter.layouts
        final = self.num_groups - 1
        final_leaf = layouts[final].leaves(self._resident_weights(final))
        head_w = adapter.head_weight(step.embed_leaf, final_leaf)
        final_flat = None
        if final in self.device_groups and not adapter.tied:  # the head's gradient where the optimizer reads it
            final_flat = torch.empty(layouts[final].numel, dtype=self.dtype, device=self.device)
        # the last hidden state is not needed past the head: held on, it stayed on the GPU
        # through the whole backward, one batch x seq x hidden tensor the simulator counts in
        # the head only (a keep last layer's saved output still holds it until its backward)
        x, step.hidden = step.hidden, None
        span = self.trace.begin()
        g, g_norm, head_grad, step.loss_sum = self.head_loss_backward(
            x, final_leaf["model.norm.weight"], head_w, step.valid, step.targets, step.num_targets,
            step.global_targets, None if final_flat is None else layouts[final].views(final_flat)["lm_head.weight"],
        )
        del x
        self.trace.end("compute", span)
        final_grads = {"model.norm.weight": g_norm}
        if not adapter.tied:
            final_grads["lm_head.weight"] = head_grad
        self._emit_grads(final, final_grads, final_flat)
        del final_grads, final_flat
        # untied, held by the copy out (or the GPU step) as long as they need it
        step.head_grad = head_grad if adapter.tied else None
        del head_grad
        step.grad = g
        self._stage_done("head")

    def _backward(self, step: _StepState) -> None:
        """Backward of the segments from the last (tensors on a slower tier fetched back on the
        H2D stream ``prefetch`` segments ahead of their use), then of the embedding."""
        order = list(reversed(self.plan.segments()))
        for k, (start, end) in enumerate(order):
            self._prefetch_saved(step, order, k)
            if self.plan.layers[start].mode == "keep":
                self._backward_kept_layer(step, start)
            else:
                self._backward_segment(step, start, end)

        # embedding (and the tied head), summed in fp32 and rounded once
        span = self.trace.begin()
        embed_w = step.embed_leaf["embed_tokens.weight"]
        g_embed = self.adapter.embed_backward(
            step.ids, step.grad, step.head_grad if step.head_grad is not None else torch.zeros_like(embed_w))
        self.trace.end("compute", span)
        self._emit_grads(0, {"embed_tokens.weight": g_embed})
        step.grad = None
        del g_embed
        self._stage_done("embed bwd")

    def _prefetch_saved(self, step: _StepState, order: list[tuple[int, int]], k: int) -> None:
        """Start fetching back the stored tensors of the segments ``order[k]`` and as far
        ahead as their layers' ``prefetch`` reaches."""
        plan = self.plan
        for ahead in range(k, min(k + 1 + max(lp.prefetch for lp in plan.layers), len(order))):
            first = order[ahead][0]
            if ahead - k <= plan.layers[first].prefetch and step.saved[first] is not None:
                # no local names saved[first]: one bound here held a kept layer's
                # output (and inputs) past its backward, to the end of the step
                keep = plan.layers[first].mode == "keep"
                for handle in step.saved[first][3] if keep else [step.saved[first]]:
                    self.activations.prefetch(handle)

    def _backward_kept_layer(self, step: _StepState, layer: int) -> None:
        """A keep layer's backward through its saved graph (its saved weights read from the
        slot acquired now, `_unpack`)."""
        slot = self._acquire(layer)
        x_in, out, leaves, handles = step.saved[layer]
        self._bwd_slot[layer] = slot
        names = list(leaves)
        span = self.trace.begin()
        grads = torch.autograd.grad(out, [x_in, *leaves.values()], step.grad)
        self.trace.end("compute", span)
        del self._bwd_slot[layer], out, x_in  # the output's storage must not outlive this stage
        for h in handles:
            self.activations.free(h)
        step.saved[layer] = None
        step.grad = grads[0]
        self._emit_grads(layer + 1, dict(zip(names, grads[1:])))
        self._release(layer)
        self._stage_done(f"bwd {layer}")

    def _backward_segment(self, step: _StepState, start: int, end: int) -> None:
        """A checkpoint's segment [start, end): its inputs rebuilt from the checkpoint without
        autograd (the segment cache), then each layer, last first, re-run with autograd and
        differentiated, on the same weight copies."""
        adapter, layouts, rope, mask = self.adapter, self.adapter.layouts, step.rope, step.mask
        slots = [self._acquire(j) for j in range(start, end)]
        handle = step.saved[start]
        inputs = [self.activations.get(handle)]
        span = self.trace.begin()
        with torch.no_grad():
            for j in range(start, end - 1):
                inputs.append(
                    adapter.layer_forward(j, layouts[j + 1].views(slots[j - start]), inputs[-1], rope, mask)
                )
        self.trace.end("compute", span)
        for j in reversed(range(start, end)):
            x_in = inputs[j - start].detach().requires_grad_()
            leaves = layouts[j + 1].leaves(slots[j - start])
            span = self.trace.begin()
            with torch.enable_grad():
                out = adapter.layer_forward(j, leaves, x_in, rope, mask)
                grads = torch.autograd.grad(out, [x_in, *leaves.values()], step.grad)
            self.trace.end("compute", span)
            step.grad = grads[0]
            inputs[j - start] = None
            self._emit_grads(j + 1, dict(zip(leaves, grads[1:])))
            self._release(j)
            del out, x_in
            self._stage_done(f"bwd {j}")
        self.activations.free(handle)
        step.saved[start] = None

    def _finish_step(self, step: _StepState) -> StepStats:
        """The loss and gradient norm read back (summed over ranks), and the step's counts."""
        loss = step.loss_sum
        if step.aux_loss is not None and (self.parallel is None or self.parallel.rank == 0):
            loss = loss + step.aux_loss  # once: the ranks' losses are summed
        if self.parallel is not None:
            if self.parallel.world_size > 1:
                # the shards' norms are written on the D2H stream, after their collectives
                self.streams.wait(self.grad_ready[0])
            stats = self.parallel.sum_(torch.stack([loss, self.grad_norm_sq.sum()])).cpu()
        else:
            stats = torch.stack([loss, self.grad_norm_sq.sum()]).cpu()
        loss_value = float(stats[0])
        grad_norm = math.sqrt(float(stats[1])) if math.isfinite(float(stats[1])) else float("nan")
        self._consts = []
        return StepStats(
            loss=loss_value,
            grad_norm=grad_norm,
            num_tokens=step.global_tokens,
            num_target_tokens=step.global_targets,
            num_slots=step.global_slots,
            h2d_weight_bytes=self.weights.h2d_bytes,
            peak_activation_bytes=dict(self.activations.peak_by_tier),
        )

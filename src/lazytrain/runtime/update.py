"""The CPU optimizer step, group by group, overlapping the next step's forward.

After backward the global gradient norm is known (from the per-group squared norms the
executor accumulated on the GPU), so the clip coefficient is a plain number passed to the
optimizer. Groups are stepped in the order the next forward needs them: embedding, layer
0, ..., layer L-1, final norm + head. With ``overlap`` the steps run on a worker thread and
the next forward waits only for the group it is about to load (``wait_group``), so the CPU
step hides behind the GPU forward.

Groups the plan steps on the GPU (``executor.device_groups``: the embedding and the final
norm + head with `Plan.const_update`, and the first `Plan.device_layers` layers) are stepped
from the calling thread on the GPU's compute stream, after the worker has started on the
other layers: the GPU work (tens of ms) goes ahead of the next forward, which meanwhile runs
the device layers and then waits for the first streamed layer's CPU step. The optimizer holds their
master remainder and state on the GPU from the first such step until `finish`, which copies
them back to the host (what checkpoints, exports and evaluation read).

Gradients the plan holds on the GPU (``executor.held_grads``, `LayerPlan.grad="gpu"`) are taken
from the executor at `start` (so the next step, which lets go of a skipped step's, keeps them).
A layer the CPU worker steps has its gradient copied home through the host store's pinned ring
(`HostStore.grad_ring`: `host_store.GRAD_RING_SLOTS` slots of the largest such gradient), by the
worker, in the update order, on a copy stream of its own: the first slots' copies at once, each
later one as soon as the CPU step that read its slot is done (`_GradRing`); each GPU gradient is
freed once its copy is queued (the allocator reuses its bytes after the copy). The next
forward's weight copy of layer i still waits for layer i's update only.

Streamed layers the plan steps on the GPU (``executor.streamed_steps``, `Plan.device_steps`): at
each update each one's weights, gradient (on the host since its backward, unless the plan holds
it on the GPU: then it is stepped from there, no copy in), master remainder and state go in on a
copy stream of their own (from pinned host memory: `HostStore.pin_masters`,
`Hybrid8bitAdamW.stream_in`) into one of two scratch slots, are stepped on a stream of their own
and come back, the gradient excepted, on a third (`stream_out`), the new weights into the host
store. A gradient the plan does not hold is not kept on the GPU from the backward to the update:
the card keeps its room for activations, at the price of the gradient's copy in. They are queued
as the next forward goes, `STREAMED_LOOKAHEAD` layers ahead of the weights it loads (the first
ones once its inputs are on their way: ``executor.step_started``), not all at `start`: queued at
once (H200, 7B, 12 layers, 2026-12-04), `start` took 0.21 s of the calling thread and the next
step's first event ran on the GPU 0.34 s after its call, we take it behind the 23 GB of copies
in on the H2D link (its inputs' copies wait there). Nothing blocks the calling thread: the
weight copy of such a layer's next forward waits on the GPU for its bytes to be back
(``wait_group``), and `finish` queues what is left and waits for them on the host.

Out of GPU memory: a streamed step that runs out (taking the scratch slots, or in the step's
temporaries) and the ones after it are stepped on the CPU instead, the same update (their
masters and states on the host are whole until the copy out, which comes after the step), and
the CPU worker steps every streamed-step layer from then on, for as long as this plan runs. So
is a device group whose master and state were copied to the GPU in this update (its first, or
the first after `finish`) when the copy or its step runs out: the copy is dropped, the host's is
whole. Stepped on the CPU, a gradient held on the GPU is copied to its host buffer, or, for a
layer without one, to a temporary host tensor. ``out_of_memory`` tells the caller; the trainer
re-solves a solved plan smaller (whose new updater tries the GPU again). A device group whose
master and state have lived on the GPU since an earlier update may be left partly stepped:
`DeviceStepOutOfMemory` ends the run.

Data parallel (the executor has ``parallel``): the optimizer holds this rank's shards; each
group's step writes the rank's shard of the shared weights, then ``parallel.publish`` waits
until every rank's shard of that group is in this host's weights.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback

import torch

from lazytrain.errors import LazyTrainError
from lazytrain.optim.base import HostOptimizer
from lazytrain.plan.simulate import STREAMED_LOOKAHEAD, STREAMED_STEP_SLOTS
from lazytrain.runtime.executor import Executor

log = logging.getLogger(__name__)


class DeviceStepOutOfMemory(LazyTrainError, MemoryError):
    """An optimizer step on the GPU of a group whose master and state live there ran out of
    memory: they may be partly stepped, and the run cannot go on."""


class _GradRing:
    """The CPU worker's gradients held on the GPU (``grads``, stepped in the order of
    ``groups``), brought home through the host store's pinned slots (`HostStore.grad_ring`) on
    ``stream``. Used from the worker thread only (or the caller's, without overlap)."""

    def __init__(self, executor: Executor, groups: list[int], grads: dict[int, torch.Tensor],
                 stream: torch.cuda.Stream | None):
        self.executor, self.grads, self.stream = executor, grads, stream
        self.groups = frozenset(groups)
        self.order = list(groups)
        """The groups whose copies are not queued yet."""
        sizes = [grads[g].numel() for g in groups]  # a data-parallel rank's: its shard
        self.free = list(executor.store.grad_ring(max(sizes))) if groups else []
        self.copied: dict[int, tuple[torch.Tensor, torch.Tensor, torch.cuda.Event | None]] = {}
        """Per group whose copy is queued: its slot, the gradient's part of it, the copy's event."""

    def fill(self) -> None:
        """Queue the next gradients' copies into the free slots, in order; each GPU gradient is
        let go once its copy is queued."""
        streams = self.executor.streams
        while self.order and self.free:
            group = self.order.pop(0)
            grad = self.grads.pop(group)
            slot = self.free.pop(0)
            part = slot[: grad.numel()]
            with streams.on(self.stream):
                streams.wait(self.executor.grad_ready[group], self.stream)  # its backward
                part.copy_(grad, non_blocking=True)
            streams.keep_alive(grad, self.stream)
            self.copied[group] = (slot, part, streams.record(self.stream))
            del grad

    def take(self, group: int) -> torch.Tensor:
        """``group``'s gradient in its ring slot, once copied (blocks this thread until then)."""
        self.fill()
        _, part, copied = self.copied[group]
        if copied is not None:
            copied.synchronize()
        return part

    def release(self, group: int) -> None:
        """``group``'s CPU step is done with its slot: the next gradient may be copied into it."""
        slot, _, _ = self.copied.pop(group)
        self.free.append(slot)
        self.fill()


class HostUpdater:
    def __init__(self, executor: Executor, optimizer: HostOptimizer, overlap: bool = True):
        self.executor = executor
        self.optimizer = optimizer
        self.overlap = overlap
        self.num_groups = executor.num_groups
        self._done = [threading.Event() for _ in range(self.num_groups)]
        for event in self._done:
            event.set()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        on_gpu = executor.device_groups | executor.streamed_steps
        if on_gpu and not optimizer.device_step:
            raise ValueError(
                f"the plan steps groups {sorted(on_gpu)} (the embedding, head, device layers and device steps) "
                f"on the GPU, which the {type(optimizer).__name__} optimizer cannot (its step is CPU-only): use "
                "optimizer.kind=hybrid8bit, or a plan with const_update=host"
            )
        self._streamed_done: dict[int, torch.cuda.Event | None] = {}
        """Per streamed-step group, its last step's copy out (None: none pending, or no CUDA)."""
        self._scratch: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        """Streamed steps' slots: (weights, gradient, uint8 master remainder + state), taken
        from the allocator when an update queues its first streamed step and given back once it
        has queued its last (the planner counts them through the first forwards only)."""
        self._slot_free: list[torch.cuda.Event | None] = []
        self._pending: list[int] = []
        """Streamed-step groups of the last `start` not queued yet, in order."""
        self._step_args: tuple[float, float] = (1.0, 0.0)
        self._queued = 0
        self.out_of_memory: torch.OutOfMemoryError | None = None
        """The first time the GPU ran out of memory for a step planned there since the caller
        last cleared this (the groups went to the CPU: `_queue_streamed`, `start`), else None;
        without its traceback, whose frames would hold the failed step's GPU buffers."""
        self._on_cpu: set[int] = set()
        """Device groups (`Executor.device_groups`) stepped on the CPU from their first update
        that ran out of GPU memory on."""
        self._held: dict[int, torch.Tensor] = {}
        """The held gradients (`Executor.held_grads`) of this update's streamed steps, taken from
        the executor at `start` until each is stepped (the CPU worker's go to its `_GradRing`)."""
        executor.step_started = self._queue_first
        streams = executor.streams
        self._in, self._step, self._out, self._home = (
            (torch.cuda.Stream(executor.device) for _ in range(4)) if streams.cuda else (None,) * 4)
        if executor.streamed_steps:
            executor.store.pin_masters(executor.streamed_steps)
        self.last_step_seconds = 0.0
        """The CPU worker's seconds on the last update joined (`start` joins the one before,
        `finish` its own); 0 before any. Set at the join, not by the worker: read right after
        `start`, it is the previous update's, whether or not the new one has finished already."""
        self._worker_seconds = 0.0
        self.wait_seconds = 0.0
        executor.before_load = self.wait_group

    @property
    def cpu_params(self) -> int:
        """Parameters of the groups the CPU worker steps: every group's but those the plan steps
        on the GPU (as it stands: a streamed step that ran out of memory is the CPU's). The
        denominator of a measured update rate, per model parameter as the cost table's
        (`policies.recalibrate`)."""
        on_gpu = self.executor.device_groups | self.executor.streamed_steps
        return sum(self.executor.store.weights[g].numel() for g in range(self.num_groups) if g not in on_gpu)

    def wait_group(self, group: int) -> None:
        """Block until ``group``'s pending update is written (a no-op if none is pending)."""
        if self._pending:
            self._queue_streamed(group + STREAMED_LOOKAHEAD)
        copied_out = self._streamed_done.get(group)
        if copied_out is not None:  # the weights' copy in (on the H2D stream) waits on the GPU
            self.executor.streams.wait(copied_out, self.executor.streams.h2d)
        event = self._done[group]
        if not event.is_set():
            t0 = time.perf_counter()
            event.wait()
            self.wait_seconds += time.perf_counter() - t0
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError("the CPU optimizer step failed") from error

    def start(self, clip_coef: float, lr: float) -> None:
        """Begin updating every group with gradient * ``clip_coef`` at learning rate ``lr``."""
        self._join()
        self.executor.weights.invalidate()
        on_device, streamed = self.executor.device_groups, self.executor.streamed_steps
        for group in range(self.num_groups):
            if group not in on_device:
                if group not in streamed:
                    self._done[group].clear()
                self.executor.weights_updated(group)
        self.wait_seconds = 0.0
        held = {g: self.executor.device_grads.pop(g) for g in sorted(self.executor.held_grads)
                if g in self.executor.device_grads}
        self._held = {g: held.pop(g) for g in sorted(streamed) if g in held}
        ring = _GradRing(self.executor, sorted(held), held, self._home)
        if self.overlap:
            self._thread = threading.Thread(target=self._run, args=(clip_coef, lr, on_device | streamed, ring),
                                            daemon=True)
            self._thread.start()
        else:
            self._run(clip_coef, lr, on_device | streamed, ring)
            self.wait_group(0)
        self._pending, self._step_args, self._queued = sorted(self.executor.streamed_steps), (clip_coef, lr), 0
        for group in sorted(on_device):
            if group in self._on_cpu:
                self._step_on_cpu(group)
                continue
            copied = group not in self.optimizer.device_groups  # a copy: its host tensors stay whole
            try:
                if copied:
                    self.optimizer.to_device(group, self.executor.resident[group])
                self.optimizer.step_group(group, self.executor.device_grads[group], clip_coef, lr, None)
                del self.executor.device_grads[group]
            except torch.OutOfMemoryError as error:
                if copied:  # its partly stepped device copy dropped (the resident weights reloaded)
                    if group in self.optimizer.device_groups:
                        self.optimizer.discard_device(group)
                    self._on_cpu.add(group)
                    self._step_on_cpu(group)
                    self._ran_out(error, [group], "its GPU step, or copying its master and state there")
                    continue
                raise DeviceStepOutOfMemory(
                    f"the GPU ran out of memory in the optimizer step of group {group}, whose master and state "
                    f"live on the GPU (plan.const_update=device): {str(error).splitlines()[0] if str(error) else ''}. "
                    "They may be partly stepped, so this run can neither go on nor save them: resume from its last "
                    "checkpoint (training.resume=true) with less GPU memory for the planner (memory.gpu_gb) or "
                    "with plan.const_update=host"
                ) from error

    def _queue_first(self) -> None:
        if self._pending:
            self._queue_streamed(self._pending[0] + STREAMED_LOOKAHEAD - 1)

    def _queue_streamed(self, last: int) -> None:
        """Queue the pending streamed-step groups up to ``last``: each one's copy in, step and
        copy out (module docstring). One that runs out of GPU memory (its scratch slots, or the
        step's temporaries) and every one after it are stepped on the CPU instead
        (`_step_on_cpu`)."""
        if not self._pending or self._pending[0] > last:
            return
        try:
            self._queue_streamed_on_gpu(last)
        except torch.OutOfMemoryError as error:
            group = self._pending[0]
            if group in self.optimizer.device_groups:  # copied in, not stepped: its host tensors are whole
                self.optimizer.discard_device(group)
            groups, self._pending = self._pending, []
            self._release_scratch()
            self.executor.streamed_steps = frozenset()  # this update's rest and every later one: the CPU's
            for group in groups:
                self._step_on_cpu(group)
            self._ran_out(error, groups, "a streamed step: its scratch slots or its step")

    def _queue_streamed_on_gpu(self, last: int) -> None:
        ex = self.executor
        store, streams = ex.store, ex.streams
        if not self._scratch:
            groups = sorted(ex.streamed_steps)
            numel = max(store.weights[g].numel() for g in groups)
            grad_numel = max((store.weights[g].numel() for g in groups if g not in self._held), default=0)
            nbytes = max(self.optimizer.streamed_bytes(g) for g in groups)
            # taken on the compute stream, whose queued work may still use those bytes: the
            # copies in wait for it
            streams.wait(streams.record(), self._in)
            self._scratch = [(torch.empty(numel, dtype=store.dtype, device=ex.device),
                              torch.empty(grad_numel, dtype=store.dtype, device=ex.device),
                              torch.empty(nbytes, dtype=torch.uint8, device=ex.device))
                             for _ in range(min(STREAMED_STEP_SLOTS, len(groups)))]
            self._slot_free = [None] * len(self._scratch)
        weights_are_masters = store.weights_are_masters
        clip_coef, lr = self._step_args
        while self._pending and self._pending[0] <= last:
            group = self._pending[0]
            slot = self._queued % len(self._scratch)
            weights, grad, scratch = self._scratch[slot]
            weights, grad = weights[: store.weights[group].numel()], grad[: store.weights[group].numel()]
            held = self._held.get(group)
            with streams.on(self._in):
                streams.wait(self._slot_free[slot], self._in)  # its last layer's bytes are out
                streams.wait(ex.grad_ready[group], self._in)  # the gradient's copy out of (or its) backward
                if held is None:
                    grad.copy_(store.grads[group], non_blocking=True)
                else:  # held on the GPU since its backward: stepped from there
                    grad = held
                if weights_are_masters:  # a split master's bf16 half, a bf16 master (an fp32 master writes the weights)
                    weights.copy_(store.weights[group], non_blocking=True)
                self.optimizer.stream_in(group, weights, scratch)
            copied_in = streams.record(self._in)
            with streams.on(self._step):
                streams.wait(copied_in, self._step)
                self.optimizer.step_group(group, grad, clip_coef, lr, None)
            stepped = streams.record(self._step)
            with streams.on(self._out):
                streams.wait(stepped, self._out)
                self.optimizer.stream_out(group)
                if not weights_are_masters:
                    store.weights[group].copy_(weights, non_blocking=True)
            self._slot_free[slot] = self._streamed_done[group] = streams.record(self._out)
            # popped only now (nothing above may raise after stream_out, or the group, no longer
            # on the device, would be stepped again on the CPU while its copy out is in flight)
            self._pending.pop(0)
            if held is not None:  # its bytes go back once the step has read them
                streams.keep_alive(self._held.pop(group), self._step)
            del held, grad
            self._queued += 1
        if not self._pending:  # the last one queued: the slots go back once the streams are done
            self._release_scratch()

    def _release_scratch(self) -> None:
        """Give the scratch slots back to the allocator once the streams' queued work on them is
        done."""
        for buffers in self._scratch:
            for t in buffers:
                for stream in (self._in, self._step, self._out):
                    self.executor.streams.keep_alive(t, stream)
        self._scratch, self._slot_free = [], []

    def _step_on_cpu(self, group: int) -> None:
        """Step ``group``, planned for the GPU, from the calling thread on the CPU, as the worker
        steps the others: from its host gradient (a device group's copied there first) into its
        host weights (a device group's resident copy is then reloaded from them)."""
        ex, store = self.executor, self.executor.store
        clip_coef, lr = self._step_args
        on_gpu = ex.device_grads.pop(group, None) if group in ex.device_groups else self._held.pop(group, None)
        grad = store.grads[group]
        if on_gpu is not None:  # the device group's or held gradient: to its host buffer, or to a new tensor
            grad = on_gpu.reshape(-1).to("cpu") if grad is None else grad.copy_(on_gpu.reshape(-1))
        else:
            ex.wait_grad(group)
        self.optimizer.step_group(group, grad, clip_coef, lr, store.weights[group])
        ex.weights_updated(group)

    def _ran_out(self, error: torch.OutOfMemoryError, groups: list[int], what: str) -> None:
        """Note ``error`` for the caller (``out_of_memory``) and warn that ``groups`` went to the CPU."""
        traceback.clear_frames(error.__traceback__)  # the failed step's locals: its GPU buffers
        if self.out_of_memory is None:
            self.out_of_memory = error.with_traceback(None)
        log.warning("the GPU ran out of memory for the optimizer step of groups %s (%s: %s); they are stepped on "
                    "the CPU instead, this update and the next ones of this plan", groups, what,
                    str(error).splitlines()[0] if str(error) else "")

    def _join(self) -> None:
        self._queue_streamed(self.num_groups)  # what no forward came to queue
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.last_step_seconds = self._worker_seconds
        for group, copied_out in self._streamed_done.items():
            if copied_out is not None:
                copied_out.synchronize()
        self._streamed_done.clear()
        for group in range(self.num_groups):
            self.wait_group(group)

    def finish(self) -> None:
        """Wait for the whole update and bring the groups stepped on the GPU back to the host
        (before saving, evaluating or exiting: the host store and optimizer state are then the
        whole state)."""
        self._join()
        self.optimizer.to_host()  # on the compute stream, after the steps queued there
        for group in self.executor.device_groups:
            self.executor.store.sync_weights_from_masters(group)  # an fp32 master's streamed weights
        self.executor.device_grads.clear()  # a skipped last step's: not held through what follows
        self._held.clear()

    def _run(self, clip_coef: float, lr: float, on_gpu: frozenset[int], ring: _GradRing) -> None:
        """Step every group but ``on_gpu`` (this update's GPU steps, as `start` found them: a
        streamed step that falls back to the CPU is the caller's), those whose gradients were
        held on the GPU from their ``ring`` slot."""
        t0 = time.perf_counter()
        store, parallel = self.executor.store, self.executor.parallel
        try:
            ring.fill()
            for group in range(self.num_groups):
                if group in on_gpu:
                    continue
                if group in ring.groups:
                    grad = ring.take(group)
                else:
                    self.executor.wait_grad(group)
                    grad = store.grads[group]
                if parallel is None:
                    self.optimizer.step_group(group, grad, clip_coef, lr, store.weights[group])
                else:
                    if grad.numel():  # a small group may leave a rank no elements
                        self.optimizer.step_group(group, grad, clip_coef, lr, store.weight_shard(group))
                    parallel.publish(store, group)
                if group in ring.groups:
                    ring.release(group)
                self._done[group].set()
        except BaseException as error:  # noqa: BLE001 (surfaced to the main thread by wait_group)
            self._error = error
            for event in self._done:
                event.set()
        self._worker_seconds = time.perf_counter() - t0

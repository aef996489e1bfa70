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

Data parallel (the executor has ``parallel``): the optimizer holds this rank's shards; each
group's step writes the rank's shard of the shared weights, then ``parallel.publish`` waits
until every rank's shard of that group is in this host's weights.
"""

from __future__ import annotations

import threading
import time

from lazytrain.optim.base import HostOptimizer
from lazytrain.runtime.executor import Executor


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
        if executor.device_groups and not optimizer.device_step:
            raise ValueError(
                f"the plan steps groups {sorted(executor.device_groups)} (the embedding, head and device layers) on "
                f"the GPU, which the {type(optimizer).__name__} optimizer cannot (its step is CPU-only): use "
                "optimizer.kind=hybrid8bit, or a plan with const_update=host"
            )
        self.last_step_seconds = 0.0
        self.wait_seconds = 0.0
        executor.before_load = self.wait_group

    def wait_group(self, group: int) -> None:
        """Block until ``group``'s pending update is written (a no-op if none is pending)."""
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
        on_device = self.executor.device_groups
        for group in range(self.num_groups):
            if group not in on_device:
                self._done[group].clear()
                self.executor.weights_updated(group)
        self.wait_seconds = 0.0
        if self.overlap:
            self._thread = threading.Thread(target=self._run, args=(clip_coef, lr), daemon=True)
            self._thread.start()
        else:
            self._run(clip_coef, lr)
            self.wait_group(0)
        for group in sorted(on_device):
            if group not in self.optimizer.device_groups:
                self.optimizer.to_device(group, self.executor.resident[group])
            self.optimizer.step_group(group, self.executor.device_grads.pop(group), clip_coef, lr, None)

    def _join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
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

    def _run(self, clip_coef: float, lr: float) -> None:
        t0 = time.perf_counter()
        store, parallel = self.executor.store, self.executor.parallel
        try:
            for group in range(self.num_groups):
                if group in self.executor.device_groups:
                    continue
                self.executor.wait_grad(group)
                if parallel is None:
                    self.optimizer.step_group(group, store.grads[group], clip_coef, lr, store.weights[group])
                else:
                    if store.grads[group].numel():  # a small group may leave a rank no elements
                        self.optimizer.step_group(group, store.grads[group], clip_coef, lr,
                                                  store.weight_shard(group))
                    parallel.publish(store, group)
                self._done[group].set()
        except BaseException as error:  # surfaced to the main thread by wait_group
            self._error = error
            for event in self._done:
                event.set()
        self.last_step_seconds = time.perf_counter() - t0

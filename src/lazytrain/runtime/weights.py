"""GPU weight slots: layer weights stream in ahead of use on the H2D stream.

The executor tells the streamer the step's whole schedule of layer uses (forward 0..L-1,
then the backward segments), acquires layers strictly in that order and releases them when
their compute is queued. After each acquire the streamer starts the copies of the next
``depth`` scheduled layers into free slots, so the copy of layer i+1 runs while layer i
computes. A layer still resident from an earlier use (the last forward layers are the first
backward ones) is not copied again; eviction picks the released slot whose layer is needed
furthest in the future.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lazytrain.runtime.streams import Streams, StreamTrace


class WeightStreamer:
    def __init__(
        self,
        host_weights: list[torch.Tensor],
        num_slots: int,
        depth: int,
        streams: Streams,
        device: torch.device,
        before_load: Callable[[int], None] | None = None,
        trace: StreamTrace | None = None,
    ):
        if num_slots < 2:
            raise ValueError(f"at least 2 weight slots are needed, got {num_slots}")
        numel = max(w.numel() for w in host_weights)
        self.host = host_weights
        self.streams = streams
        self.depth = depth
        self.before_load = before_load
        self.trace = trace
        self.slots = [torch.empty(numel, dtype=host_weights[0].dtype, device=device) for _ in range(num_slots)]
        self.layer_of: list[int | None] = [None] * num_slots
        self.state = ["empty"] * num_slots  # empty | pending | acquired | released
        self.ready: list[torch.cuda.Event | None] = [None] * num_slots
        self.free: list[torch.cuda.Event | None] = [None] * num_slots
        self.schedule: list[int] = []
        self.cursor = 0
        self.h2d_bytes = 0

    @property
    def slot_bytes(self) -> int:
        return sum(s.numel() * s.element_size() for s in self.slots)

    def invalidate(self) -> None:
        """Forget resident copies (the host weights changed)."""
        for s in range(len(self.slots)):
            if self.state[s] in ("pending", "acquired"):
                raise RuntimeError("weights invalidated while a slot is in use")
            self.layer_of[s] = None
            self.state[s] = "empty"

    def begin(self, schedule: list[int], prefetch: bool = True) -> None:
        """Start a step's schedule; ``prefetch=False`` copies nothing until the first `acquire`
        (whose layer's weights may wait for the optimizer: `before_load`)."""
        if any(state in ("pending", "acquired") for state in self.state):
            # an abandoned step (an exception mid-step): wait for its copies, forget the slots
            if self.streams.cuda:
                torch.cuda.synchronize(self.streams.device)
            self.layer_of = [None] * len(self.slots)
            self.state = ["empty"] * len(self.slots)
        self.schedule = schedule
        self.cursor = 0
        self.h2d_bytes = 0
        if prefetch:
            self._prefetch()

    def _slot_of(self, layer: int) -> int | None:
        for s, owner in enumerate(self.layer_of):
            if owner == layer:
                return s
        return None

    def _next_use(self, layer: int | None) -> int:
        if layer is None:
            return -1
        for k in range(self.cursor, len(self.schedule)):
            if self.schedule[k] == layer:
                return k
        return len(self.schedule) + 1

    def _victim(self) -> int | None:
        candidates = [s for s in range(len(self.slots)) if self.state[s] in ("empty", "released")]
        if not candidates:
            return None
        return max(candidates, key=lambda s: (self._next_use(self.layer_of[s]) if self.state[s] == "released" else 1 << 30))

    def _load(self, layer: int) -> bool:
        slot = self._victim()
        if slot is None:
            return False
        if self.before_load is not None:
            self.before_load(layer)
        src = self.host[layer]
        dst = self.slots[slot][: src.numel()]
        self.streams.wait(self.free[slot], self.streams.h2d)
        span = self.trace.begin(self.streams.h2d) if self.trace else None
        with self.streams.on(self.streams.h2d):
            dst.copy_(src, non_blocking=True)
        if self.trace:
            self.trace.end("h2d", span, self.streams.h2d)
        self.ready[slot] = self.streams.record(self.streams.h2d)
        self.layer_of[slot] = layer
        self.state[slot] = "pending"
        self.h2d_bytes += src.numel() * src.element_size()
        return True

    def _prefetch(self) -> None:
        for k in range(self.cursor, min(self.cursor + self.depth, len(self.schedule))):
            layer = self.schedule[k]
            if self._slot_of(layer) is None and not self._load(layer):
                return

    def acquire(self, layer: int) -> torch.Tensor:
        """The flat weights of ``layer`` on the GPU, ready for compute-stream use."""
        if self.cursor >= len(self.schedule) or self.schedule[self.cursor] != layer:
            expected = self.schedule[self.cursor] if self.cursor < len(self.schedule) else None
            raise RuntimeError(f"weight schedule out of order: asked for layer {layer}, expected {expected}")
        self.cursor += 1
        slot = self._slot_of(layer)
        if slot is None:
            if not self._load(layer):
                raise RuntimeError(
                    f"no free weight slot for layer {layer} ({len(self.slots)} slots); "
                    "the plan's segments need more slots than were allocated"
                )
            slot = self._slot_of(layer)
        self.streams.wait(self.ready[slot])
        self.state[slot] = "acquired"
        self._prefetch()
        return self.slots[slot][: self.host[layer].numel()]

    def release(self, layer: int) -> None:
        """The compute queued so far is the last use of ``layer`` until its next acquire."""
        slot = self._slot_of(layer)
        if slot is None or self.state[slot] != "acquired":
            raise RuntimeError(f"layer {layer} released but not acquired")
        self.free[slot] = self.streams.record()
        self.state[slot] = "released"
        self._prefetch()

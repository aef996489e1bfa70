"""Where saved activations live between forward and backward: GPU or pinned host memory.

``put`` stores a tensor on a tier and returns a handle; ``prefetch`` starts bringing it back
to the GPU (on the H2D stream) ahead of use; ``get`` returns it on the GPU, with the compute
stream ordered after the copy. Offload copies run on the D2H stream after the compute that
produced the tensor, so forward compute never waits for them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lazytrain.runtime.streams import Streams, StreamTrace


@dataclass(slots=True)
class Handle:
    tier: str
    tensor: torch.Tensor | None = None  # gpu: the tensor; host: the pinned copy
    shape: tuple[int, ...] = ()
    dtype: torch.dtype | None = None
    stored: torch.cuda.Event | None = None  # host copy complete
    fetched: torch.Tensor | None = None  # GPU copy being prefetched
    fetched_event: torch.cuda.Event | None = None


class ActivationStore:
    def __init__(self, streams: Streams, device: torch.device, trace: StreamTrace | None = None):
        self.streams = streams
        self.trace = trace
        self.device = device
        self.bytes_by_tier = {"gpu": 0, "host": 0}
        self.peak_by_tier = {"gpu": 0, "host": 0}
        # pinned buffers to reuse, each with the event after which nothing reads it any more
        self._pool: dict[tuple[int, torch.dtype], list[tuple[torch.Tensor, torch.cuda.Event | None]]] = {}

    def _account(self, tier: str, nbytes: int) -> None:
        self.bytes_by_tier[tier] += nbytes
        self.peak_by_tier[tier] = max(self.peak_by_tier[tier], self.bytes_by_tier[tier])

    def _host_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        free = self._pool.get((numel, dtype))
        if free:
            buf, last_read = free.pop()
            self.streams.wait(last_read, self.streams.d2h)
            return buf
        return torch.empty(numel, dtype=dtype, pin_memory=self.streams.cuda)

    def put(self, tensor: torch.Tensor, tier: str) -> Handle:
        nbytes = tensor.numel() * tensor.element_size()
        if tier == "gpu":
            self._account("gpu", nbytes)
            return Handle(tier="gpu", tensor=tensor)
        if tier == "host":
            src = tensor.detach().contiguous()
            buf = self._host_buffer(src.numel(), src.dtype)
            produced = self.streams.record()
            self.streams.wait(produced, self.streams.d2h)
            span = self.trace.begin(self.streams.d2h) if self.trace else None
            with self.streams.on(self.streams.d2h):
                buf.copy_(src.view(-1), non_blocking=True)
            if self.trace:
                self.trace.end("d2h", span, self.streams.d2h)
            self.streams.keep_alive(src, self.streams.d2h)
            self._account("host", nbytes)
            return Handle(
                tier="host", tensor=buf, shape=tuple(src.shape), dtype=src.dtype,
                stored=self.streams.record(self.streams.d2h),
            )
        raise ValueError(
            f"activation tier {tier!r} is not available in this executor; use 'gpu' or 'host'"
        )

    def prefetch(self, handle: Handle) -> None:
        if handle.tier != "host" or handle.fetched is not None:
            return
        self.streams.wait(handle.stored, self.streams.h2d)
        span = self.trace.begin(self.streams.h2d) if self.trace else None
        with self.streams.on(self.streams.h2d):
            out = torch.empty(handle.shape, dtype=handle.dtype, device=self.device)
            out.view(-1).copy_(handle.tensor, non_blocking=True)
        if self.trace:
            self.trace.end("h2d", span, self.streams.h2d)
        handle.fetched = out
        handle.fetched_event = self.streams.record(self.streams.h2d)

    def get(self, handle: Handle) -> torch.Tensor:
        if handle.tier == "gpu":
            return handle.tensor
        self.prefetch(handle)
        self.streams.wait(handle.fetched_event)
        out = handle.fetched
        self.streams.keep_alive(out, self.streams.compute)
        return out

    def free(self, handle: Handle) -> None:
        """Drop the stored copy (its pinned buffer goes back to the pool)."""
        if handle.tensor is None:
            return
        nbytes = handle.tensor.numel() * handle.tensor.element_size()
        self.bytes_by_tier[handle.tier] -= nbytes
        if handle.tier == "host":
            key = (handle.tensor.numel(), handle.tensor.dtype)
            self._pool.setdefault(key, []).append((handle.tensor, handle.fetched_event))
        handle.tensor = None
        handle.fetched = None

    def reset_peaks(self) -> None:
        self.peak_by_tier = dict(self.bytes_by_tier)

    def start_step(self) -> None:
        """Nothing is stored between steps (an abandoned step's handles are garbage)."""
        self.bytes_by_tier = {tier: 0 for tier in self.bytes_by_tier}
        self.reset_peaks()

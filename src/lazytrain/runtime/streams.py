"""CUDA streams and events that become no-ops on the CPU.

On a CUDA device the executor uses three streams: compute (the current stream), H2D and
D2H. Work on different streams is ordered only by events. On the CPU every operation is
synchronous, so the same code runs with these methods doing nothing.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Iterator

import torch


class Streams:
    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.compute = torch.cuda.current_stream(device)
            self.h2d = torch.cuda.Stream(device)
            self.d2h = torch.cuda.Stream(device)
        else:
            self.compute = self.h2d = self.d2h = None

    def record(self, stream: torch.cuda.Stream | None = None) -> torch.cuda.Event | None:
        """An event marking all work queued so far on ``stream`` (compute if None)."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(stream or self.compute)
        return event

    def wait(self, event: torch.cuda.Event | None, stream: torch.cuda.Stream | None = None) -> None:
        """Make ``stream`` (compute if None) wait for ``event``, without blocking the host."""
        if event is not None:
            (stream or self.compute).wait_event(event)

    @contextmanager
    def on(self, stream: torch.cuda.Stream | None) -> Iterator[None]:
        ctx = torch.cuda.stream(stream) if (self.cuda and stream is not None) else nullcontext()
        with ctx:
            yield

    def keep_alive(self, tensor: torch.Tensor, stream: torch.cuda.Stream | None) -> None:
        """Tell the caching allocator ``tensor`` is in use on ``stream`` (a side stream)."""
        if self.cuda and stream is not None and tensor.is_cuda:
            tensor.record_stream(stream)

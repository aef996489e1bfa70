"""CUDA streams and events that become no-ops on the CPU.

On a CUDA device the executor uses three streams: compute (the current stream), H2D and
D2H. Work on different streams is ordered only by events. On the CPU every operation is
synchronous, so the same code runs with these methods doing nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

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

    def record(self, stream: torch.cuda.Stream | None = None, timing: bool = False) -> torch.cuda.Event | None:
        """An event marking all work queued so far on ``stream`` (compute if None)."""
        if not self.cuda:
            return None
        event = torch.cuda.Event(enable_timing=timing)
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


class StreamTrace:
    """Optional CUDA-event spans per stream, to split a step into compute and exposed waits.

    Off by default (``enabled=False``): the executor then records nothing. When on, each
    span is a pair of events on one stream; ``summary`` reads them after the step (one sync)
    and returns busy and exposed milliseconds per stream, where *exposed* means time in
    which the compute stream ran nothing while that stream was busy.
    """

    def __init__(self, streams: Streams):
        self.streams = streams
        self.enabled = False
        self.spans: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self._origin: torch.cuda.Event | None = None

    def start_step(self) -> None:
        self.spans = []
        self._origin = self.streams.record(timing=True) if self.enabled else None

    def begin(self, stream: torch.cuda.Stream | None = None) -> torch.cuda.Event | None:
        if not self.enabled or not self.streams.cuda:
            return None
        return self.streams.record(stream, timing=True)

    def end(self, kind: str, start: torch.cuda.Event | None, stream: torch.cuda.Stream | None = None) -> None:
        """Close a span of ``kind``: compute, h2d or d2h, optionally ``stream:label`` (``h2d:act``),
        whose busy time `summary` also reports on its own (``h2d_act_busy_ms``)."""
        if start is not None:
            self.spans.append((kind, start, self.streams.record(stream, timing=True)))

    def summary(self) -> dict[str, float]:
        """Busy and exposed ms per stream kind over the step (synchronizes the device)."""
        if not self.spans or self._origin is None:
            return {}
        end = self.streams.record(timing=True)
        end.synchronize()
        total = self._origin.elapsed_time(end)
        intervals: dict[str, list[tuple[float, float]]] = {}
        labelled: dict[str, list[tuple[float, float]]] = {}
        for kind, a, b in self.spans:
            span = (self._origin.elapsed_time(a), self._origin.elapsed_time(b))
            stream, _, label = kind.partition(":")
            intervals.setdefault(stream, []).append(span)
            if label:
                labelled.setdefault(f"{stream}_{label}", []).append(span)
        return exposure(intervals, total) | {f"{name}_busy_ms": _length(_union(iv)) for name, iv in labelled.items()}


def exposure(intervals: dict[str, list[tuple[float, float]]], total: float) -> dict[str, float]:
    """Busy and exposed ms per stream from its spans over a step of ``total`` ms.

    A copy stream's *exposed* time is when it was busy and the compute stream was idle; time
    already claimed by H2D is not counted again for D2H. What is left of compute's idle time
    is ``other_idle_ms`` (the CPU optimizer, NVMe, launch gaps).
    """
    merged = {kind: _union(iv) for kind, iv in intervals.items()}
    compute = merged.get("compute", [])
    idle = _complement(compute, 0.0, total)
    out = {"step_ms": total}
    claimed: list[tuple[float, float]] = []
    for kind in ("h2d", "d2h"):
        busy = merged.get(kind, [])
        out[f"{kind}_busy_ms"] = _length(busy)
        exposed = _intersect(_intersect(idle, busy), _complement(claimed, 0.0, total))
        out[f"{kind}_exposed_ms"] = _length(exposed)
        claimed = _union(claimed + exposed)
    out["compute_ms"] = _length(compute)
    out["other_idle_ms"] = _length(idle) - _length(_intersect(idle, claimed))
    return out


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _complement(intervals: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    out, cursor = [], lo
    for a, b in _union(intervals):
        if a > cursor:
            out.append((cursor, min(a, hi)))
        cursor = max(cursor, b)
    if cursor < hi:
        out.append((cursor, hi))
    return out


def _intersect(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out, i, j = [], 0, 0
    xs, ys = _union(xs), _union(ys)
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if a < b:
            out.append((a, b))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


"""SIGINT / SIGTERM during training: finish the step, write a checkpoint, stop.

The first signal only sets `StopRequest.signum`; the loop looks at it after each step, so
no step is cut in half (a signal raised inside autograd would leave gradients and optimizer
state inconsistent). A second signal restores the previous handlers and re-raises, for a
user who does not want to wait for the checkpoint.
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import Self

from lazytrain.errors import LazyTrainError

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class TrainingInterrupted(LazyTrainError):
    """The run stopped on a signal after writing a checkpoint; exits with 128 + the signal."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


class StopRequest:
    """A context in which SIGINT and SIGTERM ask the training loop to stop after the current step."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def __enter__(self) -> Self:
        if threading.current_thread() is not threading.main_thread():
            return self  # only the main thread may take signals; elsewhere they act as before
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        self._restore()

    def _restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        if self.signum is not None:
            self._restore()
            signal.raise_signal(signum)
            return
        self.signum = signum
        print(f"\nlazytrain: {signal.Signals(signum).name} received: finishing this step and writing a "
              "checkpoint (send it again to stop at once, without one)", file=sys.stderr, flush=True)

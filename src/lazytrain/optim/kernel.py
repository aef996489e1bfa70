"""Build (once per machine) and load the fused 8-bit AdamW C++ kernel.

The kernel is compiled at first use with ``-march=native`` by ``torch.utils.cpp_extension``,
so it must be built on the machine that runs it: the build directory is keyed by the torch
version, this CPU's model and flags and the source's hash, under ``$TORCH_EXTENSIONS_DIR`` or
``~/.cache/lazytrain/torch_extensions``. If the build fails (no compiler, no ninja), callers
get ``None`` and a warning, and use the pure-torch path of the same math.

``LAZYTRAIN_OPTIM_KERNEL`` picks the path: ``auto`` (default: the kernel if it builds),
``cpp`` (the kernel or an error) or ``torch`` (never build).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import threading
import time
import warnings
from pathlib import Path
from types import ModuleType

import torch

SOURCE = Path(__file__).parent / "csrc" / "hybrid8bit.cpp"
KERNEL_CHOICES = ("auto", "cpp", "torch")
_CFLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fopenmp"]
# No -fopenmp at link time: the OpenMP symbols then resolve to the runtime torch already
# loaded, so the kernel shares torch's thread pool instead of starting a second one.
_LDFLAGS: list[str] = []

_lock = threading.Lock()
_loaded: ModuleType | None = None
_failure: str | None = None


def kernel_choice(requested: str | None = None) -> str:
    choice = requested or os.environ.get("LAZYTRAIN_OPTIM_KERNEL", "auto")
    if choice not in KERNEL_CHOICES:
        raise ValueError(
            f"optimizer kernel {choice!r} is not one of {KERNEL_CHOICES} "
            "(argument kernel= or LAZYTRAIN_OPTIM_KERNEL)"
        )
    return choice


def cpu_description() -> str:
    """CPU model name and logical core count, from /proc/cpuinfo where there is one."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model} ({os.cpu_count()} logical cores)"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.machine()


def build_directory() -> Path:
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "lazytrain" / "torch_extensions"
    # the source's own hash too: a build of another version of the kernel is never loaded
    source = hashlib.sha1(SOURCE.read_bytes()).hexdigest()
    key = "|".join([torch.__version__, cpu_description(), _cpu_flags(), " ".join(_CFLAGS), source])
    return base / f"lazytrain_hybrid8bit_{hashlib.sha1(key.encode()).hexdigest()[:12]}"


STALE_LOCK_S = 600
"""Without ``fcntl``: a build lock this old belongs to a build that was killed (a build takes
about a minute)."""


@contextlib.contextmanager
def _building(directory: Path):
    """The right to build in ``directory``, with torch's build lock cleared if a killed build left
    it.

    torch's lock is a file (``lock``) that a killed build leaves behind, and the next build waits
    on it forever (on the H200, 2026-12-03, a benchmark started 2 minutes after a test run was
    killed printed nothing in 330 s, most likely waiting there). Each LazyTrain build first
    takes an ``flock`` on a file of its own, which the kernel releases when its holder dies;
    holding it, no other LazyTrain build is running in this directory, so a ``lock`` file found
    then is a dead build's and is removed. Without ``fcntl`` (not Linux): only a lock older than
    `STALE_LOCK_S`.
    """
    try:
        import fcntl
    except ImportError:
        fcntl = None
    lock = directory / "lock"
    if fcntl is None:
        _remove_lock(lock, older_than=STALE_LOCK_S)
        yield
        return
    with open(directory / "lazytrain_build.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        try:
            _remove_lock(lock, older_than=0)
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)


def _remove_lock(lock: Path, older_than: float) -> None:
    try:
        age = time.time() - lock.stat().st_mtime
    except OSError:
        return
    if age >= older_than:
        warnings.warn(f"lazytrain: removing the kernel build lock {lock} that a killed build left "
                      f"({age / 60:.1f} min old)", RuntimeWarning, stacklevel=4)
        lock.unlink(missing_ok=True)


def load_kernel(required: bool = False) -> ModuleType | None:
    """The compiled kernel module, or ``None`` (with one warning) when it cannot be built."""
    global _loaded, _failure
    with _lock:
        if _loaded is not None or (_failure is not None and not required):
            return _loaded
        try:
            from torch.utils import cpp_extension

            directory = build_directory()
            directory.mkdir(parents=True, exist_ok=True)
            with _building(directory):
                _loaded = cpp_extension.load(
                    name="lazytrain_hybrid8bit",
                    sources=[str(SOURCE)],
                    extra_cflags=_CFLAGS,
                    extra_ldflags=_LDFLAGS,
                    build_directory=str(directory),
                    verbose=os.environ.get("LAZYTRAIN_VERBOSE_BUILD", "") == "1",
                )
            _failure = None
            return _loaded
        except Exception as err:  # any build or load failure means: use the torch path
            reason = str(err).strip().splitlines()[0] if str(err).strip() else ""
            _failure = f"{type(err).__name__}: {reason}"
            message = (
                f"lazytrain: the fused 8-bit optimizer kernel did not build ({_failure}). "
                "It needs a C++ compiler (g++) and ninja on this machine; set "
                "LAZYTRAIN_VERBOSE_BUILD=1 to see the build log."
            )
            if required:
                raise RuntimeError(message) from err
            warnings.warn(
                message + " Falling back to the pure-torch path (same math, 20 to 100 times "
                "slower); set LAZYTRAIN_OPTIM_KERNEL=torch to choose it without trying.",
                RuntimeWarning,
                stacklevel=3,
            )
            return None


def build_failure() -> str | None:
    """Why the last build failed, or ``None``."""
    return _failure

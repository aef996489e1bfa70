"""Build (once per machine) and load the fused AdamW C++ kernels (8-bit and 4-bit states).

The kernel is compiled at first use with ``-march=native`` by ``torch.utils.cpp_extension``,
so it must be built on the machine that runs it: the build directory is keyed by the torch
version, this CPU's model and flags, the compiler flags and the hash of the source and of the
headers in ``csrc/`` (`HEADERS`: ``master.h``, which both kernels include), under
``$TORCH_EXTENSIONS_DIR`` or ``~/.cache/lazytrain/torch_extensions``. If the build fails (no
compiler, no ninja), callers get ``None`` and a warning, and use the pure-torch path of the
same math.

The source has one vector path per instruction set (`VARIANTS`), chosen at compile time: the
native build runs the best one this CPU has. ``load_kernel(variant=...)`` builds the same
source with the later instruction sets switched off, so that each path can be run and tested
on one machine (a CPU with AVX-512 VBMI runs all four); each such build is cached like the
native one.

``LAZYTRAIN_OPTIM_KERNEL`` picks the path: ``auto`` (default: the kernel if it builds),
``cpp`` (the kernel or an error), ``torch`` (never build) or ``cpp-<variant>`` (the kernel
built for that instruction set only, e.g. ``cpp-avx2``: for tests and comparisons).

Each source in `SOURCES` is its own module (``name`` of `load_kernel` and `kernel_for`: the
8-bit kernel ``hybrid8bit``, the default, or ``hybrid4bit``), built and cached the same way.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

SOURCES = {name: Path(__file__).parent / "csrc" / f"{name}.cpp" for name in ("hybrid8bit", "hybrid4bit")}
"""The kernels by name: one C++ source each, built as a module of its own."""
SOURCE = SOURCES["hybrid8bit"]
HEADERS = tuple(sorted((Path(__file__).parent / "csrc").glob("*.h")))
"""The headers the kernels include (``master.h``: the master's load and store, shared so both
kernels round a bf16 master alike): part of every kernel's build key."""
_CFLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fopenmp"]
# No -fopenmp at link time: the OpenMP symbols then resolve to the runtime torch already
# loaded, so the kernel shares torch's thread pool instead of starting a second one.
_LDFLAGS: list[str] = []
_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


@dataclass(frozen=True, slots=True)
class Variant:
    """One vector path of the kernel (``simd()`` of its build names it)."""

    cpu_flags: tuple[str, ...]
    """What ``/proc/cpuinfo`` must list for ``-march=native`` to compile this path."""
    off: tuple[str, ...]
    """Compiler flags after ``-march=native`` that switch the later paths off."""


VARIANTS = {
    "avx512vbmi": Variant(("avx512f", "avx512bw", "avx512vbmi"), ()),
    "avx512": Variant(("avx512f",), ("-mno-avx512vbmi",)),
    "avx2": Variant(("avx2",), ("-mno-avx512f",)),
    "scalar": Variant((), ("-mno-avx512f", "-mno-avx2") if _X86 else ()),
}
"""The kernel's paths, best first: ``-march=native`` compiles the first one the CPU has."""

KERNEL_CHOICES = ("auto", "cpp", "torch", *(f"cpp-{name}" for name in VARIANTS))

_lock = threading.Lock()
_loaded: dict[str, ModuleType] = {}
"""Built modules by variant; the native build (``-march=native`` alone) as ``"native"``; a
kernel other than ``hybrid8bit`` prefixed by its name (``"hybrid4bit/native"``)."""
_failure: dict[str, str] = {}
"""Why the last build of a variant (``"native"``: the default build) failed, keyed as `_loaded`."""


def kernel_choice(requested: str | None = None) -> str:
    choice = requested or os.environ.get("LAZYTRAIN_OPTIM_KERNEL", "auto")
    if choice not in KERNEL_CHOICES:
        raise ValueError(
            f"optimizer kernel {choice!r} is not one of {KERNEL_CHOICES} "
            "(argument kernel= or LAZYTRAIN_OPTIM_KERNEL)"
        )
    return choice


def kernel_for(choice: str, name: str = "hybrid8bit") -> ModuleType | None:
    """The module of kernel ``name`` that steps with `kernel_choice`'s ``choice``: ``None`` for
    ``torch`` (and for ``auto`` where the kernel does not build); ``cpp`` and ``cpp-<variant>``
    raise instead."""
    if choice == "torch":
        return None
    if choice.startswith("cpp-"):
        return load_kernel(required=True, variant=choice.removeprefix("cpp-"), name=name)
    return load_kernel(required=choice == "cpp", name=name)


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


def missing_cpu_flags(variant: str) -> tuple[str, ...]:
    """The CPU flags ``variant`` needs that this CPU lacks (none: it can run here)."""
    if variant not in VARIANTS:
        raise ValueError(f"kernel variant {variant!r} is not one of {tuple(VARIANTS)}")
    have = set(_cpu_flags().split())
    return tuple(flag for flag in VARIANTS[variant].cpu_flags if flag not in have)


def native_variant() -> str:
    """The path the native build compiles: the first of `VARIANTS` this CPU can run."""
    return next(name for name in VARIANTS if not missing_cpu_flags(name))


def build_directory(variant: str | None = None, name: str = "hybrid8bit") -> Path:
    """Where kernel ``name``'s native build (``variant=None``) or a variant's build lives."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "lazytrain" / "torch_extensions"
    # the source's own hash too: a build of another version of the kernel is never loaded. The
    # headers' too: torch's JIT versioner hashes only the sources it is given (ninja's depfile
    # sees a header only when torch runs ninja), so a changed header would otherwise share the
    # directory of every kernel built from the old one
    source = source_hash(name)
    key = "|".join([torch.__version__, cpu_description(), _cpu_flags(), " ".join(_cflags(variant)), source])
    return base / f"{_module_name(variant, name)}_{hashlib.sha1(key.encode()).hexdigest()[:12]}"


def source_hash(name: str = "hybrid8bit") -> str:
    """sha1 of kernel ``name``'s source and of every header in `HEADERS` (in order): what a
    build of it was compiled from."""
    digest = hashlib.sha1(_source(name).read_bytes())
    for header in HEADERS:
        digest.update(header.name.encode() + b"\0" + header.read_bytes())
    return digest.hexdigest()


def _source(name: str) -> Path:
    if name not in SOURCES:
        raise ValueError(f"kernel {name!r} is not one of {tuple(SOURCES)}")
    return SOURCE if name == "hybrid8bit" else SOURCES[name]


def _cflags(variant: str | None) -> list[str]:
    return _CFLAGS if variant is None else [*_CFLAGS, *VARIANTS[variant].off]


def _module_name(variant: str | None, name: str = "hybrid8bit") -> str:
    return f"lazytrain_{name}" if variant is None else f"lazytrain_{name}_{variant}"


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


def load_kernel(required: bool = False, variant: str | None = None, name: str = "hybrid8bit") -> ModuleType | None:
    """The compiled module of kernel ``name`` (`SOURCES`), or ``None`` (with one warning) when it
    cannot be built.

    ``variant`` (a key of `VARIANTS`): the kernel built for that instruction set alone; the
    native build when it is `native_variant`, else a build of its own (cached like the
    native one). A variant this CPU cannot run is a ``ValueError``. ``required``: a failed
    build raises, with the compiler's output.
    """
    if variant is not None:
        missing = missing_cpu_flags(variant)
        if missing:
            raise ValueError(
                f"kernel variant {variant!r} cannot run on this CPU ({cpu_description()}): it lacks "
                f"{', '.join(missing)}; variants it can run: "
                f"{[name for name in VARIANTS if not missing_cpu_flags(name)]}"
            )
    _source(name)
    with _lock:
        if variant is not None and variant == native_variant():
            module = _load(required, None, name)
            if module is not None and module.simd() != variant:
                raise RuntimeError(
                    f"the native kernel build runs the {module.simd()!r} path, not {variant!r} as this "
                    "CPU's flags say: the compiler cannot target this CPU's instruction sets"
                )
            return module
        return _load(required, variant, name)


def _load(required: bool, variant: str | None, name: str = "hybrid8bit") -> ModuleType | None:
    """`load_kernel`'s build, under `_lock`."""
    key = variant or "native"
    if name != "hybrid8bit":
        key = f"{name}/{key}"
    if key in _loaded or (key in _failure and not required):
        return _loaded.get(key)
    try:
        from torch.utils import cpp_extension

        directory = build_directory(variant, name)
        directory.mkdir(parents=True, exist_ok=True)
        with _building(directory):
            module = cpp_extension.load(
                name=_module_name(variant, name),
                sources=[str(_source(name))],
                extra_cflags=_cflags(variant),
                extra_ldflags=_LDFLAGS,
                build_directory=str(directory),
                verbose=os.environ.get("LAZYTRAIN_VERBOSE_BUILD", "") == "1",
            )
        if variant is not None and module.simd() != variant:
            raise RuntimeError(f"the build for {variant!r} runs the {module.simd()!r} path")
    except Exception as err:  # any build or load failure means: use the torch path
        detail = str(err).strip()
        _failure[key] = f"{type(err).__name__}: {detail.splitlines()[0] if detail else ''}"
        which = "" if variant is None else f" (variant {variant})"
        bits = "4-bit" if name == "hybrid4bit" else "8-bit"
        message = (
            f"lazytrain: the fused {bits} optimizer kernel{which} did not build ({_failure[key]}). "
            "It needs a C++ compiler (g++) and ninja on this machine; set "
            "LAZYTRAIN_VERBOSE_BUILD=1 to see the build log."
        )
        if required:
            # the whole compiler output: a test or a user who asked for the kernel sees why
            raise RuntimeError(f"{message}\n{detail}") from err
        warnings.warn(
            message + " Falling back to the pure-torch path (same math, 20 to 100 times "
            "slower); set LAZYTRAIN_OPTIM_KERNEL=torch to choose it without trying.",
            RuntimeWarning,
            stacklevel=4,
        )
        return None
    _failure.pop(key, None)
    _loaded[key] = module
    return module


def build_failure() -> str | None:
    """Why the last native build failed, or ``None``."""
    return _failure.get("native")

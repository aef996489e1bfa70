"""The device a run uses: resolving it, its memory, its name, capping it, and timing on it."""

from __future__ import annotations

import gc
import logging
import os
import platform
import re
import statistics
import sys
import time
import traceback
from collections.abc import Callable

import torch

from lazytrain.errors import LazyTrainError

log = logging.getLogger(__name__)


class DeviceError(LazyTrainError, ValueError):
    pass


def resolve_device(name: str) -> torch.device:
    """``auto`` (cuda when available, else cpu), ``cpu``, ``cuda`` or ``cuda:N``."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise DeviceError(f"training.device={name!r} is not a device; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"training.device={name} but CUDA is not available; use training.device=cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise DeviceError(f"training.device={name} but this machine has {torch.cuda.device_count()} GPU(s)")
    elif device.type != "cpu":
        raise DeviceError(f"training.device={name!r}: only cpu and cuda devices are supported")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """Compute dtype: ``auto`` is bf16 on a GPU, fp32 on the CPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[name]


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's model name."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    from lazytrain.optim.kernel import cpu_description

    return cpu_description() if platform.system() == "Linux" else (platform.processor() or "cpu")


def free_memory(device: torch.device) -> int:
    """Bytes free on ``device`` (a quarter of host RAM for the CPU, which also holds the model)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    from lazytrain.memory.host_store import host_memory_total

    return host_memory_total() // 4


def release_failed_step(error: BaseException) -> None:
    """Let go of what a step that raised ``error`` still holds, and give the GPU memory back.

    An exception's traceback keeps every frame it unwound, and with them the step's locals:
    the executor, its weight slots, activations and gradients. While it is alive (inside the
    ``except`` that handles it) a `gc.collect` frees none of that, so a retry with a smaller
    plan ran out of memory too: a 9B batch search on the H200 went from batch 231 down to 111,
    every try failing with ~138 GB still allocated. Call it before retrying. The GPU is
    synchronised first: a copy the failed step queued may still target a host buffer that the
    collection unpins and frees.
    """
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    pending, seen = [error], set()
    while pending:
        e = pending.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)  # frames still running are left as they are
        pending += [e.__cause__, e.__context__]
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def oom_request_bytes(error: BaseException) -> int:
    """The bytes the failed allocation asked for ("Tried to allocate 3.22 GiB" in CUDA's
    out-of-memory message); 0 when the message does not say."""
    found = re.search(r"Tried to allocate ([0-9.]+) (B|KiB|MiB|GiB|TiB)", str(error))
    return int(float(found.group(1)) * _UNITS[found.group(2)]) if found else 0


def oom_need_bytes(error: BaseException, device: torch.device, earlier_peaks: tuple[int, ...] = ()) -> int:
    """What a step that ran out of GPU memory needed at least: the allocator's peak so far (and
    ``earlier_peaks``, the stages' where the peak was reset per stage) plus the allocation that
    failed."""
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    return max((peak, *earlier_peaks)) + oom_request_bytes(error)


def cap_gpu_memory(device: torch.device, gigabytes: float) -> None:
    """Cap the caching allocator of ``device`` at ``gigabytes`` GiB (no-op on the CPU)."""
    if device.type != "cuda":
        return
    total = torch.cuda.get_device_properties(device).total_memory
    # the device needs an index here (torch 2.11 rejects a bare 'cuda')
    index = device.index if device.index is not None else torch.cuda.current_device()
    torch.cuda.set_per_process_memory_fraction(min(1.0, gigabytes * 2**30 / total), index)


def prefer_expandable_segments() -> bool:
    """Let the CUDA caching allocator grow segments in place, unless the user configured it.

    A streamed step allocates many buffers of a few different sizes (weight slots,
    activations of a batch, head chunks); with fixed segments 3-6 GiB of a 24 GiB cap went to
    fragmentation on the H200. Takes effect only before CUDA's first allocation; returns
    whether it was set.
    """
    if "PYTORCH_CUDA_ALLOC_CONF" in os.environ:
        return False
    if torch.cuda.is_initialized():  # too late: the allocator read its settings at CUDA's start
        log.warning("CUDA was initialised before LazyTrain could set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: "
                    "the caching allocator runs with fixed segments, which may leave GiBs reserved but unusable "
                    "(out-of-memory errors below the plan's peak); set it in the environment, or build the session "
                    "before touching CUDA")
        return False
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    return True


SERIAL_COMPILE = "1"
"""`serial_compile`'s TORCHINDUCTOR_COMPILE_THREADS."""


def serial_compile() -> bool:
    """Have TorchInductor compile in this process, without its pool of worker processes,
    unless the user configured it (TORCHINDUCTOR_COMPILE_THREADS) or a compile already decided.

    The pool has one worker a core (up to 32), alive while a graph compiles: the first steps,
    when the host store already holds the model state the plan fills the host budget with, and
    none of it counted there. On the 16-core H100 machine (2026-12-07, Qwen3-30B-A3B) the
    machine used 4.7 GiB beyond this process's resident memory, its workers' summed RSS peaked at
    8.26 GB, and PyTorch's maintainers put a worker at over 1 GB (pytorch#156187). What is
    compiled here is a few fused elementwise kernels and the GPU optimizer step, so a serial
    compile costs little. Returns whether it was set.
    """
    if "TORCHINDUCTOR_COMPILE_THREADS" in os.environ:
        return False
    config = sys.modules.get("torch._inductor.config")
    if config is not None and config.compile_threads is not None:
        return False
    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = SERIAL_COMPILE
    return True


def time_ms(device: torch.device, fn: Callable[[], object], repeats: int, warmup: int = 2) -> float:
    """Median milliseconds of ``fn`` over ``repeats`` calls after ``warmup`` (CUDA events on a GPU)."""
    times = []
    for r in range(warmup + repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            fn()
            ms = (time.perf_counter() - t0) * 1e3
        if r >= warmup:
            times.append(ms)
    return statistics.median(times)

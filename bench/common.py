"""What the benchmarks share: the run header, device names, the session of a built-in shape,
random batches, timed training steps through the one executor, and writing results.

Records follow DESIGN.md section 6; each study writes one JSON list of records and a Markdown
report beside it under ``bench/results/``.
"""

from __future__ import annotations

import datetime
import gc
import itertools
import json
import os
import re
import statistics
import sys
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from torch._subclasses.fake_tensor import is_fake

from lazytrain.config import load_config
from lazytrain.data.dataset import Batch
from lazytrain.memory.host_store import host_memory_available, host_memory_total
from lazytrain.memory.nvme import NvmeStore
from lazytrain.optim.base import HostOptimizer
from lazytrain.plan.plan import Plan
from lazytrain.runtime.device import (
    device_name,
    prefer_expandable_segments,
    release_failed_step,
    time_ms,
)
from lazytrain.runtime.executor import Executor
from lazytrain.runtime.update import HostUpdater
from lazytrain.train.metrics import step_metrics
from lazytrain.train.session import Session, build_session

ROOT = Path(__file__).resolve().parents[1]  # the checkout: bench/ is run from it, not installed
RESULTS = ROOT / "bench" / "results"


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child run as ``python -m bench...``: the checkout first
    on ``PYTHONPATH``, so the child imports this ``bench`` from any working directory."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def today() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")


def device_tag(device: torch.device | str) -> str:
    """A short name for result files: ``h200`` for an H200, else the device or CPU model, slugged."""
    name = device if isinstance(device, str) else device_name(device)
    if "H200" in name:
        return "h200"
    slug = re.sub(r"[^a-z0-9]+", "-", name.split("(")[0].lower()).strip("-")
    return slug or "cpu"


def cpu_run_device() -> str:
    """The CPU a CPU-only study ran on, with the threads torch used."""
    return f"{device_name(torch.device('cpu'))}, {torch.get_num_threads()} threads"


def run_header(device: torch.device, **fields) -> dict:
    """The fields every record of a run starts with."""
    return {"date": today(), "device": device_name(device), "torch": torch.__version__,
            "transformers": transformers.__version__, "cpu_threads": torch.get_num_threads(), **fields}


def write_results(records: list[dict], stem: str, markdown: str, out_dir: Path | str = RESULTS) -> Path:
    """``out_dir/stem.json`` (the records) and ``out_dir/stem.md`` (the report); the JSON path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(records, indent=1) + "\n")
    (out / f"{stem}.md").write_text(markdown)
    return out / f"{stem}.json"


def bench_session(model: str, *, optimizer: str = "hybrid8bit", device: str = "cuda", batch: int = 1,
                  seq: int = 1024, head_chunk: int = 4096, nvme_dir: str | None = None,
                  overrides: tuple[str, ...] = ()) -> Session:
    """The session `lazytrain train` would build for the built-in shape ``model`` (bf16 on a GPU),
    with a fine-tuning optimizer (lr 1e-5, no weight decay)."""
    config = load_config(None, [
        f"model.source=builtin:{model}", f"optimizer.kind={optimizer}", "optimizer.lr=1e-5",
        "optimizer.weight_decay=0.0", f"training.device={device}", f"training.batch_size={batch}",
        f"data.max_seq_len={seq}", f"plan.head_chunk_tokens={head_chunk}",
        *([f"memory.nvme_dir={nvme_dir}"] if nvme_dir else []), *overrides,
    ])
    return build_session(config)


def random_batch(batch: int, seq: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids (never zeros) and labels equal to them: every position a target."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    return ids, ids.clone()


def compute_only(executor: Executor, batch: int, seq: int, repeats: int = 5) -> dict:
    """Forward + backward of one decoder layer of each type with its weights resident: the floor
    a streamed step is compared with (the stack's sum counts each layer at its type's time)."""
    adapter, dev, dtype = executor.adapter, executor.device, executor.dtype
    position_ids = torch.arange(seq, device=dev).unsqueeze(0).expand(batch, -1)
    rope = adapter.rotary_embeddings(position_ids, dtype)
    masks = adapter.layer_masks(None)
    x = torch.randn(batch, seq, adapter.hidden_size, device=dev, dtype=dtype)
    by_type = {}
    for kind in adapter.layer_type_names():
        index = adapter.layer_types.index(kind)
        slot = executor.store.weights[index + 1].to(dev)

        def layer(index=index, slot=slot) -> None:
            leaves = adapter.layouts[index + 1].leaves(slot)
            x_in = x.detach().requires_grad_()
            with torch.enable_grad():
                out = adapter.layer_forward(index, leaves, x_in, rope, masks)
                torch.autograd.grad(out, [x_in, *leaves.values()], torch.ones_like(out))

        by_type[kind] = time_ms(dev, layer, repeats)
    return {"fused_ops": adapter.pointwise.kind, "compute_only_layer_ms": by_type[adapter.layer_types[0]],
            "compute_only_layer_ms_by_type": by_type,
            "compute_only_layers_s": sum(by_type[kind] for kind in adapter.layer_types) / 1e3}


def descendants_rss_bytes(pid: int | None = None) -> int:
    """The summed resident memory of ``pid``'s (default: this process's) child processes and
    theirs (torch.compile's worker pool, say), from /proc; 0 where /proc is missing."""
    parent: dict[int, int] = {}
    rss: dict[int, int] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()  # after "(command name)"
            parent[int(entry.name)] = int(fields[1])
            rss[int(entry.name)] = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            continue
    root, total, frontier = pid if pid is not None else os.getpid(), 0, set()
    frontier = {p for p, pp in parent.items() if pp == root}
    seen: set[int] = set()
    while frontier:
        seen |= frontier
        total += sum(rss.get(p, 0) for p in frontier)
        frontier = {p for p, pp in parent.items() if pp in frontier and p not in seen}
    return total


class HostSampler:
    """The least MemAvailable seen (``least``, bytes; None where /proc/meminfo is missing),
    polled every ``period`` seconds on a thread of its own until `stop`, and the most resident
    memory this process's child processes held together (``children_most``, bytes; polled every
    ``children_every`` polls: it reads every process's /proc entry). Memory the host budget does
    not count: on the H100 machine a 30B-A3B step used 7.5 GiB more than its plan's host total
    (2026-12-07), of which the process's children were not measured."""

    def __init__(self, period: float = 0.1, children_every: int = 10):
        self.least: int | None = host_memory_available()
        self.children_most = descendants_rss_bytes()
        self._every = children_every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, args=(period,), daemon=True)
        self._thread.start()

    def _poll(self, period: float) -> None:
        polls = 0
        while not self._stop.wait(period):
            now = host_memory_available()
            if now is not None:
                self.least = now if self.least is None else min(self.least, now)
            polls += 1
            if polls % self._every == 0:
                self.children_most = max(self.children_most, descendants_rss_bytes())

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


ALLOCATOR_EVENTS = ("num_alloc_retries", "num_sync_all_streams", "num_device_alloc", "num_device_free")
"""CUDA caching-allocator counters a timed step reports the increase of (``cuda_<name>``): an
allocation that failed and was retried after freeing cached blocks, whole-device syncs,
cudaMalloc / cudaFree calls (or their expandable-segment map / unmap)."""


class SkippedUpdate(HostOptimizer):
    """``like``'s groups with the CPU update's cost removed: a step writes nothing (the weights stay
    as they are) and returns at once. For timing a plan as if the update ran elsewhere for free
    (`bench/plan_bench.py --update skipped`, the "free CPU update" row of `bench/studies/ceiling_bound.py`
    measured); never for training."""

    def __init__(self, like: HostOptimizer):
        super().__init__(like.masters, like.decay_numel, like.config)
        self._device: set[int] = set()
        self.device_step = like.device_step

    @property
    def device_groups(self) -> frozenset[int]:
        return frozenset(self._device)

    def to_device(self, group: int, weight: torch.Tensor) -> None:  # a plan's GPU-stepped groups: no cost either
        self._device.add(group)

    def to_host(self) -> None:
        self._device.clear()

    def streamed_bytes(self, group: int) -> int:
        return 0

    def stream_in(self, group: int, weight: torch.Tensor, scratch: torch.Tensor) -> None:
        self._device.add(group)

    def stream_out(self, group: int) -> None:
        self._device.discard(group)

    def discard_device(self, group: int) -> None:
        self._device.discard(group)

    def step_group(self, group: int, grad: torch.Tensor, clip_coef: float, lr: float,
                   weight_out: torch.Tensor | None) -> None:
        self.steps[group] += 1

    def state_dict(self) -> dict:
        raise RuntimeError("SkippedUpdate only times steps: it has no state to save")

    def load_state_dict(self, state: dict) -> None:
        raise RuntimeError("SkippedUpdate only times steps: it has no state to load")


def timed_steps(session: Session, plan: Plan, *, warmup: int, steps: int, serial_optimizer: bool = False,
                optimizer: HostOptimizer | None = None, nvme: NvmeStore | None = None,
                batches: Callable[[int], Batch] | None = None, stage_memory: bool = False,
                fetch_allocation: str = "compute") -> dict:
    """Train ``warmup + steps`` steps of ``plan`` on random tokens; the measured steps' medians.

    Step time runs from the start of one measured step to the start of the next. A step's
    overlapped CPU update runs under the next forward, so each step pays the previous step's
    exposed update (the warm-up's for the first), as in steady state.

    ``batches`` (step -> a data `Batch`, padded or packed) trains on real data instead; its steps
    differ in real tokens and width, so tokens/s and TFLOPS are then the measured steps' totals
    over their total time, not medians. ``stage_memory`` (CUDA): every step records the peak
    GPU bytes allocated per stage; the record keeps the last step's (``stage_memory_gb``:
    [stage, GB], the simulator's stage names). A step that runs out of GPU memory raises with
    its stages so far as the error's ``stage_memory`` ([stage, bytes]), for `oom_record`.
    ``fetch_allocation``: the executor's (`ActivationStore`).
    """
    adapter, device = session.adapter, session.device
    optimizer = optimizer or session.optimizer
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    at_start = torch.cuda.memory_allocated(device) if cuda else 0  # a failed try's leftovers show here
    executor = Executor(adapter, session.store, plan, device, nvme=nvme if nvme is not None else session.nvme,
                        fetch_allocation=fetch_allocation)
    updater = HostUpdater(executor, optimizer, overlap=not serial_optimizer)
    executor.trace.enabled = True
    batch, seq = plan.batch_size, plan.seq_len
    measured = []
    run_peak = 0  # with stage memory the allocator's peak is reset at every stage
    available = HostSampler()
    try:
        for step in range(warmup + steps):
            if stage_memory and cuda:
                run_peak = max([run_peak, torch.cuda.max_memory_allocated(device),
                                *(b for _, b in executor.stage_memory or [])])
                executor.stage_memory = []
            if batches is None:
                ids, labels = random_batch(batch, seq, adapter.vocab_size, seed=step)
                inputs = {"input_ids": ids, "labels": labels}
            else:
                data = batches(step)
                inputs = {"input_ids": data.input_ids, "labels": data.labels, "attention_mask": data.attention_mask,
                          "position_ids": data.position_ids, "document_ids": data.document_ids}
            t0 = time.perf_counter()
            allocator = torch.cuda.memory_stats(device) if cuda else {}
            queued = torch.cuda.Event(enable_timing=True) if cuda else None
            if queued is not None:
                queued.record()  # what the compute stream still runs of the update before the step
            stats = executor.forward_backward(**inputs)
            t1 = time.perf_counter()
            trace = executor.trace.summary()
            # the activation store's pinned host buffers after the step (padded batches of varying
            # length must not add to them every step)
            extra = {"act_fetch_alloc_s": executor.activations.fetch_alloc_seconds,
                     "host_buffers_gb": executor.activations.host_buffer_bytes / 1e9,
                     # host seconds: the forward + backward call, and reading its trace
                     "fwd_bwd_host_s": t1 - t0, "trace_read_s": time.perf_counter() - t1}
            if queued is not None and executor.trace._origin is not None:
                # GPU seconds from the step's call to the trace's first event on the compute stream
                extra["trace_origin_delay_s"] = queued.elapsed_time(executor.trace._origin) / 1e3
            if cuda:  # the caching allocator's slow paths during the step
                now = torch.cuda.memory_stats(device)
                extra.update({f"cuda_{key}": float(now.get(key, 0) - allocator.get(key, 0)) for key in ALLOCATOR_EVENTS})
            waited = updater.wait_seconds  # this step's forward waiting for the last update
            t_start = time.perf_counter()
            updater.start(min(1.0, 1.0 / (stats.grad_norm + 1e-6)), 1e-5)
            # the calling thread's time queueing the update (its GPU steps): before the next step
            extra["update_start_s"] = time.perf_counter() - t_start
            # the CPU worker's time on the last finished update (the step before's, overlapped)
            extra["cpu_update_s"] = updater.last_step_seconds
            if serial_optimizer:
                updater.finish()
            end = time.perf_counter()  # when the next step would start
            if step >= warmup:
                measured.append((t0, stats, trace, waited, inputs["input_ids"].shape[1], extra))
        updater.finish()
        available.stop()
    except BaseException as error:
        available.stop()
        if executor.stage_memory is not None:
            error.stage_memory = list(executor.stage_memory)
        error.gpu_alloc_at_start = at_start
        try:
            updater.finish()
        except RuntimeError:
            pass
        executor.abandon()  # its buffers go even if the failed graph still refers to it
        raise
    starts = [m[0] for m in measured] + [end]
    step_times = [b - a for a, b in itertools.pairwise(starts)]
    per_step = [step_metrics(adapter, m[1], m[2], t, m[4], device) | {"optimizer_wait_s": m[3]} | m[5]
                for m, t in zip(measured, step_times)]
    record = {key: statistics.median(r[key] for r in per_step) for key in per_step[0]
              if isinstance(per_step[0][key], float)}
    record["host_buffers_gb_by_step"] = [r["host_buffers_gb"] for r in per_step]
    record["cpu_update_s_by_step"] = [r["cpu_update_s"] for r in per_step]
    if batches is not None:
        total_s = sum(step_times)
        record.update({key: sum(r[key] * r["step_time_s"] for r in per_step) / total_s
                       for key in ("tokens_per_s", "tflops_model", "tflops_6nt", "tflops_active")
                       if key in per_step[0]})
        record["fill_ratio"] = sum(m[1].num_tokens for m in measured) / sum(m[1].num_slots for m in measured)
        record["tokens_per_step"] = [m[1].num_tokens for m in measured]
    record.update({
        "policy": plan.policy, "batch_size": batch, "seq_len": seq, "step_times_s": step_times,
        "predicted_step_time_s": None, "gpu_mem_cap_gb": None, "loss": measured[-1][1].loss,
        "cpu_optimizer_s": updater.last_step_seconds,
        "cpu_update_params": updater.cpu_params,
        # a GPU optimizer step that ran out of memory went to the CPU: not the plan's timing
        "update_out_of_memory": None if updater.out_of_memory is None else str(updater.out_of_memory).splitlines()[0],
        "host_total_gb": host_memory_total() / 1e9,
        "host_available_min_gb": None if available.least is None else available.least / 1e9,
        "host_children_rss_max_gb": available.children_most / 1e9,
    })
    if cuda:  # peaks over the whole run, not a median
        stages = executor.stage_memory or []
        record["peak_gpu_alloc_gb"] = max([run_peak, torch.cuda.max_memory_allocated(device),
                                           *(b for _, b in stages)]) / 1e9
        if stages:
            record["stage_memory_gb"] = [[name, b / 1e9] for name, b in stages]
        record["peak_gpu_reserved_gb"] = torch.cuda.max_memory_reserved(device) / 1e9
        record["gpu_alloc_at_start_gb"] = at_start / 1e9
    record.update(compute_only(executor, batch, seq))
    del executor, updater
    gc.collect()  # the layer's slot and activations of compute_only go with it
    if cuda:
        torch.cuda.empty_cache()
    return record


def live_tensors(device_type: str = "cuda", top: int = 10) -> list[list]:
    """The largest tensors on ``device_type`` Python still refers to, [shape, dtype, GB, the
    types of what refers to each], largest first: after a failed try, what the release did not free (the H200's torch retries
    of 2026-12-02 started ~5 GB above their first try; an empty list means the bytes are held
    where Python does not see them)."""
    found = {}
    for obj in gc.get_objects():
        # type(), not isinstance: that asks a dead weak proxy or a deprecated torch object itself
        if not issubclass(type(obj), torch.Tensor):
            continue
        try:  # an uninitialised parameter, a fake tensor (torch.compile's): no storage to count
            wanted = obj.device.type == device_type and obj.layout == torch.strided and not is_fake(obj)
            storage = obj.untyped_storage() if wanted else None
            address = None if storage is None else storage.data_ptr()
        except (RuntimeError, ValueError, NotImplementedError):
            storage = None
        if storage is not None:
            found.setdefault(address, (weakref.ref(obj), storage.nbytes()))
    here = sys._getframe()
    rows = []
    for ref, nbytes in sorted(found.values(), key=lambda item: -item[1])[:top]:
        tensor = ref()
        if tensor is not None:
            holders = sorted({type(r).__name__ for r in gc.get_referrers(tensor) if r is not here})
            rows.append([list(tensor.shape), str(tensor.dtype).removeprefix("torch."), nbytes / 1e9, holders])
        del tensor
    return rows


_OOM_SITES: list[dict] = []
"""What `record_oom_sites`' observer found at the last out-of-memory (read by `oom_record`; an
out-of-memory the run caught and survived leaves its own here too)."""

SITE_FILES = ("/lazytrain/", "/bench/", "/transformers/", "/fla/")
"""Source trees whose innermost frame names an allocation's site in `live_blocks_by_site`."""


def live_blocks_by_site(snapshot: dict, top: int = 30) -> list[dict]:
    """The allocator's live blocks (``torch.cuda.memory._snapshot()``, recorded with Python
    stacks) summed per allocation site and stream: the innermost frame in `SITE_FILES`
    (``file:line function``, "?" without one), largest first: [{site, stream, gb, blocks}],
    the last row the rest."""
    sums: dict[tuple[str, int], list[float]] = {}
    for segment in snapshot.get("segments", []):
        for block in segment.get("blocks", []):
            if not block.get("state", "").startswith("active"):
                continue
            frames = block.get("frames") or []
            frame = next((f for f in frames if any(d in f.get("filename", "") for d in SITE_FILES)), None)
            site = "?" if frame is None else (
                f"{frame['filename'].rsplit('/', 2)[-2]}/{frame['filename'].rsplit('/', 1)[-1]}:{frame['line']} "
                f"{frame['name']}")
            row = sums.setdefault((site, segment.get("stream", 0)), [0.0, 0])
            row[0] += block["size"] / 1e9
            row[1] += 1
    rows = [{"site": site, "stream": stream, "gb": gb, "blocks": n}
            for (site, stream), (gb, n) in sorted(sums.items(), key=lambda kv: -kv[1][0])]
    rest = rows[top:]
    if rest:
        rows = rows[:top] + [{"site": f"{len(rest)} more sites", "stream": None,
                              "gb": sum(r["gb"] for r in rest), "blocks": sum(r["blocks"] for r in rest)}]
    return rows


def record_oom_sites() -> None:
    """Keep the Python stack of every live CUDA allocation (no history of frees), and at an
    out-of-memory (inside the allocator, before anything is freed) sum the live blocks per site
    (`live_blocks_by_site`) for the next `oom_record` (``oom_live``: the request, what was
    allocated, the sites). A diagnostic: every allocation pays for its stack.

    Recording initialises CUDA, after which the allocator's settings are fixed: LazyTrain's
    (`prefer_expandable_segments`) are made first. Without that, the 27B's try of 2026-12-07
    ran with fixed segments and ran out with 11.07 GiB reserved but unallocated."""
    prefer_expandable_segments()
    torch.cuda.memory._record_memory_history(enabled="state", context="alloc", stacks="python")

    def observer(device, alloc, device_allocated, device_free):
        _OOM_SITES[:] = [{"request_gb": alloc / 1e9, "allocated_gb": device_allocated / 1e9,
                          "free_gb": device_free / 1e9, "sites": live_blocks_by_site(torch.cuda.memory._snapshot())}]

    torch._C._cuda_attach_out_of_memory_observer(observer)


def oom_record(name: str, header: dict, policy: str, batch: int, seq: int, error: BaseException) -> dict:
    """A run that ran out of GPU memory, recorded with the allocator's message (and, when the
    step recorded its stages, the peak of each stage it finished: ``stage_memory_gb``, and
    ``oom_after_stage``, the last of them)."""
    release_failed_step(error)  # else its frames keep the try's GPU memory and the next try fails too
    record = {"name": name, **header, "policy": policy, "batch_size": batch, "seq_len": seq,
              "oom": str(error).split("\n")[0]}
    if _OOM_SITES:  # `record_oom_sites`: what was live when it last ran out
        record["oom_live"], _OOM_SITES[:] = _OOM_SITES[0], []
    if torch.cuda.is_available():  # what the release left: the next try starts with it
        if hasattr(error, "gpu_alloc_at_start"):
            record["gpu_alloc_at_start_gb"] = error.gpu_alloc_at_start / 1e9
        record["gpu_alloc_after_release_gb"] = torch.cuda.memory_allocated() / 1e9
        try:  # diagnostics only: a failure here must not end the search it reports on
            record["gpu_tensors_after_release"] = live_tensors("cuda")
            # a probe: a backward that failed on the autograd engine's device thread may leave
            # its work queued there until the next backward runs; one tiny backward, then again
            probe = torch.ones(1, device="cuda", requires_grad=True)
            (probe * 2).sum().backward()
            del probe
            gc.collect()
            torch.cuda.empty_cache()
            record["gpu_alloc_after_probe_backward_gb"] = torch.cuda.memory_allocated() / 1e9
        except Exception as diagnostic:  # noqa: BLE001 - recorded, not raised
            record["gpu_diagnostics_error"] = f"{type(diagnostic).__name__}: {diagnostic}"
    stages = getattr(error, "stage_memory", None)
    if stages is not None:
        record["stage_memory_gb"] = [[stage, b / 1e9] for stage, b in stages]
        record["oom_after_stage"] = stages[-1][0] if stages else "step start"
    return record

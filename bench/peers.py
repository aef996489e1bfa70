"""LazyTrain next to what users would pick instead, on the same card, shapes, data and batch.

    python -m bench.peers --models qwen2.5-3b qwen2.5-7b --seq 1024 --batches 64 --out "$OUT"

Runs, each in its own process (``python -m bench.peers --worker RUN ...``, see
``bench/peer_runners.py`` for what each one trains and how):

- ``lazytrain:hybrid8bit`` and ``lazytrain:fp32``: the solved plan, 8-bit or fp32 Adam states;
- ``deepspeed_zero3_offload``: DeepSpeed ZeRO-3, parameters and optimizer offloaded to pinned
  CPU memory, DeepSpeed's CPU Adam, bf16 (``pip install -e '.[peers]'``);
- ``fsdp2_cpu_offload``: FSDP2 ``fully_shard`` per decoder layer with ``CPUOffloadPolicy``,
  torch's fused CPU AdamW;
- ``pytorch_gpu``: everything on the GPU, the no-offload ceiling where the model fits.

Every run: the same random init, random tokens (seed = step), AdamW lr 1e-5 with clipping at
1.0, activation checkpointing per decoder layer (LazyTrain: its plan's choice), a chunked LM
head and loss, ``--warmup`` + ``--steps`` steps (medians of the measured ones). A record per
row: tokens/s, TFLOPS by both formulas, step time, peak GPU memory, host memory, the optimizer
and whether its update is exact (AdamW on fp32 masters with fp32 moments; 8-bit states are
not). A run that cannot give numbers is a row that says why: ``not installed``, ``does not fit
host memory`` (the parent's estimate before starting it, or LazyTrain's own pre-flight),
``killed: host memory low`` (the watchdog below), ``out of GPU memory``, ``does not fit GPU
memory``, ``timed out``, ``failed`` (with the worker's last log line).

Host memory: before a peer starts, its model state is estimated (ZeRO-3 offload 18 B/param;
FSDP2 16 B/param, its pinned parameters and gradients rounded up to powers of two as torch's
pinned allocator does) against the memory available less ``--host-reserve-gb``; while any
worker runs, the parent polls the machine's available memory and kills the worker when it
drops below the reserve (a host whose RAM fills stops answering). ``host_rss_gb`` is the
worker's peak RSS; ``host_used_gb`` the machine's peak used memory during the run less what
was used before it (pinned memory included either way).

``--batches 64 max`` adds, per run, a search for its largest batch, at most ``--max-tries``
extra runs (`Study.largest_batch`): from where a line through the first batch's GPU peak fills
0.9 of the card (LazyTrain, whose plan fills the card at any batch: from 0.9 of the planner's
own largest batch, recorded by its first run), then up, then bisection. The largest batch that
ran is marked, and whether a failure or ``--max-batch`` bounded it (``largest_batch_bounded``; the reports say "largest tried" when not).

JSON records (DESIGN.md section 6; written after every row) and a Markdown report per model
go to ``--out`` as ``peers_MODEL_DEVICE_DATE_sSEQ``; each worker's log to ``--out``/peers_logs.
``bench/readme_table.py`` writes the README's headline table from the committed records.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch
import transformers

from bench.common import cpu_run_device, device_tag, today, write_results

ROOT = Path(__file__).resolve().parents[1]
GB = 1e9
GUESS_FILL = 0.9
"""The share of the GPU the largest-batch search's first guess aims to fill (fragmentation and
the allocator's reserve take some of the rest)."""
RUNS = ("lazytrain:hybrid8bit", "lazytrain:fp32", "deepspeed_zero3_offload", "fsdp2_cpu_offload", "pytorch_gpu")
PROCESS_BYTES = 4 * 10**9
"""A worker beyond its model state: interpreter, torch and CUDA libraries, CUDA context, data;
also what a LazyTrain worker uses beyond its ``memory.host_limit_gb`` budget. On the H200 the 7B
fp32 worker used 2.86 GB past that budget at batch 64 (12-01) and at least 3.08 GB at batch
128 (12-03), when the watchdog stopped it 0.1 GB inside the 6 GB reserve: 3 GB was too few."""
POLL_S = 0.25
GPU_MEMORY = ("out of GPU memory", "does not fit GPU memory")
"""Statuses that a smaller batch may cure (what the largest-batch search walks on)."""
NUMBERS = ("tokens_per_s", "tflops_6nt", "tflops_model", "step_time_s", "predicted_step_time_s",
           "peak_gpu_alloc_gb", "peak_gpu_reserved_gb", "host_rss_gb")


def meminfo() -> tuple[int, int]:
    """(total, available) bytes of host memory, from /proc/meminfo."""
    fields = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":", 1)
            fields[key] = int(value.split()[0]) * 1024
    return fields["MemTotal"], fields["MemAvailable"]


def pinned_bytes(nbytes: int) -> int:
    """torch's pinned (caching host) allocator rounds each allocation up to a power of two."""
    return 1 << math.ceil(math.log2(nbytes)) if nbytes > 0 else 0


def host_estimate(run: str, param_numels: list[int], pin_memory: bool) -> tuple[int, str] | None:
    """Host bytes a peer needs for its model state (and the process), with how they were
    counted; None for LazyTrain (its own pre-flight decides) and the GPU-only run."""
    n = sum(param_numels)
    if run == "deepspeed_zero3_offload":
        state = 18 * n
        how = ("ZeRO-3 offload: bf16 parameters 2 + fp32 master 4 + fp32 gradients 4 + fp32 Adam m, v 8 = "
               "18 B/param (a lower bound: pinned buffers round up; DeepSpeed's own estimator adds 1.5x)")
    elif run == "fsdp2_cpu_offload":
        if pin_memory:
            state = sum(2 * pinned_bytes(4 * k) + 8 * k for k in param_numels)
            how = ("FSDP2 CPU offload, pinned: fp32 parameters and gradients (each rounded up to a power of two "
                   "by torch's pinned allocator) + fp32 Adam m, v 8 B/param")
        else:
            state = 16 * n
            how = "FSDP2 CPU offload, unpinned: fp32 parameters 4 + gradients 4 + Adam m, v 8 = 16 B/param"
    else:
        return None
    return state + PROCESS_BYTES, how


def gpu_total_bytes() -> int | None:
    """GPU 0's memory from nvidia-smi (None without it), so this process never touches CUDA."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout.split()
        return int(out[0]) * 2**20 if out else None
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def deepspeed_problem() -> str | None:
    """Why DeepSpeed cannot run here, or None: not installed, or no way to compile its CPU Adam
    on first use (a C++ compiler, ninja and the Python headers)."""
    if importlib.util.find_spec("deepspeed") is None:
        return "deepspeed is not importable: pip install -e '.[peers]'"
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    missing = [name for name, found in (("a C++ compiler (c++)", shutil.which("c++")),
                                        ("ninja", shutil.which("ninja")),
                                        (f"the Python headers ({headers})", headers.exists())) if not found]
    if missing:
        return f"DeepSpeed's CPU Adam compiles on first use and needs {', '.join(missing)}"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def device_description(device: str) -> str:
    """The device's name, without initialising CUDA here (a context in this process would
    take GPU memory from the workers)."""
    if device.startswith("cuda"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                 text=True, timeout=30, check=True).stdout.splitlines()
            return out[0].strip() if out else "cuda"
        except (OSError, subprocess.SubprocessError):
            return "cuda"
    return cpu_run_device()


@dataclasses.dataclass(kw_only=True, slots=True)
class Worker:
    """What a worker process left: its record (None if it died without one), how it ended,
    and the machine's host memory during it."""

    record: dict | None
    status: str | None
    """Set when the parent ended the worker or it died: killed, timed out, failed."""
    host_used_gb: float
    log: Path


STEP_LINE = re.compile(r"^\S+ b\d+ step (?P<step>\d+): (?P<seconds>[0-9.]+) s, loss (?P<loss>\S+)$")
"""What `peer_runners.timed_loop` prints after each step."""


def steps_from_log(log: Path, warmup: int) -> tuple[list[float], list[float]]:
    """(measured step times, every step's loss) a worker printed before it ended: what a run
    stopped before its record (timed out, killed, its parent stopped) still measured."""
    times, losses = [], []
    for line in log.read_text(errors="replace").splitlines() if log.exists() else []:
        if match := STEP_LINE.match(line.strip()):
            losses.append(float(match["loss"]))
            if int(match["step"]) >= warmup:
                times.append(float(match["seconds"]))
    return times, losses


def tail(path: Path, lines: int = 3) -> str:
    text = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return " | ".join(text[-lines:])[-600:]


def launch(job: dict, log: Path, reserve: int, timeout: float) -> Worker:
    """Run one worker, polling the machine's available memory; kill its process group when that
    falls below ``reserve`` bytes or the run passes ``timeout`` seconds."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    if job["run"] == "deepspeed_zero3_offload":  # deepspeed.init_distributed reads the launcher's variables
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "record.json"
        command = [sys.executable, "-m", "bench.peers", "--worker", json.dumps(job), "--result", str(result)]
        log.parent.mkdir(parents=True, exist_ok=True)
        total, available = meminfo()
        used_before = peak = total - available
        status = None
        start = time.monotonic()
        with log.open("w") as out:
            process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                       start_new_session=True)
            try:
                while process.poll() is None:
                    _, available = meminfo()
                    peak = max(peak, total - available)
                    if status is None and available < reserve:
                        status = f"killed: host memory low ({available / GB:.1f} GB available)"
                    elif status is None and time.monotonic() - start > timeout:
                        status = f"timed out after {timeout:.0f} s"
                    if status is not None:
                        break
                    time.sleep(POLL_S)
            finally:
                # the worker runs in a session of its own (a signal to this process's group does
                # not reach it): stopped here however this loop ends, a SIGTERM to this process
                # included (`main` turns it into SystemExit). A worker left running once held
                # its host memory through the next runs on the H200 machine.
                if process.poll() is None:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
        record = json.loads(result.read_text()) if result.exists() else None
    if status is None and record is None:
        status = f"failed (exit {process.returncode})"
    return Worker(record=record, status=status, host_used_gb=(peak - used_before) / GB, log=log)


class Study:
    """One model's rows: runs the workers, keeps the records, writes them after every row."""

    def __init__(self, model: str, args, device: str):
        from bench.peer_runners import shape_adapter

        self.model, self.args, self.device = model, args, device
        adapter = shape_adapter(model, torch.device("cpu"))
        self.numels = [p.numel for layout in adapter.layouts for p in layout.params]
        self.layers, self.hidden, self.vocab = adapter.num_layers, adapter.hidden_size, adapter.vocab_size
        self.intermediate = adapter.config.intermediate_size
        self.gpu_bytes = gpu_total_bytes() if args.device.startswith("cuda") else None
        self.stem = f"peers_{model}_{device_tag(device)}_{today()}_s{args.seq}{args.tag}"
        self.records: list[dict] = []

    def gpu_need(self, batch: int) -> int:
        """GPU bytes the no-offload run needs, about: fp32 parameters, gradients and Adam states
        (16 B/param), the fp32 input of every checkpointed layer, one layer's recompute (bf16 MLP
        and attention activations) and one loss chunk (bf16 and fp32 logits, their gradients)."""
        tokens = batch * self.args.seq
        layer = 2 * tokens * (3 * self.intermediate + 4 * self.hidden)
        return 16 * sum(self.numels) + 4 * self.layers * tokens * self.hidden + layer + self.loss_chunk_bytes()

    def loss_chunk_bytes(self) -> int:
        """One LM-head and loss chunk: bf16 and fp32 logits and their gradients, 14 B each."""
        return 14 * self.args.head_chunk * self.vocab

    def header(self, run: str, batch: int) -> dict:
        runner, _, kind = run.partition(":")
        return {
            "name": f"{self.model}_{run.replace(':', '_')}_b{batch}_s{self.args.seq}{self.args.tag}", "run": run,
            "date": today(), "device": self.device, "torch": torch.__version__,
            "transformers": transformers.__version__, "model": self.model, "seq_len": self.args.seq,
            "batch_size": batch, "policy": "solved" if runner == "lazytrain" else runner, "runner": runner,
            **({"optimizer_kind": kind} if kind else {}), "world_size": 1, "gpu_mem_cap_gb": None,
            "warmup_steps": self.args.warmup, "steps": self.args.steps, "seed": self.args.seed,
            "head_chunk_tokens": self.args.head_chunk, "num_params": sum(self.numels),
            **dict.fromkeys(NUMBERS), "host_bytes_per_param": None, "optimizer_exact": None,
        }

    def pin_choice(self, run: str) -> tuple[bool, tuple[int, str] | None]:
        """FSDP2's pin_memory (auto: pinned when its rounded-up host bytes fit; never without
        CUDA) and the host estimate of the choice."""
        if run != "fsdp2_cpu_offload" or not self.args.device.startswith("cuda"):
            return False, host_estimate(run, self.numels, False)
        if self.args.fsdp_pin != "auto":
            pin = self.args.fsdp_pin == "on"
            return pin, host_estimate(run, self.numels, pin)
        pinned = host_estimate(run, self.numels, True)
        if pinned[0] <= meminfo()[1] - self.args.host_reserve_gb * GB:
            return True, pinned
        return False, host_estimate(run, self.numels, False)

    def run(self, run: str, batch: int, search: bool = False, planner: bool = False) -> dict:
        """One process at ``batch`` (or a row saying why none was started); ``planner``: a
        search's try that also records the planner's largest batch (a first run always does)."""
        args = self.args
        record = self.header(run, batch)
        record["search"] = search
        runner = record["runner"]
        pin, estimate = self.pin_choice(run)
        reserve = int(args.host_reserve_gb * GB)
        available = meminfo()[1]
        room = available - reserve
        record["host_available_gb"], record["host_room_gb"] = available / GB, room / GB
        if estimate is not None:
            record["host_estimate_gb"], record["host_estimate"] = estimate[0] / GB, estimate[1]
        problem = deepspeed_problem() if runner == "deepspeed_zero3_offload" else None
        if problem is not None:
            record["status"] = "not installed"
            record["error"] = problem
        elif runner == "pytorch_gpu" and not args.device.startswith("cuda"):
            record["status"] = "not run: needs a GPU"
        elif runner == "pytorch_gpu" and self.gpu_bytes and (
                need := self.gpu_need(batch)) > self.gpu_bytes:
            record["status"] = "does not fit GPU memory"
            record["error"] = (f"needs about {need / GB:.1f} GB (16 B/param of model state, fp32 layer-input "
                               f"checkpoints, one layer's recompute, one loss chunk) of {self.gpu_bytes / GB:.1f} GB")
        elif estimate is not None and estimate[0] > room:
            record["status"] = "does not fit host memory"
            record["error"] = (f"needs {estimate[0] / GB:.1f} GB ({estimate[1]}; {PROCESS_BYTES / GB:.0f} GB for the "
                               f"process) of {room / GB:.1f} GB available (less the {args.host_reserve_gb:g} GB "
                               "reserve)")
        else:
            # LazyTrain plans its host memory: give it the room the watchdog leaves
            host_limit = (room - PROCESS_BYTES) / 2**30 if runner == "lazytrain" else None
            job = {"run": run, "model": self.model, "batch": batch, "seq": args.seq, "warmup": args.warmup,
                   "steps": args.steps, "device": args.device, "seed": args.seed, "head_chunk": args.head_chunk,
                   "pin_memory": pin, "host_limit_gb": host_limit,
                   # the planner's largest batch: the search's first guess, from the first run (or from a
                   # search's first try when the first run's row lacks it)
                   "planner_max_batch_limit": args.max_batch if planner or not search else 0}
            log = Path(args.out) / "peers_logs" / f"{record['name']}.log"
            print(f"{record['name']}: running ({run}, batch {batch})", flush=True)
            worker = launch(job, log, reserve, args.worker_timeout)
            record.update(worker.record or {})
            record["host_used_gb"] = worker.host_used_gb
            record["log"] = str(log.relative_to(args.out))
            if worker.status is not None:
                record["status"] = worker.status
                record["error"] = tail(log)
                if worker.record is None:
                    self.partial(record, log)
        self.records.append(record)
        self.save()
        numbers = (f"{record['tokens_per_s']:,.0f} tokens/s, {record['step_time_s']:.2f} s/step, "
                   f"{record['tflops_model']:.1f} TFLOPS (model), loss {record['loss']:.4f}"
                   if record["status"] == "ok" else record.get("error"))
        print(f"{record['name']}: {record['status']}" + (f": {numbers}" if numbers else ""), flush=True)
        return record

    def partial(self, record: dict, log: Path) -> None:
        """Add to a run that ended without its record the figures of the steps its log shows
        (``partial_steps``: how many; the row keeps its status, so it is not read as a finished run)."""
        from bench.peer_runners import shape_adapter, step_figures

        times, losses = steps_from_log(log, self.args.warmup)
        if times:
            adapter = shape_adapter(self.model, torch.device("cpu"))
            record.update(step_figures(times, record["batch_size"], self.args.seq, adapter), losses=losses,
                          loss=losses[-1], partial_steps=len(times))

    def from_log(self, run: str, batch: int, log: Path, why: str, like: dict) -> None:
        """The row of a run whose parent was stopped before it wrote the row: its header (the
        date, device and versions of ``like``, a record of the same machine), the steps its log
        shows, and ``why``; saved as this study."""
        record = {**self.header(run, batch), **{key: like[key] for key in ("date", "device", "torch", "transformers")},
                  "status": why, "error": tail(log), "log": log.name, "search": False}
        self.partial(record, log)
        self.records.append(record)
        self.save()

    def first_guess(self, first: dict) -> int | None:
        """The batch at which a straight line through ``first``'s GPU peak reaches `GUESS_FILL` of
        the card: peak = fixed + per sample x batch, the fixed part being what does not grow with
        the batch (one loss chunk's logits at 14 B each, and for the no-offload run its 16 B/param
        of model state). For LazyTrain, whose plan fills the card at any batch, `planner_guess`:
        0.9 of the planner's own largest batch from that run's profile. None without these, or
        when no larger batch fits."""
        if first["status"] != "ok":
            return None
        if first["runner"] == "lazytrain":
            guess = self.planner_guess(first)
            return guess if guess > first["batch_size"] else None
        peak = first.get("peak_gpu_alloc_gb")
        if not self.gpu_bytes or peak is None:
            return None
        fixed = self.gpu_need(0) if first["runner"] == "pytorch_gpu" else self.loss_chunk_bytes()
        per_sample = (peak * GB - fixed) / first["batch_size"]
        if per_sample <= 0:
            return None
        guess = min(int((GUESS_FILL * self.gpu_bytes - fixed) / per_sample) // 8 * 8, self.args.max_batch)
        if first["runner"] == "pytorch_gpu":  # within its own estimate, at the same fill
            guess = min(guess, self.estimated_gpu_max_batch(GUESS_FILL))
        return guess if guess > first["batch_size"] else None

    def planner_guess(self, record: dict) -> int:
        """`GUESS_FILL` of the largest batch LazyTrain's planner fits from ``record``'s profile
        (``planner_max_batch``; 0 without it), a multiple of 8 within ``--max-batch``. The planner
        extrapolates from a smaller batch's profile, and a batch's own profile can need a little
        more: on the H200 the 7B b128 profile fitted 453, whose own profile then needed 0.56 GiB
        more than the card (12-03), a try spent on a refusal."""
        planned = min(record.get("planner_max_batch") or 0, self.args.max_batch)
        return int(GUESS_FILL * planned) // 8 * 8

    def estimated_gpu_max_batch(self, fill: float = 1.0) -> int:
        """The largest batch (a multiple of 8) whose `gpu_need` fits ``fill`` of the card; at
        1.0, past it `run` refuses the no-offload run without starting it."""
        per_sample = self.gpu_need(1) - self.gpu_need(0)
        return max(0, int(fill * self.gpu_bytes - self.gpu_need(0)) // per_sample // 8 * 8)

    def largest_batch(self, run: str, first: dict) -> None:
        """Find the largest batch that runs, in few tries (each is a process that builds the model
        and times a few steps: minutes at 7B): first the batch `first_guess` extrapolates from
        ``first``'s GPU peak, then steps of 1/8 up from a batch that ran near it (doubling without
        a guess) until one runs out of memory, then bisect; mark the largest batch that ran, and
        whether an out-of-memory run or ``--max-batch`` bounds it (``largest_batch_bounded``).
        Only tries that start a process count against ``--max-tries``."""
        fits = {first["batch_size"]: first["status"] == "ok"}
        if first["status"] not in ("ok", *GPU_MEMORY):
            return
        lo = first["batch_size"] if fits[first["batch_size"]] else 0
        hi = None if fits[first["batch_size"]] else first["batch_size"]
        guess = self.first_guess(first)
        near = guess is not None
        # LazyTrain without the planner's figure (a row committed before it was recorded): the
        # first try asks its worker for it, and the next try starts there
        ask_planner = first["runner"] == "lazytrain" and guess is None
        tries = 0
        while tries < self.args.max_tries:
            if guess is not None:
                batch, guess = guess, None
            elif hi is None:
                batch = min(lo + max(1, lo // 8) if near else 2 * lo, self.args.max_batch)
            else:
                batch = (lo + hi) // 2
            if batch in fits or batch < 1:
                break
            record = self.run(run, batch, search=True, planner=ask_planner)
            # a batch refused by an estimate started no process: it costs no try
            tries += "log" in record
            if record["status"] not in ("ok", *GPU_MEMORY):
                break
            fits[batch] = record["status"] == "ok"
            lo, hi = (batch, hi) if fits[batch] else (lo, batch)
            if ask_planner:
                ask_planner = False
                planned = self.planner_guess(record)
                if planned > lo and (hi is None or planned < hi) and planned not in fits:
                    guess, near = planned, True
        best = max((b for b, ok in fits.items() if ok), default=None)
        bounded = best is not None and (best >= self.args.max_batch
                                        or any(not ok and b > best for b, ok in fits.items()))
        for record in self.records:
            if record["run"] == run and record["batch_size"] == best:
                record["largest_batch"] = True
                record["largest_batch_bounded"] = bounded
        self.save()

    def save(self) -> None:
        write_results(self.records, self.stem, markdown(self.records, self.args, self.model), self.args.out)


def fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown(records: list[dict], args, model: str) -> str:
    head = next((r for r in records if r["status"] == "ok"), records[0] if records else {})
    versions = f"torch {head.get('torch')}, transformers {head.get('transformers')}"
    ds = next((r["deepspeed"] for r in records if "deepspeed" in r), None)
    if ds:
        versions += f", deepspeed {ds}"
    lines = [
        f"# LazyTrain and the trainers users would pick instead: {model}, seq {args.seq}",
        "",
        (f"{head.get('date')}, {head.get('device')}, {versions}. Each row is its own process; every run trains the "
         f"same random init (seed {args.seed}) on the same random tokens (seed = step), AdamW lr 1e-5, clip 1.0, "
         f"activation checkpointing per decoder layer (LazyTrain: its solved plan), LM head + loss in chunks of "
         f"{args.head_chunk} tokens; CUDA allocator `{head.get('cuda_alloc_conf')}`; {args.warmup} warm-up + "
         f"{args.steps} measured steps (median). Command: "
         f"`{command_line(args)}`"),
        "",
        ("| run | optimizer | exact | batch | status | tokens/s | vs LazyTrain 8-bit | TFLOPS 6NT | TFLOPS model | "
         "step s | peak GPU alloc / reserved GB | host RSS peak GB | host used GB | loss |"),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    reference = {r["batch_size"]: r["tokens_per_s"] for r in records
                 if r.get("optimizer_kind") == "hybrid8bit" and r["status"] == "ok"}
    for r in records:
        run = r["runner"] + (f" {r['optimizer_kind']}" if r.get("optimizer_kind") else "")
        if r.get("largest_batch"):
            run += " (largest batch)" if r.get("largest_batch_bounded", True) else " (largest batch tried)"
        ok = r["status"] == "ok" or bool(r.get("partial_steps"))
        ratio = r["tokens_per_s"] / reference[r["batch_size"]] if ok and r["batch_size"] in reference else None
        status = r["status"] if r["status"] == "ok" else f"{r['status']}: {r.get('error', '')}".rstrip(": ")
        if r.get("partial_steps"):
            status = f"{r['status']} after {r['partial_steps']} measured steps (figures from its log)"
        if r.get("note"):
            status += f" ({r['note']})"
        if r.get("invalid"):
            status = f"left out (not shown in the README): {r['invalid']}"
        exact = {True: "yes", False: "no", None: "-"}[r.get("optimizer_exact")]
        lines.append(
            f"| {run} | {r.get('optimizer', '-')} | {exact} | {r['batch_size']} | {status} | "
            f"{fmt(r['tokens_per_s'], ',.0f')} | {fmt(ratio, '.2f')} | {fmt(r['tflops_6nt'], '.1f')} | "
            f"{fmt(r['tflops_model'], '.1f')} | {fmt(r['step_time_s'], '.2f')} | {fmt(r['peak_gpu_alloc_gb'], '.1f')} / "
            f"{fmt(r['peak_gpu_reserved_gb'], '.1f')} | {fmt(r['host_rss_gb'], '.1f')} | "
            f"{fmt(r.get('host_used_gb'), '.1f')} | {fmt(r.get('loss'), '.4f')} |"
        )
    lines += [
        "",
        ("exact: the update is AdamW on fp32 master weights with fp32 moments (bf16 compute only changes the "
         "gradients); LazyTrain's hybrid 8-bit states are not exact. host RSS peak: the worker's peak resident set; "
         "host used: the machine's peak used memory during the run less what was used before it (pinned memory "
         "counts in both). loss: the last measured step's, the same batch and model for every row (a wiring "
         "check: rows should agree to a few decimals)."),
    ]
    estimated = {}
    for r in records:
        estimated.setdefault(r["run"], r)
    for run, r in estimated.items():
        if r.get("host_estimate"):
            lines.append(f"\n{run}: host estimate {r['host_estimate_gb']:.1f} GB ({r['host_estimate']}); "
                         f"{r['host_available_gb']:.1f} GB available at the start of batch {r['batch_size']}.")
    return "\n".join(lines) + "\n"


def command_line(args) -> str:
    parts = [f"python -m bench.peers --models {' '.join(args.models)} --seq {args.seq}",
             f"--batches {' '.join(args.batches)} --runs {' '.join(args.runs)}",
             f"--warmup {args.warmup} --steps {args.steps} --device {args.device}"]
    if args.fsdp_pin != "auto":
        parts.append(f"--fsdp-pin {args.fsdp_pin}")
    return " ".join(parts)


def annotations(pairs: list[str], flag: str) -> list[tuple[str, str]]:
    for pair in pairs:
        if "=" not in pair:
            raise SystemExit(f"{flag} takes NAME=TEXT, got {pair!r}")
    return [tuple(pair.split("=", 1)) for pair in pairs]


def largest_marks(records: list[dict]) -> None:
    """Re-mark each run's largest batch over merged rows: a search continued in a later call
    (``--search-from`` a row of an earlier file) marks its own largest, and the earlier file's
    mark must go. Of a run's rows marked ``largest_batch``, the mark stays on the largest batch
    that ran; it is bounded when any of the run's rows ran out of GPU memory at a larger batch."""
    for run in {r["run"] for r in records if r.get("largest_batch")}:
        rows = [r for r in records if r["run"] == run]
        best = max((r for r in rows if r.get("largest_batch") and r["status"] == "ok"),
                   key=lambda r: r["batch_size"], default=None)
        for r in rows:
            if r.get("largest_batch") and r is not best:
                del r["largest_batch"]
                r.pop("largest_batch_bounded", None)
        if best is not None:
            best["largest_batch_bounded"] = best.get("largest_batch_bounded", False) or any(
                r["status"] in GPU_MEMORY and r["batch_size"] > best["batch_size"] for r in rows)


def merge(args) -> None:
    """``--merge``: record files of one model become one study file + report (``--into``), with
    ``--note`` and ``--invalid`` set on the rows they name; the inputs are left in place."""
    if not args.into:
        raise SystemExit("--merge needs --into STEM (the study file's name without .json)")
    records = [r for path in args.merge for r in json.loads(path.read_text())]
    models = {r["model"] for r in records}
    if len(models) != 1:
        raise SystemExit(f"--merge takes the records of one model; these have {sorted(models)}")
    notes, invalid = annotations(args.note, "--note"), annotations(args.invalid, "--invalid")
    def named(name: str) -> list[dict]:  # the row of that exact name, else every row containing it
        return [r for r in records if r["name"] == name] or [r for r in records if name in r["name"]]

    for key, pairs in (("note", notes), ("invalid", invalid)):
        for name, text in pairs:
            for r in named(name):
                r[key] = text
    largest_marks(records)
    head = records[0]
    args.seq, args.warmup, args.steps, args.seed = head["seq_len"], head["warmup_steps"], head["steps"], head["seed"]
    args.head_chunk = head["head_chunk_tokens"]
    report = markdown(records, args, head["model"]).replace(
        f"Command: `{command_line(args)}`",
        "Merged from " + ", ".join(f"`{path.name}`" for path in args.merge) + " (`python -m bench.peers --merge`)")
    write_results(records, args.into, report, args.out)
    print(f"wrote {Path(args.out) / args.into}.json and .md", flush=True)


def searched_from(records: list[dict], model: str, run: str, batch: int, device: str, seq: int) -> dict | None:
    """The committed row a largest-batch search may start from instead of running ``batch``
    again (``--search-from``): the same model, run, batch, sequence length and device, measured
    or out of GPU memory, not marked invalid; the newest such. The device is compared by its
    file tag (`device_tag`: "h200"), as a worker's record names a CPU without its threads. If
    the search finds no larger batch, that row (in its own file) is the largest, unmarked."""
    rows = [r for r in records if r.get("model") == model and r.get("run") == run and r.get("batch_size") == batch
            and r.get("seq_len") == seq and device_tag(r.get("device", "")) == device_tag(device)
            and not r.get("invalid")
            and r.get("status") in ("ok", *GPU_MEMORY)]
    return max(rows, key=lambda r: r.get("date", ""), default=None)


def worker_main(spec: str, result: str) -> None:
    from bench.peer_runners import Job, run_job

    record = run_job(Job(**json.loads(spec)))
    Path(result).write_text(json.dumps(record))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["qwen2.5-3b", "qwen2.5-7b"], help="built-in shapes")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batches", nargs="+", default=["64"],
                        help="batch sizes; 'max' adds a search for each run's largest batch")
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=RUNS)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--device", default="cuda", help="cuda, or cpu (a smoke test of the script: gloo, world size 1)")
    parser.add_argument("--seed", type=int, default=0, help="the random init's seed, the same for every run")
    parser.add_argument("--head-chunk", type=int, default=4096, help="tokens per LM-head and loss chunk")
    parser.add_argument("--fsdp-pin", choices=["auto", "on", "off"], default="auto",
                        help="FSDP2's CPUOffloadPolicy(pin_memory): auto pins when the rounded-up bytes fit")
    parser.add_argument("--host-reserve-gb", type=float, default=6.0,
                        help="host memory kept free: a run estimated past it is not started, one that gets "
                             "there is killed")
    parser.add_argument("--worker-timeout", type=float, default=480.0, help="seconds before a worker is killed")
    parser.add_argument("--max-tries", type=int, default=4, help="runs the largest-batch search may add per run")
    parser.add_argument("--max-batch", type=int, default=512, help="the largest-batch search's upper bound")
    parser.add_argument("--search-from", nargs="*", type=Path, default=[], metavar="JSON",
                        help="record files whose row at the first --batches size (same model, run, seq, device) "
                             "the largest-batch search starts from instead of running that batch again")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--tag", default="")
    parser.add_argument("--merge", nargs="+", type=Path, metavar="JSON",
                        help="no training: these record files (one model) become one study file and report, "
                             "named by --into")
    parser.add_argument("--into", help="the merged study's file stem (with --merge)")
    parser.add_argument("--note", nargs="*", default=[], metavar="NAME=TEXT",
                        help="with --merge: a note on the row named NAME, or if none is, on the rows whose name "
                             "contains NAME (the report shows it)")
    parser.add_argument("--invalid", nargs="*", default=[], metavar="NAME=TEXT",
                        help="with --merge: the row named NAME (or if none is, the rows whose name contains NAME) "
                             "is kept but marked not to be shown: not a measurement of the trainer, or "
                             "superseded (TEXT: why); bench/readme_table.py leaves them out")
    parser.add_argument("--from-log", type=Path, metavar="LOG",
                        help="no training: the row of the first --runs / --batches run from a worker log its "
                             "parent left (stopped before writing the row), headed like --like's first record")
    parser.add_argument("--like", type=Path, help="with --from-log: a record file of the same machine and run")
    parser.add_argument("--why", default="stopped with its parent", help="with --from-log: the row's status")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker_main(args.worker, args.result)
        return
    if args.merge:
        merge(args)
        return
    if args.from_log:
        like = json.loads(args.like.read_text())[0]
        study = Study(args.models[0], args, like["device"])
        study.stem += "_from_log"
        study.from_log(args.runs[0], int(args.batches[0]), args.from_log, args.why, like)
        print(f"wrote {Path(args.out) / study.stem}.json and .md", flush=True)
        return
    # `timeout` and job schedulers stop with SIGTERM: unwind, so `launch` stops its worker
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    sizes = [int(b) for b in args.batches if b != "max"]
    if not sizes or any(b != "max" and not b.isdigit() for b in args.batches):
        raise SystemExit(f"--batches takes batch sizes and 'max', with at least one size; got {args.batches}")
    device = device_description(args.device)
    measured = [r for path in args.search_from for r in json.loads(path.read_text())]
    for model in args.models:
        study = Study(model, args, device)
        for run in args.runs:
            first = searched_from(measured, model, run, sizes[0], device, args.seq)
            if first is None:
                first, *_ = [study.run(run, batch) for batch in sizes]
            else:
                print(f"{run}: the search starts from {first['name']} in --search-from", flush=True)
            if "max" in args.batches:
                study.largest_batch(run, first)
        print(f"wrote {Path(args.out) / study.stem}.json and .md", flush=True)


if __name__ == "__main__":
    main()

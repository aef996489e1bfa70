"""Checkpoints under interruption, through the CLI: SIGKILL mid-run, resume, SIGTERM, resume.

Runs ``lazytrain train`` three times into one output folder (checkpointing every
``--save-every`` steps):

1. killed with SIGKILL once it has passed step ``--kill-at`` (a checkpoint exists by then);
2. resumed, then sent SIGTERM after one more step: it must finish the step, write a
   checkpoint, print the resume command and exit 143;
3. resumed to the end (``--steps``).

It records the size of a checkpoint, each save's time (from the trainer's log), the time from
start to the restored state, the lowest free disk space seen, the exit codes, and checks that
``metrics.jsonl`` ends with each step exactly once. With ``--probe-model`` it first starts a run
of that model into the same folder to record the start-up message when its checkpoints cannot
fit the disk (the 7B shape on a 64 GB disk). The run folder is deleted at the end, whatever
happens. Writes ``<out>/checkpoint_<model>_<device>_<date>.json`` and a Markdown report.

    python -m bench.checkpoint_bench --model builtin:tiny --steps 12 --save-every 3   # CPU check
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from bench.common import device_tag, write_results
from lazytrain.train.checkpoint import Checkpointer, folder_bytes


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--model", default="builtin:qwen2.5-3b", help="model.source of the run")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--save-every", type=int, default=3)
    parser.add_argument("--kill-at", type=int, default=None, help="SIGKILL after this step (default: save-every + 1)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/lazytrain_checkpoint_bench"),
                        help="run folder (deleted at the end; not under $OUT: it holds the checkpoints)")
    parser.add_argument("--out", type=Path, default=Path("bench/results"), help="results folder")
    parser.add_argument("--probe-model", default=None, help="a model whose start-up space check to record")
    parser.add_argument("--timeout", type=float, default=400, help="seconds allowed for all phases")
    parser.add_argument("--set", nargs="*", default=[], help="extra section.key=value overrides")
    parser.add_argument("--no-sigterm", action="store_true",
                        help="skip phase 2 (SIGTERM): SIGKILL, then one resume to the end (a big model's "
                             "start-up and checkpoint cost less device time)")
    return parser.parse_args()


class Run:
    """One ``lazytrain train`` child; its stderr lines with the time each arrived."""

    def __init__(self, overrides: list[str]):
        self.start = time.monotonic()
        self.lines: list[tuple[float, str]] = []
        self.proc = subprocess.Popen([sys.executable, "-m", "lazytrain.cli.main", "train", *overrides],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append((time.monotonic() - self.start, line.rstrip()))

    def wait(self, timeout: float) -> int:
        code = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=10)
        return code

    def first(self, pattern: str) -> tuple[float, re.Match] | None:
        for t, line in self.lines:
            m = re.search(pattern, line)
            if m:
                return t, m
        return None

    def saves(self) -> list[float]:
        return [float(m.group(1)) for _, line in self.lines
                if (m := re.search(r"checkpoint \S+: [\d.]+ GB in ([\d.]+) s", line))]

    def tail(self, n: int = 6) -> str:
        return "\n".join(line for _, line in self.lines[-n:])


def steps_done(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if "loss" in record:
            out.append(record["step"])
    return out


def wait_for_step(run: Run, run_dir: Path, step: int, deadline: float, low_free: list[int]) -> None:
    while not steps_done(run_dir) or steps_done(run_dir)[-1] < step:
        low_free[0] = min(low_free[0], shutil.disk_usage(run_dir.parent).free)
        if run.proc.poll() is not None:
            raise RuntimeError(f"run ended (status {run.proc.returncode}) before step {step}:\n{run.tail()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"step {step} not reached in time:\n{run.tail()}")
        time.sleep(0.2)


def main() -> None:
    args = parse_args()
    kill_at = args.kill_at or args.save_every + 1
    run_dir = args.workdir / "run"
    shutil.rmtree(args.workdir, ignore_errors=True)
    args.workdir.mkdir(parents=True)
    common = [f"model.source={args.model}", f"training.output_dir={run_dir}", f"training.steps={args.steps}",
              f"training.save_every={args.save_every}", "training.save_every_minutes=0",
              "training.progress=false", "training.log_every=1", "optimizer.kind=hybrid8bit",
              "training.batch_size=4", "data.builtin_train_size=2000", "data.heldout_size=8", *args.set]
    deadline = time.monotonic() + args.timeout
    low_free = [shutil.disk_usage(args.workdir).free]
    record: dict = {"free_disk_start_gb": low_free[0] / 1e9}
    try:
        if args.probe_model:
            probe = Run([*common, f"model.source={args.probe_model}", "training.output_dir=" + str(args.workdir / "probe")])
            record["probe"] = {"model": args.probe_model, "exit_code": probe.wait(args.timeout),
                               "seconds_to_message": round(time.monotonic() - probe.start, 1),
                               "message": probe.tail(2)}
            shutil.rmtree(args.workdir / "probe", ignore_errors=True)
        killed = Run(common)
        wait_for_step(killed, run_dir, kill_at, deadline, low_free)
        killed.proc.send_signal(signal.SIGKILL)
        record["sigkill"] = {"after_step": steps_done(run_dir)[-1], "exit_code": killed.wait(60),
                             "save_s": killed.saves(), "wall_s": round(time.monotonic() - killed.start, 1)}
        found = Checkpointer(run_dir).latest()
        record["checkpoint_bytes"] = folder_bytes(found.path)
        record["checkpoint_files"] = {f.name: f.stat().st_size for f in found.path.iterdir()}

        if not args.no_sigterm:
            termed = Run([*common, "training.resume=true"])
            resumed = None
            while resumed is None:
                resumed = termed.first(r"resumed from \S+ at step (\d+)")
                if termed.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"resume did not start:\n{termed.tail()}")
                time.sleep(0.2)
            resume_step = int(resumed[1].group(1))
            wait_for_step(termed, run_dir, resume_step + 1, deadline, low_free)
            termed.proc.send_signal(signal.SIGTERM)
            code = termed.wait(max(deadline - time.monotonic(), 1))
            record["sigterm"] = {"resumed_at_step": resume_step, "resume_s": round(resumed[0], 1),
                                 "after_step": steps_done(run_dir)[-1], "exit_code": code, "save_s": termed.saves(),
                                 "resume_command_printed": termed.first("Resume with:") is not None}

        final = Run([*common, "training.resume=true"])
        code = final.wait(max(deadline - time.monotonic(), 1))
        done = steps_done(run_dir)
        final_resume = final.first(r"resumed from \S+ at step (\d+)")
        record["final"] = {"exit_code": code, "save_s": final.saves(),
                           "resume_s": round(final_resume[0], 1) if final_resume else None,
                           "resumed_at_step": int(final_resume[1].group(1)) if final_resume else None,
                           "wall_s": round(time.monotonic() - final.start, 1), "tail": final.tail(3)}
        record["steps_once_each"] = done == list(range(1, args.steps + 1))
        record["model_export_bytes"] = sum(f.stat().st_size for f in run_dir.glob("*.safetensors"))
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        last = [r for r in records if "loss" in r][-1]
    finally:
        low_free[0] = min(low_free[0], shutil.disk_usage(args.workdir).free)
        shutil.rmtree(args.workdir, ignore_errors=True)
    record["free_disk_lowest_gb"] = low_free[0] / 1e9
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    model = args.model.removeprefix("builtin:")
    date = dt.date.today().isoformat()
    term = record.get("sigterm")
    saves = record["sigkill"]["save_s"] + (term["save_s"] if term else []) + record["final"]["save_s"]
    first_resume = term or record["final"]
    record = {
        "name": "checkpoint_kill_resume", "date": date, "device": device, "torch": torch.__version__,
        "model": model, "seq_len": last["seq_len"], "batch_size": last["batch_size"], "policy": "auto",
        "tokens_per_s": last["tokens_per_s"], "tflops_6nt": last["tflops_6nt"], "tflops_model": last["tflops_model"],
        "step_time_s": last["step_time_s"], "predicted_step_time_s": last.get("predicted_step_time_s"),
        "peak_gpu_alloc_gb": last.get("peak_gpu_alloc_gb"), "peak_gpu_reserved_gb": last.get("peak_gpu_reserved_gb"),
        "host_rss_gb": last["host_rss_gb"], "gpu_mem_cap_gb": None, "world_size": 1,
        "host_bytes_per_param": None, "runner": "lazytrain", "optimizer": "hybrid8bit",
        "steps": args.steps, "save_every": args.save_every, "overrides": args.set, "checkpoint_gb": record["checkpoint_bytes"] / 1e9,
        "save_s_median": sorted(saves)[len(saves) // 2] if saves else None, **record,
    }
    stem = f"checkpoint_{model}_{device_tag(device)}_{date}"
    lines = [
        f"# Checkpoints under interruption: {model} on {device} ({date}, torch {torch.__version__})", "",
        (f"`lazytrain train` with `optimizer.kind=hybrid8bit`, batch {record['batch_size']} x seq "
         f"{record['seq_len']}, {args.steps} steps, a checkpoint every {args.save_every}; run folder "
         f"{args.workdir} (deleted). Command: `python -m bench.checkpoint_bench {' '.join(sys.argv[1:])}`"), "",
        "| | value |", "| --- | --- |",
        f"| checkpoint size | {record['checkpoint_gb']:.2f} GB ({', '.join(f'{k} {v / 1e9:.2f} GB' for k, v in record['checkpoint_files'].items())}) |",
        f"| save times | {', '.join(f'{s:.1f} s' for s in saves)} |",
        f"| SIGKILL after step {record['sigkill']['after_step']} | exit {record['sigkill']['exit_code']} |",
        f"| resume (start to restored state) | {first_resume['resume_s']} s, at step {first_resume['resumed_at_step']} |",
        (f"| SIGTERM after step {term['after_step']} | exit {term['exit_code']}, resume command printed: "
         f"{term['resume_command_printed']} |" if term else "| SIGTERM | not sent (`--no-sigterm`) |"),
        f"| final resume | exit {record['final']['exit_code']}, {record['final']['wall_s']} s |",
        f"| metrics.jsonl: each step once | {record['steps_once_each']} |",
        f"| model export | {record['model_export_bytes'] / 1e9:.2f} GB |",
        f"| free disk: start, lowest | {record['free_disk_start_gb']:.1f} GB, {record['free_disk_lowest_gb']:.1f} GB |",
        f"| step time (last) | {record['step_time_s']:.2f} s, {record['tokens_per_s']:.0f} tokens/s |",
    ]
    if "probe" in record:
        p = record["probe"]
        lines += ["", f"Start-up space check with `{p['model']}` (exit {p['exit_code']} after {p['seconds_to_message']} s):",
                  "", "```", p["message"], "```"]
    write_results([record], stem, "\n".join(lines) + "\n", args.out)
    print("\n".join(lines))
    ok = ((term is None or term["exit_code"] == 128 + signal.SIGTERM) and record["final"]["exit_code"] == 0
          and record["steps_once_each"])
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()

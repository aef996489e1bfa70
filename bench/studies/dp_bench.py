"""The data-parallel path at world size 1 against the single-process path, through the trainer.

Runs `lazytrain train`'s `Trainer` twice on the same config, one after the other (a 7B model
holds ~83 GB of host memory, so never both at once): once as a plain process, once under
``torchrun --nproc-per-node 1`` (process group, sharded host store, per-group publish of the
updated weights, global token counts), and reports the step-time ratio:

    python -m bench.studies.dp_bench --model qwen2.5-7b --seq 1024 --batch 64 --steps 6 \\
        --costs bench/results/costs_qwen2.5-7b_h200_2026-11-29_s1024_b64.json --out "$OUT"

Data: random printable text (the built-in byte tokenizer: one token per character), every
sample filling ``--seq`` tokens, so each step has the full batch shape. Nothing is saved but
metrics (the 7B model folder and checkpoint would take ~60 GB of disk): the runs disable the
trainer's final save. The step time is the median over the steps after ``--warmup``.

JSON records (DESIGN.md section 6 fields, ``runner`` ``lazytrain``, ``path`` single or
torchrun) and a Markdown report go to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import socket
import statistics
import string
import subprocess
import sys
from pathlib import Path

import torch

from bench.common import child_env

FIELDS = ("tokens_per_s", "tflops_6nt", "tflops_model", "step_time_s", "predicted_step_time_s",
          "peak_gpu_alloc_gb", "peak_gpu_reserved_gb", "host_rss_gb")


def write_data(path: Path, samples: int, seq: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    alphabet = string.ascii_letters + string.digits + " .,;:+-=()"
    with path.open("w") as f:
        for _ in range(samples):
            query = "".join(rng.choice(alphabet) for _ in range(32))
            response = "".join(rng.choice(alphabet) for _ in range(seq))  # truncated to fill seq
            f.write(json.dumps({"query": query, "response": response}) + "\n")


def overrides(args, data: Path, out_dir: Path) -> list[str]:
    sets = [
        f"model.source=builtin:{args.model}", f"data.dataset={data}", "data.format=jsonl",
        f"data.max_seq_len={args.seq}", f"training.batch_size={args.batch}", f"training.steps={args.steps}",
        f"training.output_dir={out_dir}", "training.progress=false", "training.log_every=1",
        f"optimizer.kind={args.optimizer}", f"plan.policy={args.policy}", f"training.device={args.device}",
        "training.overwrite=true",
    ]
    if args.costs:
        sets.append(f"plan.costs={args.costs}")
    return sets + args.set


def run_trainer(args) -> None:
    """One training run in this process (under torchrun when the environment says so)."""
    from lazytrain.config import load_config
    from lazytrain.train.trainer import Trainer

    out_dir = Path(args.child_dir)
    trainer = Trainer(load_config(None, overrides(args, Path(args.data), out_dir)))
    trainer.setup()
    # metrics only: a 7B model folder and checkpoint would fill the device machine's disk
    trainer.save_model = lambda _out: None
    trainer.save_checkpoint = lambda: None
    trainer.train()
    if trainer.is_main:
        per_param = trainer.store.bytes(trainer.optimizer.state_bytes()).per_param()
        (out_dir / "host_bytes.json").write_text(json.dumps(per_param))


def summarise(run_dir: Path, warmup: int) -> dict:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r and r["step"] > warmup]
    out = {k: statistics.median(r[k] for r in steps) if all(r.get(k) is not None for r in steps) else None
           for k in FIELDS}
    out["losses"] = [r["loss"] for r in records if "loss" in r]
    out["host_bytes_per_param"] = json.loads((run_dir / "host_bytes.json").read_text())
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-7b")
    parser.add_argument("--optimizer", choices=["fp32", "hybrid8bit"], default="hybrid8bit")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the median")
    parser.add_argument("--policy", default="solved")
    parser.add_argument("--costs", default=None, help="costs.json (default: profile in each run)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--set", nargs="*", default=[], help="extra section.key=value overrides")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--tag", default="")
    parser.add_argument("--child", choices=["single", "torchrun"], help=argparse.SUPPRESS)
    parser.add_argument("--child-dir", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        run_trainer(args)
        return

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = out / "dp_bench_runs"
    work.mkdir(exist_ok=True)
    data = work / "data.jsonl"
    write_data(data, args.batch * (args.steps + 1), args.seq)
    module = ["-m", "bench.studies.dp_bench"]
    passthrough = [
        "--model", args.model, "--optimizer", args.optimizer, "--seq", str(args.seq), "--batch", str(args.batch),
        "--steps", str(args.steps), "--policy", args.policy, "--device", args.device, "--data", str(data),
        *(["--costs", args.costs] if args.costs else []), *(["--set", *args.set] if args.set else []),
    ]
    env = {k: v for k, v in child_env().items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    commands = {
        "single": [sys.executable, *module],
        "torchrun": [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
                     "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *module],
    }
    date = datetime.date.today().isoformat()
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") and torch.cuda.is_available() else "cpu"
    stem = f"dp_{args.model}_{device.split()[-1].lower()}_{date}_s{args.seq}_b{args.batch}{args.tag}"
    records = []
    for path, command in commands.items():
        run_dir = work / path
        subprocess.run([*command, *passthrough, "--child", path, "--child-dir", str(run_dir)], env=env, check=True)
        summary = summarise(run_dir, args.warmup)
        records.append({
            "name": f"{args.model}_{args.policy}_b{args.batch}_s{args.seq}_{path}", "date": date, "device": device,
            "torch": torch.__version__, "model": args.model, "seq_len": args.seq, "batch_size": args.batch,
            "policy": args.policy, "runner": "lazytrain", "path": path, "world_size": 1, "gpu_mem_cap_gb": None,
            "optimizer": args.optimizer, "steps": args.steps, "warmup_steps": args.warmup, **summary,
        })
        (out / f"{stem}.json").write_text(json.dumps(records, indent=1))
    single, dp = records
    ratio = single["step_time_s"] / dp["step_time_s"]
    command_line = "python -m bench.studies.dp_bench " + " ".join(sys.argv[1:])
    lines = [
        f"# Data parallel at world size 1 vs single process: {args.model}, seq {args.seq}, batch {args.batch}",
        "",
        (f"{date}, {device}, torch {torch.__version__}, optimizer {args.optimizer}, plan {args.policy}, "
         f"{args.steps} steps (median over steps {args.warmup + 1}-{args.steps}). Command: `{command_line}`"),
        "",
        "| path | step s | predicted s | tokens/s | TFLOPS model | peak GPU alloc GB | host RSS GB | host B/param |",
        "|---|---|---|---|---|---|---|---|",
    ]
    def fmt(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    for r in records:
        lines.append(
            f"| {r['path']} | {fmt(r['step_time_s'], '.3f')} | {fmt(r['predicted_step_time_s'], '.3f')} | "
            f"{fmt(r['tokens_per_s'], ',.0f')} | {fmt(r['tflops_model'], '.1f')} | "
            f"{fmt(r['peak_gpu_alloc_gb'], '.1f')} | {fmt(r['host_rss_gb'], '.1f')} | "
            f"{r['host_bytes_per_param']['total']:.2f} |"
        )
    same = single["losses"] == dp["losses"]
    lines += ["", (f"torchrun / single-process speed: **{ratio:.3f}x** (goal >= 0.98x). "
                   f"Per-step losses {'identical' if same else 'differ'}: {single['losses']} vs {dp['losses']}.")]
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

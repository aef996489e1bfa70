"""CPU optimizer step: Hybrid 8-bit (and 4-bit) AdamW against torch's fused fp32 AdamW, same work.

Both paths get a bf16 gradient, a clip coefficient != 1 and write bf16 weights, as the executor
asks of them (``FusedAdamW.step_group`` includes the bf16 -> fp32 gradient cast times the clip
coefficient that torch's fused AdamW needs). Reports ns per parameter (median of timed steps
after warm-up) and bytes of optimizer state per parameter, as a JSON record appended to
``<out>/optim_<host>_<date>.json`` and a Markdown report beside it.

    python -m bench.optim_bench --numel 268435456 --threads 16
    python -m bench.optim_bench --numel 268435456 --threads 1 4 8 16   # is the step memory-bound?
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import time
from pathlib import Path

import torch

from bench.common import device_tag
from lazytrain.optim.adamw import FusedAdamW
from lazytrain.optim.base import AdamWConfig, HostOptimizer
from lazytrain.optim.hybrid4bit import Hybrid4bitAdamW
from lazytrain.optim.hybrid8bit import Hybrid8bitAdamW
from lazytrain.optim.kernel import build_failure, cpu_description, kernel_choice, load_kernel

CLIP_COEF = 0.37
LR = 1e-4


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--numel", type=int, default=2**28, help="parameters in the one group")
    parser.add_argument(
        "--threads", type=int, nargs="+", default=None,
        help="torch intra-op threads (default: torch's); several: one record each",
    )
    parser.add_argument("--steps", type=int, default=7, help="timed steps per path")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per path first")
    parser.add_argument("--out", type=Path, default=Path("bench/results"), help="results folder")
    parser.add_argument(
        "--kernel",
        choices=("auto", "cpp", "torch"),
        default=None,
        help="8-bit path: fused C++ kernel, pure torch, or auto (default: env or auto)",
    )
    parser.add_argument(
        "--rounding", choices=("nearest", "stochastic"), default="nearest",
        help="how sqrt(v) (8-bit) or m and sqrt(v) (4-bit) are requantized (optimizer.state_rounding)",
    )
    return parser.parse_args(argv)


def time_steps(
    opt: HostOptimizer, grad: torch.Tensor, out: torch.Tensor, warmup: int, steps: int
) -> list[float]:
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        opt.step_group(0, grad, CLIP_COEF, LR, out)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def run_path(
    name: str, make, numel: int, args: argparse.Namespace
) -> tuple[float, float, HostOptimizer]:
    """(ns per parameter, state bytes per parameter) of one optimizer on fresh random data."""
    generator = torch.Generator().manual_seed(0)
    master = torch.randn(numel, generator=generator)
    grad = torch.randn(numel, generator=generator).to(torch.bfloat16)
    out = torch.empty(numel, dtype=torch.bfloat16)
    opt = make([master], [numel - numel // 64])
    times = time_steps(opt, grad, out, args.warmup, args.steps)
    ns = statistics.median(times) / numel * 1e9
    print(
        f"{name:>22}: {ns:.3f} ns/param (min {min(times) / numel * 1e9:.3f}), "
        f"state {opt.state_bytes() / numel:.3f} B/param"
    )
    return ns, opt.state_bytes() / numel, opt


BYTES_8BIT = 16
"""Bytes of memory traffic per parameter of this bench's 8-bit step (whole fp32 master read and
written 8, bf16 gradient read 2, bf16 weight written 2, m and sqrt(v) codes read and written 4;
the absmax arrays are 1/16 B)."""


def copy_gbps(numel: int, warmup: int, steps: int) -> float:
    """Host memory bandwidth as a plain copy sees it at this thread count: bytes read + written
    per second of ``dst.copy_(src)`` on ``numel`` fp32 elements (median of ``steps``)."""
    src, dst = torch.ones(numel), torch.empty(numel)
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        dst.copy_(src)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return 8 * numel / statistics.median(times) / 1e9


def write_report(record: dict, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"optim_{device_tag(record['device'])}_{record['date'][:10]}"
    json_path = out_dir / f"{stem}.json"
    records = json.loads(json_path.read_text()) if json_path.exists() else []
    records.append(record)
    json_path.write_text(json.dumps(records, indent=2) + "\n")
    lines = [
        f"# CPU optimizer step, {record['device']}",
        "",
        (
            "Hybrid 8-bit AdamW against torch's fused fp32 AdamW on one group: bf16 gradient "
            f"times clip coefficient {CLIP_COEF}, bf16 weight out. Median of timed steps after "
            "warm-up. Generated by bench/optim_bench.py."
        ),
        "",
        (
            "| date | torch | threads | params | 8-bit path | 8-bit ns/param | fp32 ns/param "
            "| speedup | 8-bit state B/param | 8-bit step GB/s | host copy GB/s | 4-bit ns/param |"
        ),
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in records:
        copy = r.get("host_copy_gbps")
        lines.append(
            f"| {r['date']} | {r['torch']} | {r['threads']} | {r['n_params']:,} | {r['path_8bit']} "
            f"| {r['ns_per_param_8bit']:.3f} | {r['ns_per_param_fp32']:.3f} | {r['speedup']:.2f}x "
            f"| {r['state_bytes_per_param']:.3f} | {BYTES_8BIT / r['ns_per_param_8bit']:.1f} "
            f"| {'-' if copy is None else f'{copy:.1f}'} "
            f"| {'-' if r.get('ns_per_param_4bit') is None else format(r['ns_per_param_4bit'], '.3f')} |"
        )
    lines += ["", (f"8-bit step GB/s: the step's memory traffic ({BYTES_8BIT} B/param, `BYTES_8BIT`) "
                   "over its time. host copy GB/s: bytes read + written per second by a plain fp32 "
                   "copy of the same size at the same thread count (`copy_gbps`), the bandwidth a "
                   "memory-bound step could reach.")]
    if record.get("note"):
        lines += ["", f"Note: {record['note']}"]
    json_path.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return json_path


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    for threads in args.threads or [torch.get_num_threads()]:
        torch.set_num_threads(threads)
        run(args)


def run(args: argparse.Namespace) -> None:
    threads = torch.get_num_threads()
    config = AdamWConfig(lr=LR, weight_decay=0.1)
    choice = kernel_choice(args.kernel)
    kernel = None if choice == "torch" else load_kernel(required=choice == "cpp")
    path = "cpp-" + kernel.simd() if kernel is not None else "torch-fallback"
    if args.rounding != "nearest":
        path += f", {args.rounding} sqrt(v)"
    note = None
    if kernel is None and choice != "torch":
        note = (
            f"the C++ kernel did not build ({build_failure()}); "
            "the 8-bit number is the pure-torch fallback"
        )
        print("WARNING:", note)
    print(f"{cpu_description()}, torch {torch.__version__}, {threads} threads, 8-bit path {path}")

    ns8, bytes8, _ = run_path(
        f"hybrid 8-bit ({path})",
        lambda m, d: Hybrid8bitAdamW(m, d, config, kernel="torch" if kernel is None else "cpp",
                                     rounding=args.rounding),
        args.numel,
        args,
    )
    ns4, bytes4, _ = run_path(
        f"hybrid 4-bit ({path.replace('sqrt(v)', 'm and sqrt(v)')})",
        lambda m, d: Hybrid4bitAdamW(m, d, config, kernel="torch" if kernel is None else "cpp",
                                     rounding=args.rounding),
        args.numel,
        args,
    )
    ns32, bytes32, _ = run_path(
        "fused fp32 AdamW", lambda m, d: FusedAdamW(m, d, config), args.numel, args
    )
    copy = copy_gbps(args.numel, args.warmup, args.steps)
    print(f"speedup {ns32 / ns8:.2f}x; fp32 state {bytes32:.1f} B/param; 8-bit step "
          f"{BYTES_8BIT / ns8:.1f} GB/s, host copy {copy:.1f} GB/s")
    record = {
        "name": "optim_step",
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "device": cpu_description(),
        "torch": torch.__version__,
        "path_8bit": path,
        "rounding": args.rounding,
        "ns_per_param_8bit": ns8,
        "ns_per_param_fp32": ns32,
        "speedup": ns32 / ns8,
        "state_bytes_per_param": bytes8,
        "ns_per_param_4bit": ns4,
        "state_bytes_per_param_4bit": bytes4,
        "state_bytes_per_param_fp32": bytes32,
        "threads": threads,
        "n_params": args.numel,
        "host_copy_gbps": copy,
        "clip_coef": CLIP_COEF,
        "note": note,
    }
    print("wrote", write_report(record, args.out))


if __name__ == "__main__":
    main()

"""Time the MILP planner for a 64-layer model (Qwen2.5-32B-like synthetic cost table).

Acceptance (issue 4): L = 64 solves to optimality in under 1 s on the CPU that runs the
planner. Writes ``bench/results/milp_<cpu>_<date>.json`` (a list of records) and a Markdown
report beside it.

    python -m bench.studies.milp_bench [--repeats 3] [--batch 4] [--seq 4096]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import time

import scipy
import torch

from bench.common import device_tag, today, write_results
from lazytrain.plan.milp import solve_plan
from lazytrain.plan.policies import comparison_plans
from lazytrain.plan.simulate import simulate
from lazytrain.plan.synthetic import QWEN25_32B, synthetic_cost_table
from lazytrain.runtime.device import device_name


def bench_case(name: str, batch: int, seq: int, overlap: bool, repeats: int, gap: float) -> dict:
    costs = synthetic_cost_table(QWEN25_32B, batch, seq)
    walls, cpus, plan = [], [], None
    for _ in range(repeats):
        wall0, cpu0 = time.perf_counter(), time.process_time()
        plan = solve_plan(costs, optimizer_overlap=overlap, mip_rel_gap=gap)
        walls.append(time.perf_counter() - wall0)
        cpus.append(time.process_time() - cpu0)
    sim = simulate(plan, costs)
    stats = plan.notes["milp"]
    baselines = {}
    for base in comparison_plans(costs.num_layers, batch, seq):
        base.notes["optimizer_overlap"] = overlap
        base_sim = simulate(base, costs)
        baselines[base.policy] = {
            "step_time_s": base_sim.step_time_s,
            "feasible": base_sim.feasible,
            "speedup_of_solved": base_sim.step_time_s / sim.step_time_s,
        }
    objective = plan.predicted_step_time_s
    return {
        "name": name,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "device": device_name(torch.device("cpu")),
        "cpu_count": os.cpu_count(),
        "load_avg_1m": os.getloadavg()[0],
        "scipy": scipy.__version__,
        "model": "qwen2.5-32b-like (synthetic cost table)",
        "batch_size": batch,
        "seq_len": seq,
        "optimizer_overlap": overlap,
        "num_layers": costs.num_layers,
        "num_binaries": stats["num_binaries"],
        "num_rows": stats["num_rows"],
        "num_columns": stats["num_columns"],
        "mip_rel_gap_asked": gap,
        "status": stats["status"],
        "mip_gap": stats["mip_gap"],
        "solve_time_s": statistics.median(walls),
        "solve_time_s_all": walls,
        "solve_cpu_s": statistics.median(cpus),
        "objective_s": objective,
        "simulated_step_time_s": sim.step_time_s,
        "agreement_pct": 100.0 * abs(objective - sim.step_time_s) / sim.step_time_s,
        "peak_gpu_gb": sim.peak_gpu_bytes / 1e9,
        "gpu_capacity_gb": costs.gpu_bytes / 1e9,
        "layers": "".join(
            {"keep": "K", "checkpoint": "C", "drop": "d"}[lp.mode]
            + ("" if lp.mode == "drop" else lp.tier[0])
            for lp in plan.layers
        ),
        "baselines": baselines,
    }


def markdown(records: list[dict]) -> str:
    r0 = records[0]
    lines = [
        f"# MILP planner timing, {r0['date'][:10]}",
        "",
        (
            f"CPU: {r0['device']} ({r0['cpu_count']} cores visible, 1-minute load "
            f"{r0['load_avg_1m']:.1f} at the start), scipy {r0['scipy']} (HiGHS)."
        ),
        f"Model: {r0['model']}, {r0['num_layers']} layers. Produced by `bench/studies/milp_bench.py`.",
        "",
        (
            "| case | batch x seq | overlap | binaries | rows | status | gap | solve s (median) | "
            "solve CPU s | objective s | simulated s | agreement % |"
        ),
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in records:
        lines.append(
            f"| {r['name']} | {r['batch_size']} x {r['seq_len']} | {r['optimizer_overlap']} | "
            f"{r['num_binaries']} | {r['num_rows']} | {r['status']} | {r['mip_gap']:.1e} | "
            f"{r['solve_time_s']:.3f} | "
            f"{r['solve_cpu_s']:.3f} | {r['objective_s']:.4f} | "
            f"{r['simulated_step_time_s']:.4f} | {r['agreement_pct']:.2e} |"
        )
    lines += [
        "",
        (
            "Simulated step time of the baselines (same table), and the solved plan's "
            "speed-up over each:"
        ),
        "",
    ]
    for r in records:
        parts = [
            f"{k} {v['step_time_s']:.3f} s (x{v['speedup_of_solved']:.3f})"
            if v["feasible"]
            else f"{k} does not fit"
            for k, v in r["baselines"].items()
        ]
        lines.append(f"- {r['name']}: " + "; ".join(parts))
        lines.append(f"  - plan: `{r['layers']}` (K keep, C checkpoint, d drop; g/h/n tier)")
    lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batches", type=int, nargs="+", default=[4, 8])
    parser.add_argument(
        "--gaps",
        type=float,
        nargs="+",
        default=[1e-4, 1e-6],
        help="relative MIP gaps to solve to (1e-4 is solve_plan's default)",
    )
    args = parser.parse_args()
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    records = []
    for batch in args.batches:
        for overlap in (False, True):
            for gap in args.gaps:
                name = f"milp_L64_b{batch}_gap{gap:g}" + ("_overlap" if overlap else "")
                rec = bench_case(name, batch, args.seq, overlap, args.repeats, gap)
                print(
                    f"{name}: {rec['status']} in {rec['solve_time_s']:.3f} s "
                    f"(cpu {rec['solve_cpu_s']:.3f} s), gap {rec['mip_gap']:.1e}, objective "
                    f"{rec['objective_s']:.4f} s, simulated "
                    f"{rec['simulated_step_time_s']:.4f} s",
                    flush=True,
                )
                records.append(rec)
    path = write_results(records, f"milp_{device_tag('cpu ' + records[0]['device'])}_{today()}",
                         markdown(records))
    print(f"wrote {path} and .md")


if __name__ == "__main__":
    main()

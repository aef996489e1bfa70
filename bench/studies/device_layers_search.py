"""Time the planner's search for the number of GPU-resident layers (``plan.device_layers: null``).

A measured cost table's layer repeated to each ``--layers`` count (the 7B H200 table by default:
its layers are alike), solved with ``device_layers=None`` for each ``--tolerances`` value of
`milp.DEVICE_LAYER_TOLERANCE` (0: bisect until the neighbours are adjacent) and each
``--update-ns-per-param`` (the CPU update rate planned for: the table's, or the rates a
recalibration measured, which move the optimum; default the table's), with each ``--workers``
number of solves at once (`milp.search_workers`; default: what the planner takes here). Records:
wall time, the k chosen, each k tried with its predicted step. Writes
``bench/results/device_layers_search_<cpu>_<date><tag>.json`` and a Markdown report beside it.

    python -m bench.studies.device_layers_search [--costs FILE] [--layers 28 48 64] [--tolerances 0 0.005]
        [--update-ns-per-param 0.27 0.31] [--workers 1 2] [--tag _workers]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import time

import scipy
import torch

from bench.common import cpu_run_device, device_tag, today, write_results
from lazytrain.plan import milp
from lazytrain.plan.costs import CostTable

DEFAULT_COSTS = "bench/results/costs_qwen2.5-7b_h200_2026-12-04_s1024_b64_lean_up_const.json"


def repeated(costs: CostTable, num_layers: int) -> CostTable:
    """``costs`` with its first layer ``num_layers`` times (the GPU, host and head unchanged)."""
    types = [costs.layer_types[0]] * num_layers if costs.layer_types else costs.layer_types
    return dataclasses.replace(costs, layers=[costs.layers[0]] * num_layers, layer_types=types)


def search(costs: CostTable, tolerance: float, workers: int) -> dict:
    saved = milp.DEVICE_LAYER_TOLERANCE, milp.search_workers
    milp.DEVICE_LAYER_TOLERANCE, milp.search_workers = tolerance, lambda: workers
    try:
        wall0, cpu0 = time.perf_counter(), time.process_time()
        plan = milp.solve_plan(costs, optimizer_overlap=True, device_layers=None)
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    finally:
        milp.DEVICE_LAYER_TOLERANCE, milp.search_workers = saved
    tried = {int(k): v for k, v in plan.notes["device_layers"].items()}
    return {"solve_time_s": wall, "solve_cpu_s": cpu, "const_update": plan.const_update,
            "device_layers": plan.device_layers, "predicted_step_time_s": plan.predicted_step_time_s,
            "solves": len(tried) + len(plan.notes.get("const_update", {})) - 1,
            "tried": dict(sorted(tried.items()))}


def markdown(records: list[dict], args) -> str:
    head = records[0]
    lines = [
        f"# The search for GPU-resident layers: {os.path.basename(args.costs)}",
        "",
        (f"{head['date']}, {head['device']}, torch {head['torch']}, scipy {head['scipy']}. The table's layer "
         f"repeated to each count, `solve_plan(device_layers=None, optimizer_overlap=True)` (host and device "
         f"solved), each MILP solve limited to 10 s, `workers` solves at once. Command: `python -m "
         f"bench.studies.device_layers_search --costs {args.costs} --layers {' '.join(map(str, args.layers))} --tolerances "
         f"{' '.join(map(str, args.tolerances))}"
         + (f" --update-ns-per-param {' '.join(map(str, args.update_ns_per_param))}" if args.update_ns_per_param
            else "")
         + (f" --workers {' '.join(map(str, args.workers))}" if args.workers else "")
         + (f" --tag {args.tag}" if args.tag else "") + "`"),
        "",
        "| layers | update ns/param | tolerance | workers | wall s | solves | k | predicted step s | k tried: predicted s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in records:
        tried = ", ".join(f"{k}: {v:.3f}" if v is not None else f"{k}: -" for k, v in r["tried"].items())
        lines.append(f"| {r['num_layers']} | {r['optimizer_ns_per_param']:.4g} | {r['tolerance']:g} | "
                     f"{r.get('workers', 1)} | {r['solve_time_s']:.1f} | {r['solves']} | "
                     f"{r['device_layers']} | {r['predicted_step_time_s']:.3f} | {tried} |")
    lines += ["", ("Predictions on a table whose GPU memory, host and head are the 7B's at every count: a "
                   "planner-time study, not a model of larger models."), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--costs", default=DEFAULT_COSTS)
    parser.add_argument("--layers", type=int, nargs="+", default=[28, 48, 64])
    parser.add_argument("--tolerances", type=float, nargs="+", default=[0.0, milp.DEVICE_LAYER_TOLERANCE])
    parser.add_argument("--update-ns-per-param", type=float, nargs="+", default=[],
                        help="CPU update rates to plan for (ns per parameter; default: the table's)")
    parser.add_argument("--workers", type=int, nargs="+", default=[],
                        help="solves at once (default: milp.search_workers(), the cores here up to 8)")
    parser.add_argument("--tag", default="", help="appended to the result files' name")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args(argv)
    if any(n < 1 for n in args.layers) or any(t < 0 for t in args.tolerances):
        raise SystemExit(f"--layers must be >= 1 and --tolerances >= 0, got {args.layers} and {args.tolerances}")
    if any(w < 1 for w in args.workers):
        raise SystemExit(f"--workers must be >= 1, got {args.workers}")
    if any(not r > 0 for r in args.update_ns_per_param):
        raise SystemExit(f"--update-ns-per-param must be > 0, got {args.update_ns_per_param}")
    table = CostTable.load(args.costs)
    records = []
    for num_layers, rate, tolerance, workers in itertools.product(
            args.layers, args.update_ns_per_param or [table.optimizer_ns_per_param], args.tolerances,
            args.workers or [milp.search_workers()]):
        found = search(dataclasses.replace(repeated(table, num_layers), optimizer_ns_per_param=rate), tolerance,
                       workers)
        record = {"name": f"device_layers_search_L{num_layers}_ns{rate:.4g}_tol{tolerance:g}_w{workers}",
                  "date": today(), "workers": workers,
                  "device": cpu_run_device(), "torch": torch.__version__, "scipy": scipy.__version__,
                  "costs": args.costs, "model": f"{os.path.basename(args.costs)} layer x {num_layers}",
                  "num_layers": num_layers, "batch_size": table.batch_size, "seq_len": table.seq_len,
                  "policy": "solved", "tolerance": tolerance, "optimizer_ns_per_param": rate, **found}
        print(f"{record['name']}: k={found['device_layers']} in {found['solve_time_s']:.1f} s "
              f"({found['solves']} solves)", flush=True)
        records.append(record)
    path = write_results(records, f"device_layers_search_{device_tag('cpu ' + records[0]['device'])}_{today()}{args.tag}",
                         markdown(records, args), args.out)
    print(f"wrote {path} and .md")


if __name__ == "__main__":
    main()

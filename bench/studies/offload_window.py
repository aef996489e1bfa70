"""What the measured plans would take if a stage waited for an offload later (`Plan.offload_window`).

The planner's model by default (``plan.offload_window: 1``) waits for each offload (a host-tier
layer's saved tensors copied out) two stages after its layer's forward: the copy must fit in one stage, so a host-tier layer whose
tensors take longer to copy than the next layer's forward stretches that stage, and the MILP
recomputes more of it instead (the `mlp` option: 2.02 GB to the host at 7B, batch 64 x 1024,
against 4.50 GB recomputing only the up projection). The executor waits for no offload: a
copy runs on while the forward goes on, its GPU memory held until it is done.
`simulate(..., offload_window=W)` lets a copy take W stages, its memory counted through them.

For each measured run of a `bench/plan_bench.py` record file: its plan, the same plan with
every host-tier layer recomputing each other block (its cost table's options, or nothing), and
with ``--solve`` the plan the MILP solves at each window (`Plan.offload_window`, the same
resident layers; its own window's cell filled),
simulated on its process's table at the CPU update rate its prediction was made on (the last
recalibration's planned rate, which a kept plan was not re-solved for; else the table's), at each
window. Predictions, not measurements (the measured step is beside them).

    python -m bench.studies.offload_window bench/results/plan_qwen2.5-7b_h200_2026-12-05_margin.json [--windows 1 2 3 8]
        [--solve 1 2 3]

Writes ``<records stem>_offload_window.{json,md}`` beside the records (``--out`` to change).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib
import json
from pathlib import Path

from bench.common import write_results
from lazytrain.plan.costs import CostTable
from lazytrain.plan.milp import solve_plan
from lazytrain.plan.plan import Plan

simulate_module = importlib.import_module("lazytrain.plan.simulate")

SHORT = {"none": ".", "mlp": "m", "mlp_up": "u", "attention": "a"}


def layer_code(plan: Plan) -> str:
    """Per layer: G (GPU) or H (host) tier, then what it recomputes (. none, m mlp, u mlp_up, a
    attention); checkpoint and drop layers as c/d."""
    return "".join({"gpu": "G", "host": "H", "nvme": "N"}[lp.tier] + SHORT.get(lp.recompute, "?")
                   if lp.mode == "keep" else lp.mode[0] for lp in plan.layers)


def with_host_recompute(plan: Plan, option: str) -> Plan:
    """``plan`` with every host-tier kept layer recomputing ``option`` in its backward."""
    out = copy.deepcopy(plan)
    for lp in out.layers:
        if lp.mode == "keep" and lp.tier == "host":
            lp.recompute = option
    return out


def studies(records: list[dict], windows: list[int], solve: list[int] = ()) -> list[dict]:
    rows, table = [], None
    for r in records:
        if r.get("name") == "costs":
            table = CostTable.from_dict(r["costs"])
            continue
        if "plan" not in r or "step_time_s" not in r or r.get("update") == "skipped":
            continue
        if table is None:
            raise ValueError(f"{r['name']}: no costs record before it")
        plan = Plan.from_dict(r["plan"])
        recal = r.get("recalibration") or {}
        solved_for = [c["planned_ns_per_param"] for c in recal.get("rounds", []) if "predicted_resolved_s" in c]
        rate = solved_for[-1] if solved_for else table.optimizer_ns_per_param
        costs = dataclasses.replace(table, optimizer_ns_per_param=rate)
        options = sorted({o for lc in costs.layers for o in lc.recompute_options})
        variants = [("as run", plan)] + [(f"host layers: {o}", with_host_recompute(plan, o))
                                         for o in ["none", *options]]
        for what, p in variants:
            if what != "as run" and layer_code(p) == layer_code(plan):
                continue
            row = {"name": r["name"], "variant": what, "layers": layer_code(p), "ns_per_param": rate,
                   "measured_step_s": r["step_time_s"], "gpu_budget_gb": costs.gpu_bytes / 1e9, "windows": {}}
            for w in windows:
                s = simulate_module.simulate(p, costs, optimizer_overlap=True, offload_window=w)
                row["windows"][str(w)] = {"step_s": s.step_time_s, "exposed_d2h_s": s.exposed_s["d2h"],
                                          "peak_gpu_gb": s.peak_gpu_bytes / 1e9,
                                          "fits": s.peak_gpu_bytes <= costs.gpu_bytes}
            rows.append(row)
        for w in solve:
            solved = solve_plan(costs, optimizer_overlap=True, const_update=plan.const_update,
                                device_layers=plan.device_layers, device_steps=plan.device_steps,
                                recompute=tuple(options), offload_window=w, tiers=("gpu", "host"))
            s = simulate_module.simulate(solved, costs, optimizer_overlap=True)
            rows.append({"name": r["name"], "variant": f"solved at W = {w}", "layers": layer_code(solved),
                         "ns_per_param": rate, "measured_step_s": r["step_time_s"],
                         "gpu_budget_gb": costs.gpu_bytes / 1e9, "milp": solved.notes["milp"],
                         "windows": {str(w): {"step_s": s.step_time_s, "exposed_d2h_s": s.exposed_s["d2h"],
                                              "peak_gpu_gb": s.peak_gpu_bytes / 1e9,
                                              "fits": s.peak_gpu_bytes <= costs.gpu_bytes}}})
    return rows


def markdown(rows: list[dict], windows: list[int], source: str, solve: list[int] = ()) -> str:
    lines = [f"# Offloads waited for later: `{source}`", "",
             "`python -m bench.studies.offload_window " + source + " --windows " + " ".join(map(str, windows))
             + (" --solve " + " ".join(map(str, solve)) if solve else "") + "`. "
             "Each measured run's plan (and the same plan with its host-tier layers recomputing another block), "
             "simulated on its process's cost table at the update rate it was predicted on, a stage waiting for "
             "an offload W stages after it is issued (W = 1: the planner's model). Predicted step s (exposed D2H "
             "s); * where the peak is over the planner's GPU budget. Layers: G/H tier, then . nothing, "
             "m mlp, u mlp_up, a attention recomputed.", "",
             "| run | variant | layers | measured step s | " + " | ".join(f"W = {w}" for w in windows) + " |",
             "|---|---|---|---|" + "---|" * len(windows)]
    for r in rows:
        cells = [f"{v['step_s']:.3f} ({v['exposed_d2h_s']:.3f}){'' if v['fits'] else ' *'}"
                 if (v := r["windows"].get(str(w))) else "-" for w in windows]
        lines.append(f"| {r['name']} | {r['variant']} | `{r['layers']}` | {r['measured_step_s']:.3f} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("records", help="a plan_bench record file")
    parser.add_argument("--windows", type=int, nargs="+", default=[1, 2, 3, 8])
    parser.add_argument("--solve", type=int, nargs="*", default=[],
                        help="also solve each run's table at these windows (its resident layers kept)")
    parser.add_argument("--out", default=None, help="folder for the results (default: the records')")
    args = parser.parse_args(argv)
    if any(w < 1 for w in [*args.windows, *args.solve]):
        parser.error(f"--windows and --solve must be >= 1, got {args.windows} {args.solve}")
    windows = sorted({*args.windows, *args.solve})
    path = Path(args.records)
    rows = studies(json.loads(path.read_text()), windows, args.solve)
    if not rows:
        raise SystemExit(f"{path}: no measured run with a plan")
    out = write_results(rows, f"{path.stem}_offload_window", markdown(rows, windows, str(path), args.solve),
                        args.out or path.parent)
    print(out)


if __name__ == "__main__":
    main()

"""Measured against predicted GPU memory per stage, for plan runs recorded with ``--stage-memory``.

CPU only: no model, no GPU. For every record of the given ``bench/plan_bench.py`` result files
that has ``stage_memory_gb`` ([stage, measured GB, predicted GB] per stage it finished) and its
``plan``, the cost table it ran with (the ``costs`` record of its report: the profile or
``--costs`` file with that run's GPU and host budgets) is rescaled to the record's batch
(`CostTable.at`, as plan_bench does) and the plan simulated again with the current code. Printed:
whether the current simulator still gives the recorded predictions, the worst stages, and per stage
kind (embed, kept fwd/bwd per recompute option, checkpointed fwd/bwd, head, embed bwd) the
measured - predicted error in GB and per token.

    python -m bench.studies.stage_memory_check bench/results/plan_qwen3.5-9b_h200_2026-12-02_s1024_max.json \
        --out bench/results
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from lazytrain.plan.costs import CostTable
from lazytrain.plan.plan import Plan
from lazytrain.plan.simulate import simulate

DEFAULT_FILES = (
    "bench/results/plan_qwen3.5-9b_h200_2026-12-02_s1024_max.json",
    "bench/results/plan_qwen3.5-9b_h200_2026-12-01_s1024_pinned.json",
)
REPRODUCED_GB = 1e-3
"""The current simulator gives a record's predictions when each is within this."""


def stage_kind(stage: str, plan: Plan) -> str:
    """``embed``, ``head``, ``embed bwd``, or ``fwd|bwd keep[+recompute]`` / ``fwd|bwd checkpoint``
    (drop layers count as checkpointed: they are recomputed)."""
    if stage in ("embed", "head", "embed bwd"):
        return stage
    phase, layer = stage.split()
    lp = plan.layers[int(layer)]
    if lp.mode == "keep":
        return f"{phase} keep" + (f"+{lp.recompute}" if lp.recompute != "none" else "")
    return f"{phase} checkpoint"


def check_file(path: str | Path) -> list[dict]:
    """One row per stage of every record of ``path`` with stage memory."""
    records = json.loads(Path(path).read_text())
    tables = {r.get("report"): CostTable.from_dict(r["costs"]) for r in records if r.get("name") == "costs"}
    rows = []
    for r in records:
        stages = r.get("stage_memory_gb")
        if not stages or r.get("name") == "costs" or len(stages[0]) < 3 or "plan" not in r:
            continue
        table = tables[r.get("report")].at(r["batch_size"], r["seq_len"])
        plan = Plan.from_dict(r["plan"])
        sim = simulate(plan, table, optimizer_overlap=True)
        predicted = dict(zip(sim.stage_names, sim.gpu_bytes_by_stage))
        rebuilt = max(abs(predicted[name] / 1e9 - old) for name, _, old in stages)
        for name, measured, old in stages:
            rows.append({
                "file": Path(path).name, "record": r["name"], "policy": r["policy"], "batch_size": r["batch_size"],
                "tokens": r["batch_size"] * r["seq_len"], "unchanged": rebuilt <= REPRODUCED_GB,
                "oom": "oom" in r, "stage": name,
                "kind": stage_kind(name, plan), "measured_gb": measured, "recorded_gb": old,
                "predicted_gb": predicted[name] / 1e9,
            })
    return rows


def summary(rows: list[dict]) -> list[dict]:
    """Per stage kind: count, mean / min / max of measured - predicted (GB and bytes per token)."""
    by_kind: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        by_kind[row["kind"]].append(row)
    out = []
    for kind, group in sorted(by_kind.items()):
        err = [g["measured_gb"] - g["predicted_gb"] for g in group]
        per_token = [e * 1e9 / g["tokens"] for e, g in zip(err, group)]
        rel = [abs(e) / g["measured_gb"] for e, g in zip(err, group)]
        out.append({"kind": kind, "stages": len(group), "mean_gb": sum(err) / len(err), "min_gb": min(err),
                    "max_gb": max(err), "mean_bytes_per_token": sum(per_token) / len(per_token),
                    "within_2pct_or_2gb": sum(abs(e) <= 2 or q <= 0.02 for e, q in zip(err, rel))})
    return out


def markdown(rows: list[dict], files: list[str], worst: int, skipped: list[str]) -> str:
    used = rows
    records = sorted({(r["file"], r["record"]) for r in used})
    lines = [
        "# Stage memory: measured against the simulator", "",
        (f"Files: {', '.join(Path(f).name for f in files)}. {len(records)} records, {len(used)} stages. "
         "Error = measured - predicted (positive: the simulator under-predicts, the run may run out of memory)."),
        "",
    ]
    if skipped:
        lines += [f"Left out (no plan recorded): {', '.join(skipped)}.", ""]
    unchanged = max((abs(r["predicted_gb"] - r["recorded_gb"]) for r in used), default=0.0)
    lines += [(f"Current simulator against the predictions recorded with the runs: largest difference "
               f"{unchanged:.3f} GB."), ""]
    lines += ["| stage kind | stages | mean error GB | min | max | mean bytes/token | within 2% or 2 GB |",
              "|---|---|---|---|---|---|---|"]
    for s in summary(used):
        lines.append(f"| {s['kind']} | {s['stages']} | {s['mean_gb']:+.2f} | {s['min_gb']:+.2f} | {s['max_gb']:+.2f} | "
                     f"{s['mean_bytes_per_token']:+.0f} | {s['within_2pct_or_2gb']} |")
    lines += ["", f"Worst {worst} stages:", "", "| record | stage | kind | measured GB | predicted GB | error GB |",
              "|---|---|---|---|---|---|"]
    for r in sorted(used, key=lambda r: -abs(r["measured_gb"] - r["predicted_gb"]))[:worst]:
        lines.append(f"| {r['record']} | {r['stage']} | {r['kind']} | {r['measured_gb']:.2f} | {r['predicted_gb']:.2f} | "
                     f"{r['measured_gb'] - r['predicted_gb']:+.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", default=list(DEFAULT_FILES))
    parser.add_argument("--worst", type=int, default=15)
    parser.add_argument("--out", default=None, help="also write stage_memory_check.json / .md here")
    args = parser.parse_args()
    rows = [row for f in args.files for row in check_file(f)]
    skipped = [r["name"] for f in args.files for r in json.loads(Path(f).read_text())
               if r.get("stage_memory_gb") and "plan" not in r]
    report = markdown(rows, args.files, args.worst, skipped)
    print(report)
    if args.out:
        out = Path(args.out)
        (out / "stage_memory_check.json").write_text(json.dumps(rows, indent=1) + "\n")
        (out / "stage_memory_check.md").write_text(report)


if __name__ == "__main__":
    main()

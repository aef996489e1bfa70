"""Each measured `bench/plan_bench.py` run against its compute-only time (issue 19's denominator).

Compute-only is the run's own measured forward + backward of one layer with its weights resident
(``compute_only_layers_s``: that time for every layer) plus the cost table's head and loss
(``head_ms``), as the README's tables have defined it since 2026-12-03. The table shows the
median step and its range over it (the JSON also the first step's), next to what sets the gap: the GPU's compute
(recompute, compute slowed by copies), the GPU waiting for the CPU update, and the update's rate
inside the step.

    python -m bench.studies.compute_only bench/results/plan_qwen2.5-7b_h200_2026-12-05_as_trained.json

A record file holds one or more processes, each starting with its ``costs`` record (as
`bench/merge_results.py` keeps them); "process" numbers them in file order. The rows go to
``--out`` as ``<stem>_compute_only.json`` (one record per run) and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def rows(records: list[dict]) -> list[dict]:
    """One row per measured run in ``records`` (plan_bench's records, ``costs`` records among
    them): its step against its compute-only time."""
    out, process, head_s = [], 0, None
    for r in records:
        if r.get("name") == "costs":
            process += 1
            head_s = r["costs"]["head_ms"] / 1e3
            continue
        if "step_time_s" not in r or "compute_only_layers_s" not in r:
            continue  # out of memory, not started
        if head_s is None:
            raise ValueError(f"{r['name']}: no costs record before it, so no head time for its compute-only")
        compute_only = r["compute_only_layers_s"] + head_s
        steps = r.get("step_times_s") or [r["step_time_s"]]
        plan = r.get("plan") or {}
        recal = r.get("recalibration") or {}
        # the rate the measured plan was solved for: the last round that re-solved (older records: one round)
        solved_for = [c.get("planned_ns_per_param", c.get("measured_ns_per_param"))
                      for c in recal.get("rounds", [recal]) if "predicted_resolved_s" in c]
        update_s, params = r.get("cpu_update_s"), r.get("cpu_update_params")
        out.append({
            "name": r["name"], "process": process, "date": r["date"], "device": r["device"],
            "update": r.get("update", "cpu"), "device_layers": plan.get("device_layers"),
            "device_steps": plan.get("device_steps"),
            "recalibrated_ns_per_param": solved_for[-1] if solved_for else recal.get("measured_ns_per_param"),
            "replanned": recal.get("changed"),
            "step_time_s": r["step_time_s"], "step_min_s": min(steps), "step_max_s": max(steps),
            "first_step_s": steps[0], "predicted_step_time_s": r["predicted_step_time_s"],
            "gpu_compute_s": r["gpu_compute_s"], "predicted_gpu_compute_s": r["predicted_gpu_compute_s"],
            "gpu_idle_other_s": r["gpu_idle_other_s"], "cpu_update_s": update_s,
            "update_ns_per_param_in_step": update_s * 1e9 / params if update_s and params else None,
            "tflops_6nt": r["tflops_6nt"], "tokens_per_s": r["tokens_per_s"],
            "compute_only_s": compute_only, "step_over_compute_only": r["step_time_s"] / compute_only,
            "first_step_over_compute_only": steps[0] / compute_only,
            "range_over_compute_only": [min(steps) / compute_only, max(steps) / compute_only],
            "gpu_compute_over_compute_only": r["gpu_compute_s"] / compute_only,
        })
    return out


def _n(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown(table: list[dict], source: str) -> str:
    lines = [f"# Steps against compute-only: {source}", "",
             ("Compute-only: the run's own measured layer forward + backward (weights resident) for every "
              "layer, plus the cost table's head and loss. Step: the median of the measured steps (range); "
              "the update's rate: the CPU update's time in the measured steps over the parameters it steps."), "",
             ("| process | run | k | update | recalibrated ns/param | step s (range) | predicted s | GPU compute s "
              "(pred.) | GPU idle other s | CPU update s (ns/param) | TFLOPS 6NT | compute-only s | step / "
              "compute-only (range) | GPU compute / compute-only |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for t in table:
        recal = "-" if t["recalibrated_ns_per_param"] is None else (
            f"{t['recalibrated_ns_per_param']:.3f} ({'re-planned' if t['replanned'] else 'kept'})")
        lo, hi = t["range_over_compute_only"]
        lines.append(
            f"| {t['process']} | {t['name']} | {_n(t['device_layers'], 'd')} | {t['update']} | {recal} | "
            f"{t['step_time_s']:.3f} ({t['step_min_s']:.2f}-{t['step_max_s']:.2f}) | {t['predicted_step_time_s']:.3f} | "
            f"{t['gpu_compute_s']:.2f} ({t['predicted_gpu_compute_s']:.2f}) | {t['gpu_idle_other_s']:.2f} | "
            + ("- | " if t["update"] == "skipped" else
               f"{_n(t['cpu_update_s'], '.2f')} ({_n(t['update_ns_per_param_in_step'], '.3f')}) | ")
            + f"{t['tflops_6nt']:.1f} | "
            f"{t['compute_only_s']:.3f} | **{t['step_over_compute_only']:.3f}x** ({lo:.3f}-{hi:.3f}) | "
            f"{t['gpu_compute_over_compute_only']:.3f}x |")
    ratios = [t["step_over_compute_only"] for t in table]
    if ratios:
        lines += ["", (f"{len(ratios)} runs: step / compute-only median {statistics.median(ratios):.3f}x, "
                       f"least {min(ratios):.3f}x, most {max(ratios):.3f}x.")]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("records", type=Path, help="a plan_bench record file (JSON list)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results")
    args = parser.parse_args(argv)
    table = rows(json.loads(args.records.read_text()))
    if not table:
        parser.error(f"{args.records}: no measured run with compute_only_layers_s in it")
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"{args.records.stem}_compute_only"
    (args.out / f"{stem}.json").write_text(json.dumps(table, indent=1) + "\n")
    (args.out / f"{stem}.md").write_text(markdown(table, args.records.name))
    print(markdown(table, args.records.name), end="")


if __name__ == "__main__":
    main()

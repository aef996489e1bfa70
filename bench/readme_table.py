"""The README's headline tables, written from committed records.

    python bench/readme_table.py           # rewrite the blocks between the markers in README.md
    python bench/readme_table.py --check   # exit 1 when README.md's blocks are not what the records give

The peers block is everything between ``<!-- peers-table:start -->`` and
``<!-- peers-table:end -->``, from ``bench/results/peers_*.json`` (or the files given; where
several runs have the same model, run, batch and device, the newest date wins). The plan block,
between ``<!-- plan-table:start -->`` and ``<!-- plan-table:end -->`` (rewritten where the file
has it), is the solved plan as trained against its compute-only time, from the
``*_compute_only.json`` rows that ``bench/studies/compute_only.py`` made of the ``PLAN_RECORDS``. Both
are generated only, so the numbers in the README are always those of a results file in the repo
(``tests/test_peers.py`` checks that README.md is current).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
README = ROOT / "README.md"
START, END = "<!-- peers-table:start -->", "<!-- peers-table:end -->"
PLAN_START, PLAN_END = "<!-- plan-table:start -->", "<!-- plan-table:end -->"
# the planner's headline runs: the Qwen2.5-7B shape at batch 64 x 1024 on the H200, 8-bit states,
# split master, embedding, head and the first k layers stepped on the GPU, recalibrated after 4
# steps (the trainer's defaults); rows from `python bench/studies/compute_only.py RECORDS.json`
PLAN_RECORDS = (
    "plan_qwen2.5-7b_h200_2026-12-05_as_trained_compute_only.json",
    "plan_qwen2.5-7b_h200_2026-12-05_margin_compute_only.json",
)
ORDER = ("lazytrain:hybrid8bit", "lazytrain:fp32", "deepspeed_zero3_offload", "fsdp2_cpu_offload", "pytorch_gpu")
LABEL = {
    "lazytrain:hybrid8bit": "LazyTrain, 8-bit states",
    "lazytrain:fp32": "LazyTrain, fp32 states",
    "deepspeed_zero3_offload": "DeepSpeed ZeRO-3, CPU offload",
    "fsdp2_cpu_offload": "FSDP2, CPUOffloadPolicy",
    "pytorch_gpu": "PyTorch, all on the GPU",
}
REFERENCE = "lazytrain:hybrid8bit"
CEILING = "pytorch_gpu"


def load(paths: list[Path]) -> list[dict]:
    """The newest record of each (model, run, batch, device) in ``paths``, with its file."""
    newest: dict[tuple, dict] = {}
    for path in sorted(paths):
        for record in json.loads(path.read_text()):
            if record.get("invalid"):  # kept in its file: not a measurement, or superseded (`--invalid`)
                continue
            record = {**record, "source": path.name}
            key = (record["model"], record["run"], record["batch_size"], record["device"])
            if key not in newest or record["date"] >= newest[key]["date"]:
                newest[key] = record
    return list(newest.values())


def number(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def measured(record: dict) -> bool:
    """A run with figures: finished, or stopped after measured steps (``partial_steps``)."""
    return record["status"] == "ok" or bool(record.get("partial_steps"))


def outcome(record: dict) -> str:
    """tokens/s, or why there are none."""
    if record["status"] == "ok":
        return number(record["tokens_per_s"], ",.0f")
    if record.get("partial_steps"):
        return (f"{number(record['tokens_per_s'], ',.0f')} ({record['partial_steps']} measured steps, from its log: "
                f"{record['status']})")
    if record["status"] == "does not fit host memory" and record.get("host_estimate_gb") is not None:
        return f"does not fit host memory ({record['host_estimate_gb']:.0f} GB needed, {record['host_room_gb']:.0f} free)"
    return record["status"]


def fastest_row(rows: list[dict], run: str) -> dict | None:
    """``run``'s finished row with the most tokens/s, of any batch (a search's tries included)."""
    return max((r for r in rows if r["run"] == run and r["status"] == "ok"), key=lambda r: r["tokens_per_s"],
               default=None)


def summary(model: str, rows: list[dict]) -> str:
    """LazyTrain 8-bit's tokens/s against the fastest offloading peer that ran, each at its
    fastest batch, and against plain PyTorch on the GPU (the no-offload ceiling) where it ran."""
    ours = [r for r in rows if r["run"] == REFERENCE and r["status"] == "ok"]
    peers = [r for r in rows if not r["run"].startswith("lazytrain") and r["run"] != CEILING and measured(r)]
    ceiling = [r for r in rows if r["run"] == CEILING and r["status"] == "ok"]
    if not ours:
        return f"{model}: LazyTrain (8-bit states) has no measured row."
    best_ours = max(ours, key=lambda r: r["tokens_per_s"])
    text = f"{model}: LazyTrain (8-bit states) {best_ours['tokens_per_s']:,.0f} tokens/s (batch {best_ours['batch_size']})"
    if peers:
        best = max(peers, key=lambda r: r["tokens_per_s"])
        partial = f", {best['partial_steps']} measured steps before it was stopped" if best["status"] != "ok" else ""
        text += (f", **{best_ours['tokens_per_s'] / best['tokens_per_s']:.2f}x** the fastest offloading peer "
                 f"({LABEL.get(best['run'], best['run'])}, batch {best['batch_size']}: {best['tokens_per_s']:,.0f}{partial})")
    else:
        text += "; no offloading peer runs this model on this machine"
    if ceiling:
        top = max(ceiling, key=lambda r: r["tokens_per_s"])
        text += (f"; {best_ours['tokens_per_s'] / top['tokens_per_s']:.2f}x {LABEL[CEILING]} (no offload, batch "
                 f"{top['batch_size']}: {top['tokens_per_s']:,.0f})")
    return text + "."


def table(records: list[dict]) -> str:
    """The block's Markdown: one table over every model, then one line per model."""
    if not records:
        return ("No peer comparison has been recorded yet: `python -m bench.peers` writes "
                "`bench/results/peers_*.json`, then `python bench/readme_table.py` fills this table.")
    size = {r["model"]: r["num_params"] for r in records}
    models = sorted(size, key=lambda m: (size[m], m))
    lines = [
        ("| model | trainer | batch | tokens/s | vs LazyTrain 8-bit | TFLOPS (model) | step s | peak GPU GB | "
         "host GB | exact AdamW | device, date |"),
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    notes, footnotes = [], []
    for model in models:
        everything = [r for r in records if r["model"] == model]
        fastest = {id(fastest_row(everything, run)) for run in {r["run"] for r in everything}}
        # the runs at the batches asked for, each run's largest batch and its fastest (a search's
        # other tries are left out)
        rows = sorted((r for r in everything if not r.get("search") or r.get("largest_batch") or id(r) in fastest),
                      key=lambda r: (ORDER.index(r["run"]) if r["run"] in ORDER else len(ORDER), r["batch_size"]))
        reference = {r["batch_size"]: r["tokens_per_s"] for r in rows if r["run"] == REFERENCE and r["status"] == "ok"}
        for r in rows:
            ratio = (r["tokens_per_s"] / reference[r["batch_size"]]
                     if measured(r) and r["batch_size"] in reference else None)
            label = LABEL.get(r["run"], r["run"])
            if r.get("note"):
                if r["note"] not in footnotes:
                    footnotes.append(r["note"])
                label += f" [{footnotes.index(r['note']) + 1}]"
            largest = " (largest)" if r.get("largest_batch_bounded", True) else " (largest tried)"
            batch = (f"{r['batch_size']}" + (largest if r.get("largest_batch") else "")
                     + (" (fastest)" if r.get("search") and id(r) in fastest and not r.get("largest_batch") else ""))
            exact = {True: "yes", False: "no", None: "-"}[r.get("optimizer_exact")]
            host = r.get("host_used_gb") if r["status"] == "ok" else None
            lines.append(
                f"| {model} | {label} | {batch} | {outcome(r)} | {number(ratio, '.2f')} | "
                f"{number(r['tflops_model'], '.1f')} | {number(r['step_time_s'], '.2f')} | "
                f"{number(r['peak_gpu_alloc_gb'], '.1f')} | {number(host, '.1f')} | {exact} | "
                f"{r['device']}, {r['date']} |"
            )
        notes.append(summary(model, rows))
    sources = sorted({r["source"] for r in records})
    return "\n".join(lines + [""] + [f"- {n}" for n in notes] + [""] * bool(footnotes)
                     + [f"[{i}] {text}" + ("  " if i < len(footnotes) else "") for i, text in enumerate(footnotes, 1)] + [
        "",
        (f"From {', '.join(f'`bench/results/{s}`' for s in sources)} (`python bench/readme_table.py`). "
         "host GB: the machine's used memory during the run less before it; exact AdamW: fp32 masters and "
         "fp32 moments."),
    ])


def plan_table(paths: list[Path]) -> str:
    """The block's Markdown: each run as trained (its CPU update not skipped) against its
    compute-only time and its prediction, then one line over all of them."""
    lines = [("| record | process | resident layers k | tokens/s | TFLOPS 6NT | step s (range) | predicted s "
              "(error) | step / compute-only |"),
             "|---|---|---|---|---|---|---|---|"]
    ratios, errors = [], []
    for path in paths:
        tag = path.name.removesuffix("_compute_only.json")
        for r in json.loads(path.read_text()):
            if r["update"] != "cpu":
                continue
            error = r["predicted_step_time_s"] / r["step_time_s"] - 1
            ratios.append(r["step_over_compute_only"])
            errors.append(error)
            k = ("auto: " if "_dlauto" in r["name"] else "") + str(r["device_layers"])
            lines.append(
                f"| {tag} | {r['process']} | {k}{' (re-planned)' if r['replanned'] else ''} | "
                f"{r['tokens_per_s']:,.0f} | {r['tflops_6nt']:.1f} | {r['step_time_s']:.2f} "
                f"({r['step_min_s']:.2f}-{r['step_max_s']:.2f}) | {r['predicted_step_time_s']:.2f} ({error:+.1%}) | "
                f"{r['step_over_compute_only']:.3f}x |")
    if not ratios:
        return "No plan_bench run has been recorded against its compute-only time yet."
    return "\n".join(lines + [
        "",
        (f"{len(ratios)} runs: step / compute-only median {statistics.median(ratios):.3f}x ({min(ratios):.3f}-"
         f"{max(ratios):.3f}x); predicted step time {min(errors):+.1%} to {max(errors):+.1%} of the measured one."),
        "",
        (f"From {', '.join(f'`bench/results/{p.name}`' for p in paths)} (`python bench/readme_table.py`). "
         "Compute-only: the run's own forward + backward of one layer with its weights resident, times the "
         "layers, plus the profiled head and loss; k: the decoder layers kept and stepped on the GPU."),
    ])


def rewrite(text: str, block: str, start: str = START, end: str = END) -> str:
    """``text`` with everything between the markers replaced by ``block``."""
    if text.count(start) != 1 or text.count(end) != 1 or text.index(start) > text.index(end):
        raise SystemExit(f"README.md needs exactly one {start} ... {end} block")
    head, rest = text.split(start)
    _, tail = rest.split(end)
    return f"{head}{start}\n{block}\n{end}{tail}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("records", nargs="*", type=Path, help="peers_*.json files (default: bench/results)")
    parser.add_argument("--readme", type=Path, default=README)
    parser.add_argument("--check", action="store_true", help="exit 1 if the README's blocks are out of date")
    args = parser.parse_args()
    paths = args.records or sorted(RESULTS.glob("peers_*.json"))
    text = args.readme.read_text()
    updated = rewrite(text, table(load(paths)))
    if PLAN_START in text:
        updated = rewrite(updated, plan_table([RESULTS / name for name in PLAN_RECORDS]), PLAN_START, PLAN_END)
    if args.check:
        if updated != text:
            sys.exit(f"{args.readme}: the peers table is out of date; run python bench/readme_table.py")
        return
    args.readme.write_text(updated)


if __name__ == "__main__":
    main()

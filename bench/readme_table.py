"""The README's headline table, written from the committed records of ``bench/peers.py``.

    python bench/readme_table.py           # rewrite the block between the markers in README.md
    python bench/readme_table.py --check   # exit 1 when README.md's block is not what the records give

The block is everything between ``<!-- peers-table:start -->`` and ``<!-- peers-table:end -->``;
it is generated only, so the numbers in the README are always those of a results file in the
repo (``tests/test_peers.py`` checks that README.md is current). Records come from
``bench/results/peers_*.json`` (or the files given); where several runs have the same model,
run, batch and device, the newest date wins.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
README = ROOT / "README.md"
START, END = "<!-- peers-table:start -->", "<!-- peers-table:end -->"
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


def rewrite(text: str, block: str) -> str:
    """``text`` with everything between the markers replaced by ``block``."""
    if text.count(START) != 1 or text.count(END) != 1 or text.index(START) > text.index(END):
        raise SystemExit(f"README.md needs exactly one {START} ... {END} block")
    head, rest = text.split(START)
    _, tail = rest.split(END)
    return f"{head}{START}\n{block}\n{END}{tail}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("records", nargs="*", type=Path, help="peers_*.json files (default: bench/results)")
    parser.add_argument("--readme", type=Path, default=README)
    parser.add_argument("--check", action="store_true", help="exit 1 if the README's block is out of date")
    args = parser.parse_args()
    paths = args.records or sorted(RESULTS.glob("peers_*.json"))
    text = args.readme.read_text()
    updated = rewrite(text, table(load(paths)))
    if args.check:
        if updated != text:
            sys.exit(f"{args.readme}: the peers table is out of date; run python bench/readme_table.py")
        return
    args.readme.write_text(updated)


if __name__ == "__main__":
    main()

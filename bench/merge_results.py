"""Merge per-seed or per-try record files into one record file per study.

    python -m bench.merge_results bench/results/optim_convergence_seeds_2026-11-29 \
        bench/results/optim_convergence_seeds_2026-11-29_*.json

Each record keeps its fields and gains ``report``: the stem of the file it came from, whose
Markdown report (kept) describes it. The merged inputs are removed; a record already in the
study file (same report and fields) is not added twice.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def fields(record: dict) -> str:
    """A record's identity within its report: every field but ``report`` (one file may hold
    several records of one name: optim_bench's, one per rounding)."""
    return json.dumps({k: v for k, v in record.items() if k != "report"}, sort_keys=True)


def merge(study: Path, files: list[Path]) -> list[dict]:
    target = study.parent / f"{study.name.removesuffix('.json')}.json"
    records = json.loads(target.read_text()) if target.exists() else []
    if records and "report" not in records[0]:  # the study file was a try of its own
        records = [{**r, "report": target.name.removesuffix(".json")} for r in records]
    seen = {(r["report"], fields(r)) for r in records}
    for path in files:
        if path.resolve() == target.resolve():
            continue
        loaded = json.loads(path.read_text())
        for record in loaded if isinstance(loaded, list) else [loaded]:
            key = (path.stem, fields(record))
            if key not in seen:
                records.append({**record, "report": path.stem})
                seen.add(key)
    target.write_text(json.dumps(records, indent=1) + "\n")
    for path in files:
        if path.resolve() != target.resolve():
            path.unlink()
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("study", type=Path, help="the study's file stem (its .json is written)")
    parser.add_argument("files", type=Path, nargs="+", help="record files to merge into it")
    args = parser.parse_args()
    records = merge(args.study, args.files)
    print(f"{args.study}.json: {len(records)} records from {len(args.files)} files")


if __name__ == "__main__":
    main()

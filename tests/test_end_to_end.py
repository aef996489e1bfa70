"""The README's demo learns: `lazytrain train` with no arguments, then `lazytrain eval` on the
built-in held-out split, reaches >= 90% exact match within 5 minutes on 2 CPU cores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow


def lazytrain(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lazytrain.cli.main", *args],
        cwd=cwd, capture_output=True, text=True, timeout=600, check=False,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )


def test_default_train_then_eval_reaches_90_percent(tmp_path):
    start = time.perf_counter()
    train = lazytrain("train", "training.progress=false", cwd=tmp_path)
    assert train.returncode == 0, train.stderr[-3000:]
    trained = time.perf_counter() - start
    out = tmp_path / "runs" / "default"
    evaluation = lazytrain("eval", cwd=tmp_path)  # eval.model defaults to training.output_dir
    assert evaluation.returncode == 0, evaluation.stderr[-3000:]
    elapsed = time.perf_counter() - start
    report = json.loads(evaluation.stdout)
    print(f"train {trained:.0f} s, train + eval {elapsed:.0f} s, exact match {report['accuracy']:.3f}")
    assert report["n"] == 200
    assert report["accuracy"] >= 0.90, report
    assert elapsed <= 300, f"train + eval took {elapsed:.0f} s"
    # the predictions are real generations of held-out problems the training never saw
    predictions = [json.loads(line) for line in (out / "eval_predictions.jsonl").read_text().splitlines()]
    assert len({p["query"] for p in predictions}) == 200
    assert all("The answer is:" in p["prediction"] for p in predictions if p["prediction"])

"""The benchmark scripts run on the CPU with the tiny model and write DESIGN.md section 6 records
(the H200 runs use the same code, so a script that rots fails here, not on the device).

The scripts run in this process (their ``main(argv)``): a process of its own would import torch,
transformers and LazyTrain again (~7 CPU seconds each). One test runs ``python -m bench.plan_bench``
from the checkout as a user does; the fine-tuning study's ``--jobs`` start their own processes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import subprocess
import sys
import tarfile
import time
import warnings
import weakref
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
FIELDS = {"name", "date", "device", "torch", "model", "seq_len", "batch_size", "policy", "tokens_per_s",
          "tflops_6nt", "tflops_model", "step_time_s", "predicted_step_time_s", "host_rss_gb",
          "gpu_mem_cap_gb", "world_size", "host_bytes_per_param", "runner"}
TINY = ["--model", "tiny", "--device", "cpu", "--batch", "2", "--seq", "32", "--split-master", "off"]


def plan_bench(*argv: str) -> None:
    from bench import plan_bench

    plan_bench.main(list(argv))


@pytest.fixture(scope="module")
def tiny_study(tmp_path_factory) -> Path:
    """One profiled plan_bench study of the tiny model that several tests read: the solved plan
    (at offload windows 1 and 2, and with a host limit of 0.01 GiB) and megatrain, each with the
    CPU update as trained and skipped. Its folder: the records, the report, the cost table."""
    out = tmp_path_factory.mktemp("plan_tiny")
    plan_bench(*TINY, "--runs", "solved", "megatrain", "solved@0.01", "--update", "cpu", "skipped",
               "--offload-window", "1", "2", "--warmup", "1", "--steps", "1", "--out", str(out))
    return out


def runs_of(folder: Path) -> list[dict]:
    (path,) = folder.glob("plan_tiny_*.json")
    return [r for r in json.loads(path.read_text()) if "tokens_per_s" in r]


def test_plan_bench_on_the_cpu_writes_records(tiny_study, tmp_path):
    # the runs as trained at the default offload window: the solved plan, megatrain, solved@GIB
    runs = [r for r in runs_of(tiny_study) if r["update"] == "cpu" and "_ow2" not in r["name"]]
    assert [r["policy"] for r in runs] == ["solved", "megatrain", "solved"]
    for r in runs:
        assert FIELDS <= r.keys(), FIELDS - r.keys()
        assert r["tokens_per_s"] > 0 and r["predicted_step_time_s"] > 0 and r["world_size"] == 1
        assert r["act_fetch_alloc_s"] >= 0 and 0 < r["host_available_min_gb"] <= r["host_total_gb"]
    # solved@GIB: that run's own host limit (here none of it left for activations)
    assert "_host0.01" in runs[2]["name"] and abs(runs[2]["host_budget_gb"]["limit"] - 0.01 * 2**30 / 1e9) < 1e-8
    assert runs[0]["host_budget_gb"]["limit"] > 1
    (records_file,) = tiny_study.glob("plan_tiny_*.json")
    report = records_file.with_suffix(".md")
    assert report.exists()
    # --report writes the Markdown again from the records, without a run (the records untouched)
    copy = tmp_path / records_file.name
    copy.write_text(records_file.read_text())
    plan_bench(*TINY, "--runs", "solved", "megatrain", "solved@0.01", "--update", "cpu", "skipped",
               "--offload-window", "1", "2", "--warmup", "1", "--steps", "1", "--state-rounding", "nearest",
               "--report", str(copy))
    assert copy.with_suffix(".md").read_text() == report.read_text()
    assert json.loads(copy.read_text()) == json.loads(records_file.read_text())

    # a cost table from before the embedding's and head's working sets were measured: the
    # bench measures those constants on the model and keeps the table's layer costs
    (profiled,) = tiny_study.glob("costs_tiny_*.json")
    old = json.loads(profiled.read_text())
    del old["head_token_bytes"], old["embed_backward_work_bytes"]
    costs_file = tmp_path / profiled.name
    costs_file.write_text(json.dumps(old))
    again = tmp_path / "again"
    plan_bench(*TINY, "--runs", "megatrain", "--warmup", "0", "--steps", "1", "--costs", str(costs_file),
               "--host-limit-gb", "0.5", "--const-update", "device", "--device-steps", "0", "1", "--out", str(again))
    (records,) = [json.loads(p.read_text()) for p in again.glob("plan_tiny_*.json")]
    # a run per number of streamed layers stepped on the GPU
    runs = {r["name"]: r["plan"]["device_steps"] for r in records if "tokens_per_s" in r}
    assert runs == {"tiny_megatrain_b2_s32_const-device_ds0": 0, "tiny_megatrain_b2_s32_const-device_ds1": 1}
    (costs,) = [r["costs"] for r in records if r["name"] == "costs"]
    assert "predates embed_backward_work_bytes, head_token_bytes" in costs["notes"]["constants"]
    assert costs["layers"] == old["layers"]
    # the host room is this run's (--host-limit-gb), not the profiled run's
    assert costs["host_bytes"] < 0.5 * 2**30 < old["host_bytes"]

    # --recalibrate: a solved run re-solved on the update rate its first steps measured, as the
    # trainer does (the table's rate 10^4 x off: never within the tolerance)
    old["optimizer_ns_per_param"] *= 1e4
    costs_file.write_text(json.dumps(old))
    third = tmp_path / "third"
    plan_bench(*TINY, "--runs", "solved", "megatrain", "--warmup", "0", "--steps", "1", "--costs", str(costs_file),
               "--recalibrate", "2", "--out", str(third))
    (records,) = [json.loads(p.read_text()) for p in third.glob("plan_tiny_*.json")]
    solved, megatrain = [r for r in records if "tokens_per_s" in r]
    assert solved["name"].endswith("_recal2") and "recalibration" not in megatrain
    recal = solved["recalibration"]
    # as plan.recalibrate_after=2: steps 1-3 run, updates 1 and 2 timed, the first left out
    assert recal["calibration_steps"] == 3 and len(recal["update_s_by_step"]) == 2
    assert recal["profiled_ns_per_param"] == old["optimizer_ns_per_param"]
    assert 0 < recal["measured_ns_per_param"] < old["optimizer_ns_per_param"] / 10
    assert recal["predicted_resolved_s"] <= recal["predicted_current_s"] * (1 + 1e-3)
    assert solved["cpu_update_params"] > 0
    from lazytrain.plan.costs import CostTable
    from lazytrain.plan.plan import Plan
    from lazytrain.plan.policies import MAX_RECALIBRATIONS, UPDATE_RATE_MARGIN
    from lazytrain.plan.simulate import simulate

    # a round per plan switched to (as the trainer), each later one planning for the slower rate
    rounds = recal["rounds"]
    assert rounds[0]["measured_ns_per_param"] == recal["measured_ns_per_param"] and 1 <= len(rounds) <= MAX_RECALIBRATIONS
    assert all(r["changed"] for r in rounds[:-1]) and recal["changed"] == any(r["changed"] for r in rounds)
    assert rounds[0]["planned_ns_per_param"] == pytest.approx(rounds[0]["measured_ns_per_param"] * (1 + UPDATE_RATE_MARGIN))
    for before, after in itertools.pairwise(rounds):
        assert after["table_ns_per_param"] == before["planned_ns_per_param"]
        assert after["planned_ns_per_param"] == pytest.approx(max(
            after["measured_ns_per_param"] * (1 + UPDATE_RATE_MARGIN), before["planned_ns_per_param"]))
    # the measured run is predicted on the last re-solve's rate (the corrected table), not the table's
    rate = [r["planned_ns_per_param"] for r in rounds if "predicted_resolved_s" in r][-1]
    (table,) = [CostTable.from_dict(r["costs"]) for r in records if r["name"] == "costs"]
    plan = Plan.from_dict(solved["plan"])
    corrected = dataclasses.replace(table, optimizer_ns_per_param=rate)
    assert solved["predicted_step_time_s"] == pytest.approx(simulate(plan, corrected, optimizer_overlap=True).step_time_s)
    assert simulate(plan, table, optimizer_overlap=True).step_time_s > 2 * solved["predicted_step_time_s"]
    report = next(third.glob("plan_tiny_*.md")).read_text()
    assert "Recalibrated before the measured steps" in report and "updates 2-2, as the trainer" in report


def test_plan_bench_does_not_start_a_try_that_its_time_limit_cannot_hold(tiny_study, tmp_path):
    """This process has run for longer than a 0.5 s limit before the try: the try is a record
    (and a row) saying why it did not start, and a ``:max`` walk stops there instead of trying
    smaller batches."""
    (costs,) = tiny_study.glob("costs_tiny_*.json")
    plan_bench(*TINY, "--runs", "solved:max", "--max-batch", "4", "--warmup", "0", "--steps", "1",
               "--costs", str(costs), "--time-limit", "0.5", "--out", str(tmp_path))
    (path,) = tmp_path.glob("plan_tiny_*.json")
    tries = [r for r in json.loads(path.read_text()) if r["name"] != "costs"]
    assert len(tries) == 1 and "tokens_per_s" not in tries[0]
    assert "s left of --time-limit 0.5" in tries[0]["not_started"]
    assert f"| {tries[0]['name']} | not started: " in path.with_suffix(".md").read_text()


def test_plan_bench_on_a_hybrid_on_the_cpu_reports_each_layer_type(tmp_path, capsys):
    """The path of the Qwen3.5-9B device runs, on the tiny hybrid: a kernel study's records say
    which kernels ran, and give each layer type's decisions and times; ``POLICY:max`` takes the
    largest batch the simulator fits up to ``--max-batch``."""
    plan_bench("--model", "tiny-hybrid", "--device", "cpu", "--batch", "2", "--seq", "32", "--kernels", "torch",
               "--runs", "torch/solved", "torch/megatrain:max", "--max-batch", "4", "--split-master", "off",
               "--warmup", "0", "--steps", "1", "--out", str(tmp_path))
    stdout = capsys.readouterr().out
    # a call cut off at its time limit still shows where the time went: the search, each try
    assert "megatrain: largest batch the simulator fits: 4 (searched in " in stdout
    assert "solved b2: planned in " in stdout and "megatrain b4: planned in " in stdout
    (path,) = tmp_path.glob("plan_tiny-hybrid_*_torch-kernels.json")
    runs = {r["policy"]: r for r in json.loads(path.read_text()) if "tokens_per_s" in r}
    assert set(runs) == {"solved", "megatrain"} and runs["megatrain"]["batch_size"] == 4
    for r in runs.values():
        assert r["kernels"] == {"delta_rule": "torch", "conv": "torch"}
        assert r["layer_types"] == {"linear_attention": 3, "full_attention": 1}
        assert set(r["per_layer_type"]) == set(r["compute_only_layer_ms_by_type"]) == set(r["layer_types"])
        assert sum(t["layers"] for t in r["per_layer_type"].values()) == 4
        assert all(t["predicted_fwd_bwd_ms"] > 0 for t in r["per_layer_type"].values())


def test_plan_bench_records_a_failed_run_and_goes_on(tmp_path, monkeypatch):
    """A run that fails other than out of memory is a record with its error (and plan), and the
    next run still goes: a device call's later runs are not lost to one failure."""
    from bench import plan_bench as module

    timed = module.timed_steps
    calls = []

    def failing_first(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return timed(*args, **kwargs)

    monkeypatch.setattr(module, "timed_steps", failing_first)
    plan_bench(*TINY, "--runs", "solved", "megatrain", "--warmup", "0", "--steps", "1", "--out", str(tmp_path))
    (path,) = tmp_path.glob("plan_tiny_*.json")
    failed, ran = json.loads(path.read_text())[1:]
    assert failed["policy"] == "solved" and "illegal memory access" in failed["error"] and failed["plan"]["layers"]
    assert ran["policy"] == "megatrain" and ran["tokens_per_s"] > 0
    assert "illegal memory access" in next(tmp_path.glob("plan_tiny_*.md")).read_text()


def test_plan_bench_does_not_try_a_plan_the_host_cannot_hold(tmp_path, monkeypatch):
    """A plan whose host memory the simulator finds short is recorded as not started, not run
    (pinned buffers past the RAM can take the machine down)."""
    import dataclasses

    from bench import plan_bench as module

    simulate = module.simulate

    def host_short_megatrain(plan, table, **kwargs):
        result = simulate(plan, table, **kwargs)
        if plan.policy == "megatrain":
            result = dataclasses.replace(result, violations=["host memory: plan needs 45.36 GiB, 10.07 GiB available"])
        return result

    monkeypatch.setattr(module, "simulate", host_short_megatrain)
    plan_bench(*TINY, "--runs", "solved", "megatrain", "--warmup", "0", "--steps", "1", "--out", str(tmp_path))
    (path,) = tmp_path.glob("plan_tiny_*.json")
    ran, skipped = json.loads(path.read_text())[1:]
    assert ran["policy"] == "solved" and ran["tokens_per_s"] > 0
    assert skipped["policy"] == "megatrain" and "tokens_per_s" not in skipped
    assert skipped["not_started"] == "does not fit: host memory: plan needs 45.36 GiB, 10.07 GiB available"


def test_merge_results_keeps_every_record_once(tmp_path):
    from bench.merge_results import merge

    for i in (1, 2):  # (the second file: two records of one name, as optim_bench writes them)
        (tmp_path / f"study_s{i}.json").write_text(json.dumps([{"name": f"run{i}", "seed": s} for s in range(i)]))
    records = merge(tmp_path / "study", sorted(tmp_path.glob("study_s*.json")))
    assert [(r["name"], r["seed"], r["report"]) for r in records] == [
        ("run1", 0, "study_s1"), ("run2", 0, "study_s2"), ("run2", 1, "study_s2")]
    assert [p.name for p in tmp_path.iterdir()] == ["study.json"]
    (tmp_path / "study_s2.json").write_text(json.dumps([{"name": "run2", "seed": 1}]))
    assert len(merge(tmp_path / "study", [tmp_path / "study_s2.json"])) == 3  # already there: not again


def test_kernel_check_on_the_cpu_measures_the_bf16_null(tmp_path):
    from bench import kernel_check

    status = kernel_check.main(["--shape", "tiny-hybrid", "--batch", "1", "--seq", "96", "--repeats", "1",
                                "--out", str(tmp_path)])
    assert status == 0
    (record,) = json.loads(next(tmp_path.glob("kernel_check_tiny-hybrid_*.json")).read_text())
    assert record["passed"] is None and "fla_bf16" not in record["rows"]  # no fla kernel on the CPU
    errors = record["rows"]["torch_bf16"]["errors"]
    # bf16 inputs cost about 2^-8 relative: a null that is zero or large means the check is broken
    assert all(1e-4 < errors[n]["rel_fro"] < 5e-2 for n in ("out", "dq", "dk", "dv", "dg", "dbeta")), errors


@pytest.mark.parametrize("model", ["tiny", "tiny-hybrid"])
def test_packing_bench_on_the_cpu_compares_packed_with_padded(tmp_path, model):
    from bench import packing_bench

    packing_bench.main(["--model", model, "--device", "cpu", "--batch", "2", "--seq", "512", "--samples", "200",
                        "--warmup", "1", "--steps", "2", "--out", str(tmp_path)])
    (path,) = tmp_path.glob(f"packing_{model}_*_s512_b2.json")
    records = json.loads(path.read_text())
    assert [r["batching"] for r in records] == ["padded", "packed"]
    for r in records:
        assert FIELDS <= r.keys(), FIELDS - r.keys()
        assert r["tokens_per_s"] > 0 and 0 < r["fill_ratio"] <= 1 and r["samples_per_s"] > 0
        assert r["tokens_per_s"] == pytest.approx(sum(r["tokens_per_step"]) / sum(r["step_times_s"]))
    assert records[1]["tokens_per_s_vs_padded"] == pytest.approx(records[1]["tokens_per_s"] / records[0]["tokens_per_s"])
    assert all(len(r["host_buffers_gb_by_step"]) == 2 for r in records)  # padded lengths vary: watch the buffers
    assert "pinned host buffers after each measured step" in path.with_suffix(".md").read_text()


def test_packing_bench_reports_a_merged_study_from_its_records(tmp_path):
    """``--report``: the comparison and the heading come from the records (the committed H200
    study, one process per batching), not from the command's defaults (batch 16)."""
    import shutil

    from bench import packing_bench

    study = tmp_path / "packing_study.json"
    shutil.copy(ROOT / "bench/results/packing_qwen2.5-7b_h200_2026-12-03_s1024_b64.json", study)
    packing_bench.main(["--report", str(study)])
    report = study.with_suffix(".md").read_text()
    assert report.startswith("# Packed against padded batches: qwen2.5-7b, seq 1024, batch 64\n")
    packed = next(r for r in json.loads(study.read_text()) if r["batching"] == "packed")
    assert packed["tokens_per_s_vs_padded"] == pytest.approx(9329.7 / 4240.0, rel=1e-4)
    assert "| 2.20x |" in report and "Merged from" in report


def test_packing_bench_re_solves_a_plan_that_runs_out_of_memory(tmp_path, monkeypatch, capsys):
    """As `lazytrain train` does: a solved plan whose step runs out of GPU memory (simulated on
    the CPU, once) is re-solved with less memory for the planner and run again; the next
    batching starts from the plan that ran."""
    from bench import packing_bench
    from lazytrain.runtime.executor import Executor

    real, calls = Executor.forward_backward, []

    def forward_backward(self, *args, **kwargs):
        calls.append(self.plan.batch_size)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.50 MiB (simulated)")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Executor, "forward_backward", forward_backward)
    packing_bench.main(["--model", "tiny", "--device", "cpu", "--batch", "2", "--seq", "256", "--samples", "60",
                        "--warmup", "0", "--steps", "1", "--policy", "solved", "--out", str(tmp_path)])
    (path,) = tmp_path.glob("packing_tiny_*_s256_b2.json")
    padded, packed = json.loads(path.read_text())
    assert padded["oom_replans"] == 1 and len(padded["oom_tries"]) == 1 and packed["oom_replans"] == 0
    (failed,) = padded["oom_tries"]
    assert failed["planner_gpu_budget_gb"] > padded["planner_gpu_budget_gb"]
    # the packed rows are planned within what the padded ones ran with, unless their cheapest plan
    # needs more (the re-solve left 4% less than the padded plan's peak; the profiles' numbers
    # vary with the machine's load): then with their own budget, and the log says so
    if packed["planner_gpu_budget_gb"] != padded["planner_gpu_budget_gb"]:
        assert packed["planner_gpu_budget_gb"] > padded["planner_gpu_budget_gb"]
        assert "no plan within the" in capsys.readouterr().out
    assert padded["tokens_per_s"] > 0 and packed["tokens_per_s"] > 0
    assert "re-solved with less memory" in path.with_suffix(".md").read_text()


def finetune_8bit(*argv: str) -> None:
    from bench.studies import accuracy_finetune_8bit

    accuracy_finetune_8bit.main(["--shape", "tiny", "--device", "cpu", *argv])


@pytest.fixture
def small_study_data(monkeypatch):
    """The fine-tuning study's runs in this process read 64 built-in training samples, not the
    default 20,000, whose tokenizing was ~2 s of each run's ~2.5 (the study has no ``--set``):
    these tests check the study's plumbing, which the data's size does not change."""
    from bench.studies import optim_convergence
    from lazytrain import config

    load_config = config.load_config

    def small(path, overrides):
        return load_config(path, [*overrides, "data.builtin_train_size=64"])

    monkeypatch.setattr(optim_convergence, "load_config", small)  # the study's LazyTrain runs
    monkeypatch.setattr(config, "load_config", small)  # its plain-PyTorch pretraining


def test_accuracy_finetune_8bit_shares_one_pretraining_across_seeds(tmp_path, small_study_data):
    finetune_8bit("--pretrain-steps", "3", "--finetune-steps", "3", "--heldout", "2", "--seeds", "1", "2",
                  "--kinds", "fp32", "hybrid8bit", "--out", str(tmp_path))
    records = [r for p in tmp_path.glob("*.json") for r in json.loads(p.read_text())]
    assert sorted((r["kind"], r["seed"]) for r in records) == [("fp32", 1), ("fp32", 2), ("hybrid8bit", 1), ("hybrid8bit", 2)]
    assert all(r["shared_pretrain"] and r["optimizer"] for r in records)
    assert len({(r["pretrain_exact_match"], r["pretrain_weights_sha256"]) for r in records}) == 1  # one base model
    assert len(records[0]["pretrain_weights_sha256"]) == 64
    assert records[0]["pretrain_weights_sha256"] != hashlib.sha256(b"").hexdigest()  # the weights were read
    assert all(0 <= r["retained_exact_match"] <= 1 for r in records)  # evaluated on the pretraining tier too
    # the base scored on the fine-tuning tier before the fine-tune: one figure per seed, whatever the kind
    assert all(0 <= r["base_exact_match"] <= 1 for r in records)
    assert len({(r["seed"], r["base_exact_match"]) for r in records}) == len({r["seed"] for r in records})


def test_the_fine_tune_report_gives_the_base_score_per_seed():
    """Each seed draws its own held-out problems, so the base scores differ by seed; only the
    kinds of one seed must agree."""
    from bench.studies.accuracy_finetune_8bit import report

    def record(kind, seed, base):
        return {"kind": kind, "seed": seed, "base_exact_match": base, "exact_match": 0.5, "tail_loss": 1.0,
                "loss_every_10_steps": [2.0, 1.0], "date": "d", "device": "cpu", "torch": "t", "model": "m",
                "pretrain_steps": 1, "pretrain_tier": "add2", "pretrain_exact_match": 0.4, "finetune_steps": 1,
                "finetune_tier": "addsub2", "lr": 1e-5, "batch_size": 2, "heldout": 2}

    agree = report([record(k, s, b) for s, b in ((1, 0.25), (2, 0.5)) for k in ("fp32", "hybrid8bit")], "cmd")
    assert "before the fine-tune, by seed: 1: 0.250, 2: 0.500." in agree and "disagree" not in agree
    differ = report([record("fp32", 1, 0.25), record("hybrid8bit", 1, 0.5)], "cmd")
    assert "1: 0.250 / 0.500 (the kinds of a seed disagree" in differ


def test_the_fine_tune_report_compares_a_repeated_run_with_its_first_and_counts_it_once():
    from bench.studies.accuracy_finetune_8bit import report

    def record(kind, tail, curve, seconds=10.0):
        return {"kind": kind, "seed": 1, "exact_match": 0.5, "tail_loss": tail, "loss_every_10_steps": curve,
                "seconds": seconds, "date": "d", "device": "cpu", "torch": "t", "model": "m", "pretrain_steps": 1,
                "pretrain_tier": "add2", "pretrain_exact_match": 0.4, "finetune_steps": 1, "finetune_tier": "addsub2",
                "lr": 1e-5, "batch_size": 2, "heldout": 2}

    text = report([record("fp32", 1.0, [2.0, 1.0]), record("hybrid8bit", 1.01, [2.0, 1.01]),
                   record("fp32", 1.02, [2.02, 1.0], seconds=12.0)], "cmd")
    assert "| hybrid8bit | 1 | 0.5000 | 1.01 | 1.01000 [1.01000, 1.01000] |" in text  # against the first fp32 run
    assert "| fp32 | 1 | 1.02000 | 0.500 | 0.500 / 0.500 | 10 / 12 |" in text  # the repeat: 1.02x, 0.5% along


def test_the_kernel_null_is_fp32_adamw_through_the_8bit_kernel(tmp_path):
    """fp32_kernel (the fine-tuning study's null): every group keeps fp32 states (the run
    checks it), and the losses follow fp32's to rounding. (64 training samples: 5 steps of 32
    read 160; the default 20,000 took ~2 s a run to tokenize.)"""
    from bench.studies.optim_convergence import run

    small = ("data.heldout_size=2", "data.builtin_train_size=64")
    fp32 = run("fp32", 5, tmp_path / "a", seed=1, overrides=small)
    null = run("fp32_kernel", 5, tmp_path / "b", seed=1, overrides=small)
    assert null["losses"] == pytest.approx(fp32["losses"], rel=1e-5)


def test_an_out_of_memory_record_keeps_the_stages_that_finished():
    from bench.common import oom_record

    error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.79 GiB.\nmore")
    error.stage_memory = [("embed", 2 * 10**9), ("fwd 0", 3 * 10**9)]
    record = oom_record("run", {"model": "m"}, "solved", 64, 1024, error)
    assert record["oom"] == "CUDA out of memory. Tried to allocate 3.79 GiB."
    assert record["stage_memory_gb"] == [["embed", 2.0], ["fwd 0", 3.0]] and record["oom_after_stage"] == "fwd 0"
    assert "stage_memory_gb" not in oom_record("run", {}, "solved", 64, 1024, torch.OutOfMemoryError("x"))


class _Held:
    """Stands for what a failed step holds (an executor with its GPU slots and activations)."""


def _failing_step(held: list) -> None:
    state = _Held()  # a local of the failed frame, as the executor is in forward_backward's
    held.append(weakref.ref(state))
    state.cycle = state  # executors are in reference cycles: only the collector frees them
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.61 GiB.")


def test_an_out_of_memory_record_lets_go_of_the_failed_try():
    """A largest-batch search steps down after an out-of-memory: the failed try's memory must be
    free by then. Its frames live on in the exception's traceback while the handler runs, so
    the 9B search on the H200 failed at every batch from 231 down to 111 with ~138 GB held."""
    from bench.common import oom_record

    held = []
    try:
        _failing_step(held)
    except torch.OutOfMemoryError as error:
        oom_record("run", {}, "solved", 231, 1024, error)
        assert held[0]() is None  # gone while the handler (the search) still runs


class _Holder:
    pass


def test_live_tensors_names_what_still_holds_the_largest_tensors():
    """After a failed try, `oom_record` lists the largest device tensors still referred to and
    their holders' types (the H200's retries started ~5 GB above their first try)."""
    from bench.common import live_tensors

    holder = _Holder()
    holder.big = torch.empty(3_000_000, dtype=torch.bfloat16)  # 6 MB, larger than anything the suite keeps
    small = torch.empty(10)
    rows = live_tensors("cpu", top=3)
    assert rows[0][:3] == [[3_000_000], "bfloat16", 0.006]
    assert {"_Holder", "dict"} & set(rows[0][3]), rows[0]  # the owner or its __dict__, by Python version
    assert all(row[2] >= small.numel() * 4 / 1e9 for row in rows)
    del holder
    assert all(row[0] != [3_000_000] for row in live_tensors("cpu", top=3))
    # a fake tensor alive (torch.compile's, left to the garbage collector by an earlier test:
    # once made this test fail on its data pointer) is not counted
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.empty(4_000_000)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # reading a fake tensor's data pointer warns, or raises
        assert all(row[0] != [4_000_000] for row in live_tensors("cpu", top=3))
    del fake


def test_oom_sites_sum_the_allocators_live_blocks_per_site_and_stream():
    """`live_blocks_by_site` on a snapshot shaped as ``torch.cuda.memory._snapshot()``'s: live
    blocks summed by the innermost project frame and stream, free blocks left out, the tail
    folded into one row; `oom_record` takes what the observer left, once."""
    from bench import common

    def block(size, state, *files):
        return {"size": size, "state": state,
                "frames": [{"filename": f, "line": n, "name": f"f{n}"} for n, f in enumerate(files)]}

    torch_file, ours = "/x/torch/nn/functional.py", "/x/src/lazytrain/runtime/update.py"
    snapshot = {"segments": [
        {"stream": 0, "blocks": [block(2e9, "active_allocated", torch_file, ours),
                                 block(1e9, "active_allocated", ours),
                                 block(5e9, "inactive", ours)]},
        {"stream": 7, "blocks": [block(3e9, "active_pending_free", "/x/transformers/models/m.py"),
                                 block(4e9, "active_allocated")]}]}
    rows = common.live_blocks_by_site(snapshot)
    assert [(r["site"], r["stream"], r["gb"], r["blocks"]) for r in rows] == [
        ("?", 7, 4.0, 1), ("models/m.py:0 f0", 7, 3.0, 1), ("runtime/update.py:1 f1", 0, 2.0, 1),
        ("runtime/update.py:0 f0", 0, 1.0, 1)]
    folded = common.live_blocks_by_site(snapshot, top=1)
    assert folded[-1] == {"site": "3 more sites", "stream": None, "gb": 6.0, "blocks": 3}
    common._OOM_SITES[:] = [{"request_gb": 4.0, "sites": rows}]
    record = common.oom_record("r", {}, "solved", 8, 16, torch.OutOfMemoryError("CUDA out of memory."))
    assert record["oom_live"]["sites"] == rows and not common._OOM_SITES
    assert "oom_live" not in common.oom_record("r", {}, "solved", 8, 16, torch.OutOfMemoryError("again"))


def test_accuracy_finetune_8bit_jobs_fine_tune_in_processes_of_their_own(tmp_path, capsys):
    """``--jobs``: the pretraining and each fine-tune in a process of its own (``python -m
    bench.studies...``); ``--runs KIND:SEED`` completes a study across calls: exactly those
    fine-tunes, from the kept pretraining of ``--pretrain-seed``; a kept pretraining of another
    seed is refused."""
    base = tmp_path / "base"
    common = ["--pretrain-steps", "2", "--finetune-steps", "2", "--heldout", "1", "--pretrained", str(base)]
    # the three fine-tunes at once (mostly imports: one core's work each); run_jobs' queue is
    # test_accuracy_finetune_8bit_jobs_stop_at_the_time_limit's
    finetune_8bit(*common, "--pretrain-seed", "1", "--runs", "fp32:1", "hybrid8bit:4", "fp32:2", "--jobs", "3",
                  "--out", str(tmp_path / "a"))
    # one record file, one report and one archive of the per-run files and logs; nothing else
    (path,) = (tmp_path / "a").glob("finetune_8bit_tiny_*.json")
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == sorted(
        [path.name, path.with_suffix(".md").name, f"{path.stem}_runs.tgz"])
    with tarfile.open(tmp_path / "a" / f"{path.stem}_runs.tgz") as tar:
        names = {Path(n).name for n in tar.getnames()}
    assert {"pretrain.log", "fp32_s1.log", "hybrid8bit_s4.log", "fp32_s2.log"} <= names
    records = json.loads(path.read_text())
    assert sorted((r["kind"], r["seed"]) for r in records) == [("fp32", 1), ("fp32", 2), ("hybrid8bit", 4)]
    assert {r["pretrain_seed"] for r in records} == {1}
    assert len({(r["pretrain_seed"], r["pretrain_exact_match"]) for r in records}) == 1  # one base model
    fp32 = {r["seed"]: r for r in records if r["kind"] == "fp32"}
    assert fp32[1]["loss_every_10_steps"] != fp32[2]["loss_every_10_steps"]  # each process its own seed
    assert all(r["cpu_threads"] == max(1, len(os.sched_getaffinity(0)) // 3) for r in records)
    assert "--runs fp32:1 hybrid8bit:4 fp32:2" in path.with_suffix(".md").read_text()

    finetune_8bit(*common, "--pretrain-seed", "2", "--runs", "fp32:3", "--jobs", "1", "--out", str(tmp_path / "b"))
    (log,) = (tmp_path / "b").glob("*_runs.tgz")
    with tarfile.open(log) as tar:
        text = "".join(tar.extractfile(m).read().decode() for m in tar.getmembers() if m.name.endswith("fp32_s3.log"))
    assert "pretrained with seed 1, this study asks for --pretrain-seed 2" in text, capsys.readouterr().out
    with pytest.raises(SystemExit) as bad:
        finetune_8bit(*common, "--runs", "adam:1", "--jobs", "1")
    assert bad.value.code == 2 and "give KIND:SEED" in capsys.readouterr().err


def test_accuracy_finetune_8bit_jobs_stop_at_the_time_limit(tmp_path):
    from bench.studies.accuracy_finetune_8bit import Job, run_jobs

    def sleeper(name, kind, seconds=0.0, code=0):
        return Job(name, kind, [sys.executable, "-c", f"import sys, time; time.sleep({seconds}); sys.exit({code})"], 1)

    jobs = [sleeper("bad", "x", code=3), sleeper("quick", "k", 1.5), sleeper("long", "other", 60),
            sleeper("again", "k"), sleeper("late", "new")]
    outcome = run_jobs(jobs, 2, tmp_path, time.monotonic() + 3.0)
    assert outcome["bad"].startswith("failed (exit 3") and outcome["quick"].startswith("finished")
    # "long" starts when "bad" fails; when "quick" ends under 1.5 s is left, and it took 1.5 s: "again"
    # (its kind) and "late" (a kind not seen finishing) are not started; "long" is stopped
    assert outcome["again"].startswith("not started") and outcome["late"].startswith("not started")
    assert outcome["long"] == "stopped at the time limit"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.log", "long.log", "quick.log"]
    # a kind expected (from an earlier study) to take longer than is left is not started at all
    outcome = run_jobs([sleeper("slow", "k"), sleeper("fits", "j")], 2, tmp_path, time.monotonic() + 3.0,
                       expected={"k": 60.0, "j": 0.1})
    assert outcome["slow"].startswith("not started") and outcome["fits"].startswith("finished")


def test_embed_grad_cost_on_the_cpu_times_both_sums_against_a_step(tmp_path):
    import torch

    from lazytrain.runtime.device import device_name

    step = tmp_path / "steps.json"
    step.write_text(json.dumps([{"name": "tiny_solved", "date": "2026-01-01", "device": device_name(torch.device("cpu")),
                                 "policy": "solved", "batch_size": 4, "seq_len": 256, "step_time_s": 0.5}]))
    from bench.studies import embed_grad_cost

    embed_grad_cost.main(["--model", "tiny", "--batch", "4", "--seq", "256", "--device", "cpu", "--warmup", "1",
                          "--repeats", "3", "--step-record", str(step), "--out", str(tmp_path)])
    (path,) = tmp_path.glob("embed_grad_cost_tiny_*.json")
    (record,) = json.loads(path.read_text())
    assert record["autograd_bf16_ms"] > 0 and record["fp32_sum_ms"] > 0 and record["reference_name"] == "tiny_solved"
    assert record["fraction_of_step"] == pytest.approx((record["fp32_sum_ms"] - record["autograd_bf16_ms"]) / 500)
    # ~4 ids a row: summing in bf16 lands further from the exact sum than rounding it once does
    assert 0 < record["fp32_sum_rel_error"] < record["autograd_bf16_rel_error"] < 2**-6
    assert path.with_suffix(".md").exists()


def test_embed_grad_cost_compares_with_the_newest_uncapped_h200_step():
    from bench.studies.embed_grad_cost import step_time_reference

    path, record = step_time_reference("qwen2.5-7b", 64, 1024, "NVIDIA H200")
    others = [r for p in path.parent.glob("plan_qwen2.5-7b_*.json") for r in json.loads(p.read_text())
              if r.get("policy") == "solved" and r.get("batch_size") == 64 and r.get("seq_len") == 1024
              and r.get("device") == "NVIDIA H200" and not r.get("gpu_mem_cap_gb") and r.get("step_time_s")]
    assert record in others and record["date"] == max(r["date"] for r in others)
    assert record["step_time_s"] == min(r["step_time_s"] for r in others if r["date"] == record["date"])


@dataclasses.dataclass
class _Costs:
    """What `plan_bench.tries` reads of a cost table."""

    gpu_bytes: int

    def at(self, batch: int, seq: int) -> _Costs:
        return self


def _tries(policy: str, fits_within: float, needs_more: float, walk_down: bool = True):
    """`plan_bench.tries` from batch 200 on a 142 GB budget, where a plan runs when its budget
    is at most ``fits_within`` GB and otherwise fails with ``needs_more`` GB above it."""
    from bench.plan_bench import tries

    ran = []

    def run_at(table, plan, replans):
        ran.append((plan, round(table.gpu_bytes / 1e9, 2), replans))
        if table.gpu_bytes <= fits_within * 1e9:
            return None
        return {"predicted_peak_gpu_gb": table.gpu_bytes / 1e9, "seen_peak_gpu_gb": table.gpu_bytes / 1e9 + needs_more}

    def plan_at(table):
        return len(ran)  # stands for the plan solved for this table

    return tries(policy, 200, _Costs(142 * 10**9), 1024, plan_at, run_at, walk_down), ran


def test_a_largest_batch_try_re_solves_a_solved_plan_with_less_memory_before_walking_down():
    """The 9B torch-reference search of 2026-12-02 stepped the batch down from 206 to 151 and
    failed in the same stage every time (each smaller batch's solved plan filled the card
    again); the trainer instead re-solves the same batch with less GPU memory."""
    from bench.plan_bench import MAX_TRIES
    from lazytrain.plan.search import MAX_OOM_REPLANS, gpu_budget_after_oom

    batch, ran = _tries("solved", fits_within=133, needs_more=9)
    lowered = gpu_budget_after_oom(142 * 10**9, 142 * 10**9, 151 * 10**9)  # the excess + 1 GiB
    assert batch == 200 and ran == [(0, 142.0, 0), (1, round(lowered / 1e9, 2), 1)]
    # a policy the planner does not solve walks down at once, MAX_TRIES runs in all
    batch, ran = _tries("megatrain", fits_within=100, needs_more=9)
    assert batch == 0 and [r[1] for r in ran] == [142.0] * MAX_TRIES
    # a solved plan that never fits: MAX_OOM_REPLANS re-solves, then the next batch from the
    # last budget a plan was solved for (the excess belongs to the planner, not the batch)
    batch, ran = _tries("solved", fits_within=10, needs_more=1)
    assert batch == 0 and len(ran) == MAX_TRIES
    assert [r[2] for r in ran[: MAX_OOM_REPLANS + 2]] == [*range(MAX_OOM_REPLANS + 1), 0]
    assert ran[MAX_OOM_REPLANS + 1][1] == ran[MAX_OOM_REPLANS][1] < 142.0
    # without walk_down (a run at its own batch): the re-solves, then no smaller batch
    batch, ran = _tries("solved", fits_within=10, needs_more=1, walk_down=False)
    assert batch == 0 and [r[2] for r in ran] == list(range(MAX_OOM_REPLANS + 1))
    assert _tries("megatrain", fits_within=10, needs_more=1, walk_down=False) == (0, [(0, 142.0, 0)])


def test_accuracy_finetune_8bit_pretrains_through_plain_pytorch(tmp_path, small_study_data):
    """--pretrain-runner torch: the base is trained by the HF model + torch AdamW on the device
    and saved as a folder LazyTrain fine-tunes from (the same weights the records' digest names)."""
    finetune_8bit("--pretrain-steps", "3", "--finetune-steps", "2", "--heldout", "2", "--seeds", "1", "--kinds", "fp32",
                  "--pretrain-runner", "torch", "--pretrained", str(tmp_path / "base"), "--out", str(tmp_path))
    from bench.studies.accuracy_finetune_8bit import weights_digest

    (record,) = json.loads(next(tmp_path.glob("finetune_8bit_tiny_*.json")).read_text())
    assert record["pretrain_runner"] == "torch"
    assert record["pretrain_weights_sha256"] == weights_digest(tmp_path / "base" / "pretrained")
    assert (tmp_path / "base" / "pretrained" / "lazytrain_template.json").exists()
    assert len(record["loss_every_10_steps"]) == 1 and 0 <= record["retained_exact_match"] <= 1


def test_accuracy_reference_trains_each_kind_on_the_cpu(tmp_path):
    """The references of the accuracy study (HF model + torch AdamW + clip_grad_norm_) and
    LazyTrain, a few steps each: one record per kind, the same first loss (same init, same
    batch, fp32 on the CPU). ``--set`` reaches every kind's data: 64 training samples for all
    (the default 20,000 took ~2 s a kind to tokenize)."""
    from bench.studies import accuracy_reference

    accuracy_reference.main(["--kinds", "lazytrain", "torch_fp32", "torch_bf16_master", "--steps", "3", "--heldout",
                             "2", "--tail", "2", "--device", "cpu", "--set", "data.builtin_train_size=64",
                             "--out", str(tmp_path)])
    records = [r for p in tmp_path.glob("accuracy_reference*.json") for r in json.loads(p.read_text())]
    by_kind = {r["kind"]: r for r in records}
    assert set(by_kind) == {"lazytrain", "torch_fp32", "torch_bf16_master"}
    assert all(0 <= r["exact_match"] <= 1 and r["skipped_steps"] == 0 for r in records)
    first = {k: r["loss_every_10_steps"][0] for k, r in by_kind.items()}
    assert first["torch_fp32"] == pytest.approx(first["lazytrain"], rel=1e-5)
    assert first["torch_bf16_master"] == pytest.approx(first["lazytrain"], rel=2e-2)


def test_layer_breakdown_on_the_cpu_splits_the_layers_time(tmp_path):
    """One tiny layer's forward + backward, with lean ops (their elementwise parts compiled) and
    HF's modules: records and a report with the operators' time by category, the matmuls among
    them."""
    from bench.studies import layer_breakdown

    layer_breakdown.main(["--model", "tiny", "--batch", "2", "--seq", "64", "--device", "cpu", "--variants",
                          "lean-compiled", "hf", "--out", str(tmp_path)])
    (path,) = tmp_path.glob("layer_breakdown_tiny_*.json")
    records = json.loads(path.read_text())
    assert [(r["lean_ops"], r["fused_ops"]) for r in records] == [(True, "compiled"), (False, "eager")]
    for r in records:
        assert r["kernel_ms"]["matmul"] > 0 and r["layer_params"] > 0
        assert r["top_kernels_ms"] and all(ms > 0 for _, ms in r["top_kernels_ms"])
    assert "| lean ops, compiled elementwise |" in path.with_suffix(".md").read_text()


def test_plan_bench_times_a_plan_with_the_update_skipped(tiny_study):
    """``--update cpu skipped``: each run twice; the skipped one is planned and predicted as if the
    update cost nothing (the 'free CPU update' row of bench/studies/ceiling_bound.py)."""
    from lazytrain.plan.costs import CostTable
    from lazytrain.plan.plan import Plan
    from lazytrain.plan.simulate import simulate

    (path,) = tiny_study.glob("plan_tiny_*.json")
    records = json.loads(path.read_text())
    costs = CostTable.from_dict(next(r["costs"] for r in records if r["name"] == "costs"))
    runs = [r for r in records if "tokens_per_s" in r and r["name"].startswith("tiny_solved_b2_s32_")
            and r["name"].endswith("_ow1") and "_host" not in r["name"]]
    assert [(r["update"], "_update-skipped" in r["name"]) for r in runs] == [("cpu", False), ("skipped", True)]
    assert costs.optimizer_ns_per_param > 0
    # the skipped run stepped SkippedUpdate, not the session's optimizer
    assert runs[1]["cpu_optimizer_s"] < 0.2 * runs[0]["cpu_optimizer_s"]
    for r in runs:
        table = costs if r["update"] == "cpu" else dataclasses.replace(costs, optimizer_ns_per_param=0.0)
        predicted = simulate(Plan.from_dict(r["plan"]), table, optimizer_overlap=True).step_time_s
        assert r["predicted_step_time_s"] == pytest.approx(predicted, rel=1e-9)
    assert "--update cpu skipped" in path.with_suffix(".md").read_text()


def test_a_skipped_update_leaves_the_weights_and_the_real_one_changes_them():
    from bench.common import SkippedUpdate, bench_session, timed_steps
    from lazytrain.plan.plan import keep_all_plan

    session = bench_session("tiny", device="cpu", batch=2, seq=16)
    plan = keep_all_plan(session.adapter.num_layers, 2, 16, 4096)
    before = [w.clone() for w in session.store.weights]
    skipped = SkippedUpdate(session.optimizer)
    timed_steps(session, plan, warmup=0, steps=2, optimizer=skipped)
    assert all(torch.equal(a, b) for a, b in zip(before, session.store.weights))
    assert skipped.steps == [2] * len(before)
    with pytest.raises(RuntimeError, match="no state to save"):
        skipped.state_dict()
    timed_steps(session, plan, warmup=0, steps=2)
    assert not all(torch.equal(a, b) for a, b in zip(before, session.store.weights))


def test_optim_bench_records_one_row_per_thread_count_with_the_host_copy_bandwidth(tmp_path):
    from bench import optim_bench

    threads = torch.get_num_threads()
    try:
        optim_bench.main(["--numel", "262144", "--threads", "1", "2", "--steps", "1", "--warmup", "0", "--kernel",
                          "torch", "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)  # the bench sets each count in turn
    (path,) = tmp_path.glob("optim_*.json")
    records = json.loads(path.read_text())
    assert [r["threads"] for r in records] == [1, 2]
    assert all(r["host_copy_gbps"] > 0 and r["ns_per_param_8bit"] > 0 for r in records)
    assert "host copy GB/s" in path.with_suffix(".md").read_text()


def test_device_layers_search_times_the_search_with_and_without_the_tolerance(tmp_path):
    from bench.studies import device_layers_search

    device_layers_search.main(["--layers", "8", "--tolerances", "0", "0.005", "--update-ns-per-param", "0.2", "0.4",
                               "--costs", str(ROOT / device_layers_search.DEFAULT_COSTS), "--out", str(tmp_path)])
    (path,) = tmp_path.glob("device_layers_search_*.json")
    records = json.loads(path.read_text())
    assert [(r["optimizer_ns_per_param"], r["tolerance"]) for r in records] == [(0.2, 0.0), (0.2, 0.005), (0.4, 0.0),
                                                                                 (0.4, 0.005)]
    for exact, tolerant in (records[:2], records[2:]):
        assert exact["num_layers"] == 8
        for r in (exact, tolerant):
            assert r["solve_time_s"] > 0 and r["solves"] == len(r["tried"]) + 1
            assert r["predicted_step_time_s"] == pytest.approx(min(v for v in r["tried"].values() if v is not None))
        assert set(tolerant["tried"]) <= set(exact["tried"])  # the tolerance only leaves out
    # a slower update: no plan predicted faster than the faster update's
    assert records[2]["predicted_step_time_s"] >= records[0]["predicted_step_time_s"] * (1 - 1e-9)
    rows = [line for line in path.with_suffix(".md").read_text().splitlines() if line.startswith("| 8 |")]
    assert [row.split(" | ")[1:3] for row in rows] == [["0.2", "0"], ["0.2", "0.005"], ["0.4", "0"], ["0.4", "0.005"]]


def test_compute_only_puts_each_run_against_its_own_layers_and_its_process_s_head(tmp_path):
    from bench.studies import compute_only

    def run(name, layers_s, steps, **extra):
        return {"name": name, "date": "2026-12-05", "device": "H200", "step_time_s": sorted(steps)[len(steps) // 2],
                "step_times_s": steps, "compute_only_layers_s": layers_s, "predicted_step_time_s": 5.3,
                "gpu_compute_s": 5.0, "predicted_gpu_compute_s": 5.1, "gpu_idle_other_s": 0.1, "tflops_6nt": 500.0,
                "tokens_per_s": 1.0, "plan": {"device_layers": 4, "device_steps": 0}, **extra}

    records = [{"name": "costs", "costs": {"head_ms": 500.0}},
               run("a", 4.5, [5.6, 5.4, 5.5], cpu_update_s=1.5, cpu_update_params=5 * 10**9,
                   recalibration={"measured_ns_per_param": 0.28, "changed": True}),
               {"name": "oom", "out_of_memory": "..."},
               {"name": "costs", "costs": {"head_ms": 250.0}},
               run("b", 4.75, [5.2, 5.3, 5.4], update="skipped"),
               # rounds: the rate the measured plan was solved for is the last re-solving round's planned one
               run("c", 4.75, [5.2], recalibration={"measured_ns_per_param": 0.28, "changed": True, "rounds": [
                   {"measured_ns_per_param": 0.28, "planned_ns_per_param": 0.28, "predicted_resolved_s": 5.0},
                   {"measured_ns_per_param": 0.25, "planned_ns_per_param": 0.30, "predicted_resolved_s": 5.0},
                   {"measured_ns_per_param": 0.2, "planned_ns_per_param": 0.30}]})]
    a, b, c = compute_only.rows(records)
    assert c["recalibrated_ns_per_param"] == 0.30 and a["recalibrated_ns_per_param"] == 0.28
    assert (a["process"], b["process"]) == (1, 2)
    assert a["compute_only_s"] == pytest.approx(5.0) and a["step_over_compute_only"] == pytest.approx(1.1)
    assert a["first_step_over_compute_only"] == pytest.approx(1.12)
    assert a["range_over_compute_only"] == pytest.approx([1.08, 1.12])
    assert a["update_ns_per_param_in_step"] == pytest.approx(0.3) and a["replanned"] is True
    assert b["compute_only_s"] == pytest.approx(5.0) and b["update"] == "skipped" and b["cpu_update_s"] is None
    report = compute_only.markdown([a, b], "x.json")
    assert "**1.100x** (1.080-1.120)" in report and "| 0.10 | - | 500.0 |" in report  # b: no update to show
    with pytest.raises(ValueError, match="no costs record"):
        compute_only.rows(records[1:2])
    path = tmp_path / "plan_x.json"
    path.write_text(json.dumps(records))
    compute_only.main([str(path), "--out", str(tmp_path)])
    assert len(json.loads((tmp_path / "plan_x_compute_only.json").read_text())) == 3


def test_a_recalibration_round_that_runs_out_of_memory_leaves_its_own_plan_to_the_record(monkeypatch):
    """`plan_bench.recalibrated`: the plan a round switched to is the one the next round's steps
    run, and what an out-of-memory there is recorded against (``running``)."""
    from types import SimpleNamespace

    from bench import plan_bench
    from lazytrain.plan.costs import CostTable
    from lazytrain.plan.plan import megatrain_plan
    from lazytrain.plan.policies import UPDATE_RATE_MARGIN, PolicyOptions, Recalibration

    table = CostTable.load(ROOT / "bench/results/costs_qwen2.5-7b_h200_2026-12-05_s1024_b64_mlp2.json")
    first, second = (megatrain_plan(table.num_layers, 64, 1024, every=e) for e in (2, 4))
    ran = []

    def timed_steps(session, plan, **kwargs):
        ran.append(plan)
        if len(ran) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return {"update_out_of_memory": None, "cpu_update_s_by_step": [2.0, 1.0, 1.5], "cpu_update_params": 10**9,
                "step_time_s": 5.0}

    def recalibrate(plan, costs, planned, options):
        return Recalibration(costs=dataclasses.replace(costs, optimizer_ns_per_param=planned), plan=second,
                             changed=True, current_s=6.0, resolved_s=5.0)

    monkeypatch.setattr(plan_bench, "timed_steps", timed_steps)
    monkeypatch.setattr(plan_bench, "recalibrate", recalibrate)
    running = {}
    args = SimpleNamespace(recalibrate=3, time_limit=0, warmup=1, steps=5, fetch_allocation="compute")
    with pytest.raises(torch.OutOfMemoryError):
        plan_bench.recalibrated(None, table, first, PolicyOptions(), args, running)
    assert ran == [first, second] and running["plan"] is second and not running.get("finished")
    (done,) = running["rounds"]
    assert done["changed"] and done["measured_ns_per_param"] == pytest.approx(1.5)  # the slowest after the first
    assert running["table"].optimizer_ns_per_param == pytest.approx(1.5 * (1 + UPDATE_RATE_MARGIN))


def test_offload_window_simulates_each_measured_plan_and_its_host_layers_variants(tmp_path):
    from bench.studies import offload_window
    from lazytrain.plan.plan import LayerPlan, Plan
    from lazytrain.plan.simulate import simulate
    from lazytrain.plan.synthetic import random_cost_table

    table = random_cost_table(3, 4, uniform=True)
    options = sorted(table.layers[0].recompute_options)
    layers = [LayerPlan(mode="keep", tier=t, recompute=r)
              for t, r in (("host", options[0]), ("gpu", "none"), ("host", "none"), ("gpu", "none"))]
    plan = Plan(policy="solved", batch_size=table.batch_size, seq_len=table.seq_len, layers=layers)
    planned = table.optimizer_ns_per_param * 2
    records = [{"name": "costs", "costs": table.to_dict()},
               {"name": "run", "plan": plan.to_dict(), "step_time_s": 1.0, "update": "cpu",
                "recalibration": {"rounds": [{"planned_ns_per_param": planned, "predicted_resolved_s": 1.0}]}},
               {"name": "skipped", "plan": plan.to_dict(), "step_time_s": 1.0, "update": "skipped"},
               {"name": "not started", "error": "no room"}]
    path = tmp_path / "plan_x.json"
    path.write_text(json.dumps(records))
    offload_window.main([str(path), "--windows", "1", "3", "--solve", "2"])
    rows = json.loads((tmp_path / "plan_x_offload_window.json").read_text())
    assert [r["variant"] for r in rows] == ["as run", "host layers: none", *(f"host layers: {o}" for o in options),
                                            "solved at W = 2"]
    solved = rows.pop()
    assert set(solved["windows"]) == {"2"} and solved["milp"]["status"] in ("optimal", "time limit")
    assert {r["name"] for r in rows} == {"run"} and all(set(r["windows"]) == {"1", "2", "3"} for r in rows)
    # each on the table at the rate its plan was solved for
    at_rate = dataclasses.replace(table, optimizer_ns_per_param=planned)
    assert rows[0]["windows"]["1"]["step_s"] == pytest.approx(simulate(plan, at_rate, optimizer_overlap=True).step_time_s)
    assert rows[1]["layers"] == "H.G.H.G." and rows[0]["layers"] == f"H{offload_window.SHORT[options[0]]}G.H.G."
    assert (tmp_path / "plan_x_offload_window.md").read_text().count("| run |") == 2 + len(rows)  # and the header
    with pytest.raises(SystemExit):
        offload_window.main([str(path), "--windows", "0"])


def test_plan_bench_refuses_a_missing_cost_table_before_building_the_model(tmp_path):
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "bench.plan_bench", "--model", "qwen2.5-7b", "--device", "cpu",
                           "--costs", str(tmp_path / "nowhere.json"), "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2 and "there is no file" in done.stderr and "nowhere.json" in done.stderr
    assert "model qwen2.5-7b" not in done.stdout and time.perf_counter() - t0 < 60  # no 7B model built


def test_plan_bench_runs_the_solved_plan_once_per_offload_window(tiny_study):
    from lazytrain.plan.plan import Plan

    runs = {r["name"]: r for r in runs_of(tiny_study) if r["update"] == "cpu" and "_host" not in r["name"]}
    assert sorted(runs) == ["tiny_megatrain_b2_s32", "tiny_solved_b2_s32_ow1", "tiny_solved_b2_s32_ow2"]
    assert [Plan.from_dict(runs[f"tiny_solved_b2_s32_ow{w}"]["plan"]).offload_window for w in (1, 2)] == [1, 2]
    assert Plan.from_dict(runs["tiny_megatrain_b2_s32"]["plan"]).offload_window == 1


def test_device_step_times_each_piece_size_and_writes_records(tmp_path, monkeypatch):
    """bench/studies/device_step.py on the CPU (the step's pieces eager): a record per group and piece
    size, the pieces counted, the report written."""
    from bench.studies import device_step
    from lazytrain.optim import hybrid8bit

    monkeypatch.setattr(hybrid8bit.PIECE_8BIT, "fn", hybrid8bit._device_piece)
    records = device_step.main(["--model", "tiny", "--groups", "layer", "--chunks", "10", "20", "--repeats", "1",
                                "--device", "cpu", "--out", str(tmp_path)])
    numel = device_step.group_sizes("tiny")["layer"]
    assert [(r["chunk"], r["pieces"]) for r in records] == [(1024, -(-numel // 1024)), (1 << 20, 1)]
    assert all(r["numel"] == numel and r["host_ms"] > 0 and r["model"] == "tiny" for r in records)
    stem = next(tmp_path.glob("device_step_tiny_*.json")).stem
    assert "| layer | " in (tmp_path / f"{stem}.md").read_text()
    with pytest.raises(SystemExit, match="at least 9"):
        device_step.main(["--model", "tiny", "--chunks", "8", "--device", "cpu", "--out", str(tmp_path)])
    # the 4-bit step, its piece eagerly: said in the records and the report, and no run after
    # this one in the process finds the piece set to eager
    from lazytrain.optim import hybrid4bit

    before = hybrid4bit.PIECE_4BIT.fn
    four = device_step.main(["--model", "tiny", "--groups", "layer", "--chunks", "20", "--repeats", "1", "--bits", "4",
                             "--eager", "--device", "cpu", "--out", str(tmp_path)])
    assert [(r["bits"], r["eager"], r["ran_eagerly"], r["pieces"]) for r in four] == [(4, True, True, 1)]
    assert hybrid4bit.PIECE_4BIT.fn is before
    assert "4-bit states" in next(tmp_path.glob("device_step_tiny_4bit_*.md")).read_text()


def test_plan_bench_reports_a_mixture_of_experts_by_its_active_parameters(tmp_path):
    """A mixture of experts' report gives 6 N_active T (``tflops_active``), not 6NT by all its
    parameters (the 30B-A3B's first report showed 1,303 "TFLOPS" for 143)."""
    plan_bench(*TINY, "--model", "tiny-moe", "--runs", "solved", "--warmup", "0", "--steps", "1",
               "--out", str(tmp_path))
    (path,) = tmp_path.glob("plan_tiny-moe_*.json")
    (run,) = [r for r in json.loads(path.read_text()) if "tokens_per_s" in r]
    assert 0 < run["tflops_active"] < run["tflops_6nt"]
    report = path.with_suffix(".md").read_text()
    assert "| TFLOPS 6 N_active T |" in report and f"| {run['tokens_per_s']:.0f} | {run['tflops_active']:.1f} |" in report


@pytest.mark.parametrize("gradients", [["gpu"], ["host", "auto"], ["placed"]])
def test_plan_bench_places_gradients_as_asked(tmp_path, gradients):
    """``--gradients gpu``: host buffers for the embedding and head only, and every plan (the
    solved one and megatrain) holds each decoder layer's gradient on the GPU; ``host auto``: every
    buffer allocated, each run once per value (the A/B in one process): with ``host`` every
    gradient on the host, with ``auto`` megatrain's on the host and the solved plan's where it
    puts them; ``placed``: the trainer's auto, the first (solved) plan's held layers get no host
    buffer and megatrain after it holds them too (tiny-hybrid's 4 layers with the flagship's bf16
    master, in a budget that only holding some of them fits, so some are held). Each record says
    which."""
    if gradients == ["placed"]:
        plan_bench(*TINY, "--model", "tiny-hybrid", "--dtype", "bf16", "--master", "bf16", "--host-limit-gb", "0.0048",
                   "--runs", "solved", "megatrain",
                   "--gradients", "placed", "--warmup", "0", "--steps", "1", "--out", str(tmp_path))
        (path,) = tmp_path.glob("plan_tiny-hybrid_*.json")
        solved, megatrain = [r for r in json.loads(path.read_text()) if "tokens_per_s" in r]
        held = [i for i, lp in enumerate(solved["plan"]["layers"]) if lp["grad"] == "gpu"]
        assert held, "the solved plan held no gradient on the GPU where the host has no room for them all"
        assert solved["held_grad_layers"] == megatrain["held_grad_layers"] == held
        assert [lp["grad"] for lp in megatrain["plan"]["layers"]] == ["gpu" if i in held else "host" for i in range(4)]
        assert solved["host_budget_gb"]["fits"] and megatrain["host_budget_gb"]["fits"]
        return
    plan_bench(*TINY, "--runs", "solved", "megatrain", "--gradients", *gradients, "--warmup", "0", "--steps", "1",
               "--out", str(tmp_path))
    runs = runs_of(tmp_path)
    assert [(r["policy"], r["gradients"]) for r in runs] == [(p, g) for p in ("solved", "megatrain") for g in gradients]
    for r in runs:
        assert r["master"] == "fp32" and r["tokens_per_s"] > 0
    grads = {(r["policy"], r["gradients"]): [lp["grad"] for lp in r["plan"]["layers"]] for r in runs}
    if gradients == ["gpu"]:
        assert grads["solved", "gpu"] == grads["megatrain", "gpu"] == ["gpu", "gpu"]
    else:  # (auto's solved plan: whatever it chose ran, buffers or not)
        assert grads["solved", "host"] == grads["megatrain", "host"] == grads["megatrain", "auto"] == ["host", "host"]


def test_the_host_sampler_counts_child_processes_memory():
    """`HostSampler.children_most`: the resident memory of this process's children (what the
    host budget does not count, e.g. torch.compile's workers), here one holding 40 MiB."""
    import subprocess
    import time

    from bench.common import HostSampler

    child = subprocess.Popen([sys.executable, "-c", "x = bytearray(40 << 20); import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    try:
        time.sleep(0.5)
        sampler = HostSampler(period=0.02, children_every=1)
        time.sleep(0.2)
        sampler.stop()
        assert sampler.children_most >= 40 << 20
    finally:
        child.communicate(b"")

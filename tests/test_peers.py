"""bench/peers.py (LazyTrain against DeepSpeed ZeRO-3 offload, FSDP2 CPU offload and plain
PyTorch) on the CPU, and bench/readme_table.py, which writes the README's table from its records."""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers

from bench import peers, readme_table
from bench.peer_runners import ChunkedLossModel, init_values, shape_adapter
from lazytrain.memory.host_store import HostStore
from lazytrain.model.build import build_model

ROOT = Path(__file__).resolve().parents[1]
FIELDS = {"name", "date", "device", "torch", "model", "seq_len", "batch_size", "policy", "tokens_per_s",
          "tflops_6nt", "tflops_model", "step_time_s", "predicted_step_time_s", "peak_gpu_alloc_gb",
          "peak_gpu_reserved_gb", "host_rss_gb", "gpu_mem_cap_gb", "world_size", "host_bytes_per_param", "runner",
          "status", "optimizer_exact"}


def run_peers(monkeypatch, *argv: str) -> None:
    """``python -m bench.peers ARGV`` in this process: a process of its own would import torch,
    transformers and LazyTrain again (~5 s). Its workers are processes of their own as ever;
    the SIGTERM handler a study installs is put back after it. The command line itself (SIGTERM
    to it included) is `test_a_stopped_parent_stops_its_worker`'s."""
    monkeypatch.setattr(sys, "argv", ["bench/peers.py", *argv])
    handler = signal.getsignal(signal.SIGTERM)
    try:
        peers.main()
    finally:
        signal.signal(signal.SIGTERM, handler)


def test_peers_on_the_cpu_writes_records(tmp_path, monkeypatch):
    """LazyTrain and FSDP2 (gloo, world size 1) train the tiny shape; the GPU-only run is a row."""
    run_peers(monkeypatch, "--device", "cpu", "--models", "tiny", "--seq", "32", "--batches", "2", "--runs",
              "lazytrain:hybrid8bit", "fsdp2_cpu_offload", "pytorch_gpu", "--warmup", "1", "--steps", "1",
              "--out", str(tmp_path))
    (path,) = tmp_path.glob("peers_tiny_*.json")
    records = json.loads(path.read_text())
    assert [(r["runner"], r["status"]) for r in records] == [
        ("lazytrain", "ok"), ("fsdp2_cpu_offload", "ok"), ("pytorch_gpu", "not run: needs a GPU")]
    for r in records:
        assert FIELDS <= r.keys(), FIELDS - r.keys()
        assert r["world_size"] == 1 and r["batch_size"] == 2 and r["seq_len"] == 32
    ours, fsdp, _ = records
    assert ours["policy"] == "solved" and ours["predicted_step_time_s"] > 0 and ours["optimizer_exact"] is False
    assert ours["planner_max_batch"] >= 2  # the batch the planner says fits: the search's first guess
    assert fsdp["policy"] == "fsdp2_cpu_offload" and fsdp["optimizer_exact"] is True
    assert fsdp["host_bytes_per_param"]["total"] == 16
    for r in (ours, fsdp):
        assert r["tokens_per_s"] > 0 and r["tflops_6nt"] > 0 and r["tflops_model"] > 0 and r["host_rss_gb"] > 0
    # the same model and batches: the last step's loss agrees (LazyTrain fp32 on the CPU, FSDP2 bf16 compute)
    assert fsdp["loss"] == pytest.approx(ours["loss"], abs=0.02)
    assert path.with_suffix(".md").exists()
    table = readme_table.table(readme_table.load([path]))
    assert "LazyTrain, 8-bit states" in table and "FSDP2, CPUOffloadPolicy" in table


def study(tmp_path, monkeypatch, available_gb: float = 100.0) -> peers.Study:
    """The 7B shape's study on an H200 with 128 GB of host memory, ``available_gb`` of it free."""
    monkeypatch.setattr(peers, "meminfo", lambda: (int(128e9), int(available_gb * 1e9)))
    monkeypatch.setattr(peers, "gpu_total_bytes", lambda: 143771 * 2**20)
    args = argparse.Namespace(seq=1024, tag="", warmup=1, steps=1, seed=0, head_chunk=4096, device="cuda",
                              fsdp_pin="auto", host_reserve_gb=6.0, worker_timeout=60.0, out=str(tmp_path),
                              models=["qwen2.5-7b"], batches=["2"], runs=list(peers.RUNS), max_tries=2, max_batch=8)
    return peers.Study("qwen2.5-7b", args, "NVIDIA H200")


def test_runs_that_cannot_start_are_rows_not_crashes(tmp_path, monkeypatch):
    """A missing package and a model state past the host's memory are recorded without a worker."""
    s = study(tmp_path, monkeypatch, available_gb=120.0)
    real_find_spec = peers.importlib.util.find_spec
    monkeypatch.setattr(peers.importlib.util, "find_spec",
                        lambda name, *a: None if name == "deepspeed" else real_find_spec(name, *a))
    monkeypatch.setattr(peers.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(peers, "launch", lambda *a, **k: pytest.fail("no worker should start"))
    missing = s.run("deepspeed_zero3_offload", 2)
    assert missing["status"] == "not installed" and FIELDS <= missing.keys()
    # 7.6B params x 16 B/param (FSDP2 unpinned, the auto choice when pinned does not fit) > 114 GB free
    too_big = s.run("fsdp2_cpu_offload", 2)
    assert too_big["status"] == "does not fit host memory" and "needs 125.8 GB" in too_big["error"]
    # 16 B/param of fp32 state alone is 122 GB; at batch 64 the layer inputs and the loss add ~44 GB
    assert s.run("pytorch_gpu", 64)["status"] == "does not fit GPU memory"
    records = json.loads((tmp_path / f"{s.stem}.json").read_text())
    assert [r["status"] for r in records] == ["not installed", "does not fit host memory", "does not fit GPU memory"]


def test_fsdp2_pins_only_when_the_rounded_up_bytes_fit(tmp_path, monkeypatch):
    numels = [3 * 2**20, 2**20]  # 12 MiB of fp32 pins as 16 MiB
    pinned, _ = peers.host_estimate("fsdp2_cpu_offload", numels, True)
    unpinned, _ = peers.host_estimate("fsdp2_cpu_offload", numels, False)
    assert pinned - peers.PROCESS_BYTES == 2 * (2**24 + 2**22) + 8 * sum(numels)
    assert unpinned - peers.PROCESS_BYTES == 16 * sum(numels)
    assert peers.host_estimate("deepspeed_zero3_offload", numels, True)[0] - peers.PROCESS_BYTES == 18 * sum(numels)
    assert peers.host_estimate("lazytrain:hybrid8bit", numels, True) is None
    assert study(tmp_path, monkeypatch, available_gb=500).pin_choice("fsdp2_cpu_offload")[0] is True
    assert study(tmp_path, monkeypatch, available_gb=150).pin_choice("fsdp2_cpu_offload")[0] is False


def test_the_watchdog_kills_a_worker_when_host_memory_runs_low(tmp_path, monkeypatch):
    monkeypatch.setattr(peers, "meminfo", lambda: (int(128e9), int(1e9)))
    job = {"run": "fsdp2_cpu_offload", "model": "tiny", "batch": 2, "seq": 32, "warmup": 1, "steps": 1,
           "device": "cpu", "seed": 0, "head_chunk": 4096, "pin_memory": False}
    worker = peers.launch(job, tmp_path / "w.log", reserve=int(6e9), timeout=60)
    assert worker.record is None and worker.status.startswith("killed: host memory low")


def _workers() -> list[int]:
    """Pids of running `bench.peers` worker processes."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"bench.peers" in cmdline and b"--worker" in cmdline:
            pids.append(int(proc.name))
    return pids


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="needs Linux /proc")
def test_a_stopped_parent_stops_its_worker(tmp_path):
    """SIGTERM to the parent (what `timeout` sends) ends the worker too: it runs in a session of
    its own, and one left running kept its host memory through the next runs."""
    import time

    assert _workers() == []
    parent = subprocess.Popen([sys.executable, "-m", "bench.peers", "--device", "cpu", "--models", "tiny", "--seq",
                               "32", "--batches", "2", "--runs", "fsdp2_cpu_offload", "--warmup", "1", "--steps",
                               "1000", "--out", str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while not _workers():
        assert parent.poll() is None and time.monotonic() < deadline, parent.stdout.read()
        time.sleep(0.2)
    parent.send_signal(signal.SIGTERM)
    assert parent.wait(timeout=60) == 128 + signal.SIGTERM
    while _workers():
        assert time.monotonic() < deadline, "the worker outlived its parent"
        time.sleep(0.2)


def test_peer_models_get_lazytrain_weights_and_loss():
    """The peers' HF model holds exactly the host store's random init, and the chunked loss is
    HF's causal-LM loss."""
    adapter = shape_adapter("tiny", torch.device("cpu"))
    _, store = build_model("builtin:tiny", torch.device("cpu"), torch.float32, seed=3,
                           vocab_size=adapter.vocab_size, pin=False, store_factory=HostStore)
    lm = transformers.AutoModelForCausalLM.from_config(adapter.config, dtype=torch.float32)
    params = dict(lm.named_parameters())
    with torch.no_grad():
        for g, group in enumerate(init_values(adapter, 3, torch.device("cpu"))):
            for (name, value), p in zip(group, adapter.layouts[g].params):
                params[name].copy_(value)
                torch.testing.assert_close(value, store.masters[g][p.offset : p.offset + p.numel].view(p.shape),
                                           rtol=0, atol=0)
    ids = torch.randint(0, adapter.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    chunked = ChunkedLossModel(lm, chunk=7)(ids, ids)  # 30 targets in chunks of 7: a ragged last chunk
    torch.testing.assert_close(chunked, lm(input_ids=ids, labels=ids).loss, rtol=1e-5, atol=1e-6)


def record(model: str, run: str, batch: int, tokens_per_s: float | None, status: str = "ok", **extra) -> dict:
    numbers = {} if tokens_per_s is None else {"tokens_per_s": tokens_per_s, "tflops_model": tokens_per_s / 100,
                                               "step_time_s": batch * 1024 / tokens_per_s}
    return {"model": model, "run": run, "runner": run.partition(":")[0], "batch_size": batch, "status": status,
            "device": "NVIDIA H200", "date": "2026-12-02", "num_params": 7 if model == "qwen2.5-7b" else 3,
            "tokens_per_s": None, "tflops_model": None, "step_time_s": None, "peak_gpu_alloc_gb": 100.0,
            "host_used_gb": 60.0, "optimizer_exact": not run.endswith("hybrid8bit"), **numbers, **extra}


def write(tmp_path: Path, records: list[dict]) -> Path:
    path = tmp_path / "peers_qwen2.5-7b_h200_2026-12-02_s1024.json"
    path.write_text(json.dumps(records))
    return path


def test_readme_table_is_deterministic_and_follows_the_records(tmp_path):
    records = [
        record("qwen2.5-7b", "lazytrain:hybrid8bit", 64, 9000.0),
        record("qwen2.5-7b", "fsdp2_cpu_offload", 64, 3000.0),
        record("qwen2.5-7b", "deepspeed_zero3_offload", 64, None, status="does not fit host memory",
               host_estimate_gb=140.2, host_room_gb=124.0),
        record("qwen2.5-3b", "lazytrain:hybrid8bit", 64, 16000.0),
        record("qwen2.5-3b", "lazytrain:hybrid8bit", 80, 16200.0, search=True),  # a search's try: not shown
        record("qwen2.5-3b", "lazytrain:hybrid8bit", 128, 16500.0, search=True, largest_batch=True),
        record("qwen2.5-3b", "lazytrain:hybrid8bit", 96, 17000.0, search=True),  # the run's fastest: shown
    ]
    path = write(tmp_path, records)
    first = readme_table.table(readme_table.load([path]))
    assert first == readme_table.table(readme_table.load([path]))
    assert first.index("| qwen2.5-3b |") < first.index("| qwen2.5-7b |")  # smaller model first
    assert ("9,000 tokens/s (batch 64), **3.00x** the fastest offloading peer (FSDP2, CPUOffloadPolicy, batch 64: "
            "3,000).") in first
    assert "does not fit host memory (140 GB needed, 124 free)" in first
    assert "qwen2.5-3b: LazyTrain (8-bit states) 17,000 tokens/s (batch 96); no offloading peer runs" in first
    assert "| 128 (largest) | 16,500 |" in first and "| 96 (fastest) | 17,000 |" in first and "| 80 |" not in first
    records[1]["tokens_per_s"] = 4500.0
    changed = readme_table.table(readme_table.load([write(tmp_path, records)]))
    assert changed != first and "**2.00x**" in changed

    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{readme_table.START}\nstale\n{readme_table.END}\nrest\n")
    subprocess.run([sys.executable, "bench/readme_table.py", str(path), "--readme", str(readme)], cwd=ROOT,
                   check=True)
    text = readme.read_text()
    assert text.startswith("intro\n") and text.endswith("rest\n") and "stale" not in text and "**2.00x**" in text
    subprocess.run([sys.executable, "bench/readme_table.py", str(path), "--readme", str(readme), "--check"],
                   cwd=ROOT, check=True)


def test_readme_table_ceiling_partial_invalid_and_notes(tmp_path):
    """Plain PyTorch on the GPU is the ceiling, not a peer; a run stopped after measured steps
    counts with its figures and says so; an invalid row is left out; a note is a footnote."""
    records = [
        record("qwen2.5-3b", "lazytrain:hybrid8bit", 64, 12000.0, note="buffers unpinned"),
        record("qwen2.5-3b", "lazytrain:hybrid8bit", 64, None, status="does not fit host memory",
               invalid="host memory held by a leftover worker", date="2026-12-02"),
        record("qwen2.5-3b", "deepspeed_zero3_offload", 64, 10000.0),
        record("qwen2.5-3b", "fsdp2_cpu_offload", 64, 15000.0, status="stopped with its parent", partial_steps=2),
        record("qwen2.5-3b", "pytorch_gpu", 64, 24000.0),
    ]
    text = readme_table.table(readme_table.load([write(tmp_path, records)]))
    assert ("**0.80x** the fastest offloading peer (FSDP2, CPUOffloadPolicy, batch 64: 15,000, 2 measured steps "
            "before it was stopped); 0.50x PyTorch, all on the GPU (no offload, batch 64: 24,000).") in text
    assert "| 15,000 (2 measured steps, from its log: stopped with its parent) | 1.25 |" in text
    assert "LazyTrain, 8-bit states [1] | 64 | 12,000 |" in text and "\n[1] buffers unpinned" in text
    assert "does not fit" not in text and "leftover" not in text


def test_peers_merge_and_rows_from_a_log(tmp_path, monkeypatch):
    """--from-log turns the steps a stopped worker printed into a row; --merge makes one study of
    record files, with notes and invalid marks on the rows named."""
    log = tmp_path / "w.log"
    log.write_text("fsdp2_cpu_offload b2 step 0: 9.00 s, loss 5.5000\nfsdp2_cpu_offload b2 step 1: 2.00 s, loss 5.4000\n"
                   "fsdp2_cpu_offload b2 step 2: 4.00 s, loss 5.3000\nTraceback (most recent call last):\n")
    like = write(tmp_path, [record("tiny", "lazytrain:hybrid8bit", 2, 100.0, name="tiny_lazytrain_hybrid8bit_b2_s32",
                                   torch="2.11.0+cu130", transformers="5.17.0", seq_len=32, warmup_steps=1, steps=2,
                                   seed=0, head_chunk_tokens=4096, tflops_6nt=1.0, peak_gpu_reserved_gb=101.0,
                                   host_rss_gb=50.0, optimizer_kind="hybrid8bit", loss=5.0)])
    common = ["--models", "tiny", "--seq", "32", "--out", str(tmp_path)]
    run_peers(monkeypatch, *common, "--from-log", str(log), "--like", str(like), "--runs", "fsdp2_cpu_offload",
              "--batches", "2", "--why", "stopped with its parent")
    (partial,) = json.loads(next(tmp_path.glob("peers_tiny_*_from_log.json")).read_text())
    assert partial["status"] == "stopped with its parent" and partial["partial_steps"] == 2
    assert partial["step_time_s"] == pytest.approx(3.0) and partial["tokens_per_s"] == pytest.approx((64 / 2 + 64 / 4) / 2)  # median of the steps' figures
    assert partial["loss"] == 5.3 and partial["device"] == "NVIDIA H200"
    run_peers(monkeypatch, *common, "--merge", str(like), str(next(tmp_path.glob("peers_tiny_*_from_log.json"))),
              "--into", "peers_tiny_merged", "--note", "lazytrain=a note", "--invalid", "fsdp2=why not")
    merged = json.loads((tmp_path / "peers_tiny_merged.json").read_text())
    assert [(r["run"], r.get("note"), r.get("invalid")) for r in merged] == [
        ("lazytrain:hybrid8bit", "a note", None), ("fsdp2_cpu_offload", None, "why not")]
    report = (tmp_path / "peers_tiny_merged.md").read_text()
    assert "ok (a note)" in report and "left out (not shown in the README): why not" in report
    # a name that is a row's whole name marks that row only, not the rows it is a prefix of
    rerun = tmp_path / "rerun.json"
    rerun.write_text(json.dumps([{**merged[0], "name": merged[0]["name"] + "_fix", "note": None}]))
    run_peers(monkeypatch, *common, "--merge", str(tmp_path / "peers_tiny_merged.json"), str(rerun), "--into", "again",
              "--invalid", f"{merged[0]['name']}=superseded")
    again = json.loads((tmp_path / "again.json").read_text())
    assert [r.get("invalid") for r in again] == ["superseded", "why not", None]


def test_the_readme_table_is_the_committed_records():
    """README.md's peers block is what bench/readme_table.py writes from bench/results."""
    done = subprocess.run([sys.executable, "bench/readme_table.py", "--check"], cwd=ROOT, capture_output=True,
                          text=True, check=False)
    assert done.returncode == 0, done.stderr


def _search(monkeypatch, limit: int, max_tries: int, max_batch: int = 512) -> tuple[list[int], list[dict]]:
    """The largest-batch search of a peer whose GPU peak is 4 GB + 0.25 GB per sample on a
    100 GB card and which runs every batch up to ``limit``: (batches tried, marked records)."""
    from bench.peers import GB, Study

    study = Study.__new__(Study)
    study.args = SimpleNamespace(max_tries=max_tries, max_batch=max_batch, head_chunk=4096)
    study.gpu_bytes, study.vocab, study.numels, study.records = int(100 * GB), 1000, [10], []
    tried = []

    def run(run, batch, search=False, planner=False):
        tried.append(batch)
        record = {"run": run, "runner": "fsdp2_cpu_offload", "batch_size": batch, "log": "w.log",
                  "status": "ok" if batch <= limit else "out of GPU memory", "peak_gpu_alloc_gb": 4 + 0.25 * batch}
        study.records.append(record)
        return record

    monkeypatch.setattr(study, "run", run)
    monkeypatch.setattr(study, "save", lambda: None)
    study.largest_batch("fsdp2_cpu_offload", run("fsdp2_cpu_offload", 64))
    return tried[1:], [r for r in study.records if r.get("largest_batch")]


def test_the_largest_batch_search_starts_where_the_first_peak_points(monkeypatch):
    """352 is the largest batch that runs. The search guesses from batch 64's peak (a line
    through it and the loss chunk, so an under-guess here: 288), steps up by 1/8 and bisects:
    344 in 4 tries, bounded by 364's out-of-memory, where doubling from 64 ends at 256 (128,
    256, 512 and 384 tried)."""
    from bench.peers import GB

    tried, marked = _search(monkeypatch, limit=352, max_tries=4)
    per_sample = (20 - 14 * 4096 * 1000 / GB) / 64
    assert tried[0] == int((90 - 14 * 4096 * 1000 / GB) / per_sample) // 8 * 8 == 288
    assert tried == [288, 324, 364, 344]
    assert [(r["batch_size"], r["largest_batch_bounded"]) for r in marked] == [(344, True)]


def test_a_search_that_never_ran_out_of_memory_says_so(monkeypatch):
    """A card that runs every batch up to 900 (the guess far too low): with the tries spent
    before any out-of-memory, the largest batch is marked as not bounded (the reports say
    "largest tried"), not as the card's largest."""
    tried, marked = _search(monkeypatch, limit=900, max_tries=3, max_batch=1024)
    assert tried == [288, 324, 364]
    assert [(r["batch_size"], r["largest_batch_bounded"]) for r in marked] == [(364, False)]


def test_a_search_can_start_from_a_committed_row():
    """``--search-from``: the newest valid row of the same model, run, batch, seq and device,
    measured or out of GPU memory, saves the search the first batch's run (minutes at 7B)."""
    from bench.peers import searched_from

    base = {"model": "m", "run": "fsdp2_cpu_offload", "batch_size": 64, "seq_len": 1024, "device": "NVIDIA H200"}
    rows = [{**base, "name": "old", "date": "2026-11-30", "status": "ok"},
            {**base, "name": "new", "date": "2026-12-01", "status": "ok"},
            {**base, "name": "superseded", "date": "2026-12-02", "status": "ok", "invalid": "why"},
            {**base, "name": "killed", "date": "2026-12-02", "status": "killed: host memory low"},
            {**base, "name": "other card", "date": "2026-12-02", "status": "ok", "device": "NVIDIA H100"},
            {**base, "name": "other seq", "date": "2026-12-02", "status": "ok", "seq_len": 4096}]
    assert searched_from(rows, "m", "fsdp2_cpu_offload", 64, "NVIDIA H200", 1024)["name"] == "new"
    assert searched_from(rows, "m", "pytorch_gpu", 64, "NVIDIA H200", 1024) is None
    oom = [{**base, "name": "oom", "date": "2026-12-01", "status": "out of GPU memory"}]
    assert searched_from(oom, "m", "fsdp2_cpu_offload", 64, "NVIDIA H200", 1024)["name"] == "oom"


def test_lazytrains_largest_batch_search_starts_at_the_planners_largest(monkeypatch):
    """LazyTrain's plan fills the card at any batch, so its GPU peak points nowhere: the search
    starts at 0.9 of the batch the planner fits from the first run's profile
    (``planner_max_batch``), where doubling from 64 would take five tries to get past 600."""
    from bench.peers import GB, Study

    study = Study.__new__(Study)
    study.args = SimpleNamespace(max_tries=3, max_batch=1024, head_chunk=4096)
    study.gpu_bytes, study.vocab, study.numels, study.records = int(100 * GB), 1000, [10], []
    tried = []

    def run(run, batch, search=False, planner=False):
        tried.append(batch)
        record = {"run": run, "runner": "lazytrain", "batch_size": batch, "planner_max_batch": 600, "log": "w.log",
                  "status": "ok" if batch <= 620 else "does not fit GPU memory", "peak_gpu_alloc_gb": 99.0}
        study.records.append(record)
        return record

    monkeypatch.setattr(study, "run", run)
    monkeypatch.setattr(study, "save", lambda: None)
    study.largest_batch("lazytrain:hybrid8bit", run("lazytrain:hybrid8bit", 64))
    # 0.9 of the planner's 600 (its extrapolation can fall short), then steps of 1/8 up
    assert tried[1:] == [536, 603, 678]
    assert [r["batch_size"] for r in study.records if r.get("largest_batch")] == [603]
    # a first row without the planner's figure (committed before it was recorded): doubling
    assert study.first_guess({"runner": "lazytrain", "status": "ok", "batch_size": 64}) is None


def test_a_lazytrain_search_without_the_planners_figure_asks_its_first_try(monkeypatch):
    """A committed first row without ``planner_max_batch``: the first try doubles (128) and asks
    its worker for the planner's largest batch (600), and the next try starts at 0.9 of it."""
    from bench.peers import GB, Study

    study = Study.__new__(Study)
    study.args = SimpleNamespace(max_tries=3, max_batch=1024, head_chunk=4096)
    study.gpu_bytes, study.vocab, study.numels, study.records = int(100 * GB), 1000, [10], []
    asked = []

    def run(run, batch, search=False, planner=False):
        asked.append((batch, planner))
        record = {"run": run, "runner": "lazytrain", "batch_size": batch, "log": "w.log",
                  "status": "ok" if batch <= 620 else "out of GPU memory",
                  **({"planner_max_batch": 600} if planner else {})}
        study.records.append(record)
        return record

    monkeypatch.setattr(study, "run", run)
    monkeypatch.setattr(study, "save", lambda: None)
    study.largest_batch("lazytrain:hybrid8bit", {"run": "lazytrain:hybrid8bit", "runner": "lazytrain",
                                                 "batch_size": 64, "status": "ok"})
    assert asked == [(128, True), (536, False), (603, False)]
    assert [r["batch_size"] for r in study.records if r.get("largest_batch")] == [603]


def test_the_no_offload_search_stays_within_its_own_estimate(monkeypatch):
    """Plain PyTorch's first guess is capped where its GPU estimate reaches the guesses' 90% of
    the card (the 12-03 search on the H200 guessed 392, which the estimate refused), and a batch the
    estimate refuses costs no try: only batches that started a process count."""
    from bench.peers import GB, Study

    study = Study.__new__(Study)
    study.args = SimpleNamespace(max_tries=2, max_batch=1024, head_chunk=4096, seq=1024)
    study.gpu_bytes, study.vocab, study.numels, study.records = int(150 * GB), 1000, [10**9], []
    study.layers, study.hidden, study.intermediate = 32, 4096, 16384
    cap = study.estimated_gpu_max_batch()
    assert cap % 8 == 0 and study.gpu_need(cap) <= study.gpu_bytes < study.gpu_need(cap + 8)
    # a first row whose peak points far past what the estimate allows
    first = {"run": "pytorch_gpu", "runner": "pytorch_gpu", "batch_size": 8, "status": "ok",
             "peak_gpu_alloc_gb": study.gpu_need(0) / GB + 0.01}
    assert study.first_guess(first) == study.estimated_gpu_max_batch(0.9) < cap
    tried = []

    def run(run, batch, search=False, planner=False):
        tried.append(batch)
        need = study.gpu_need(batch)
        record = {"run": run, "runner": "pytorch_gpu", "batch_size": batch,
                  "status": "does not fit GPU memory" if need > study.gpu_bytes else "ok"}
        if need <= study.gpu_bytes:
            record["log"] = "w.log"
        study.records.append(record)
        return record

    monkeypatch.setattr(study, "run", run)
    monkeypatch.setattr(study, "save", lambda: None)
    monkeypatch.setattr(study, "first_guess", lambda first: 2 * cap)  # as an old guess would
    study.largest_batch("pytorch_gpu", first)
    assert tried[0] == 2 * cap and len([b for b in tried if study.gpu_need(b) <= study.gpu_bytes]) == 2


def test_merge_moves_the_largest_batch_mark_to_a_continued_searchs_largest():
    """A search continued in a later call from an earlier file's row marks its own largest: the
    merged study keeps one mark per run, on the largest batch that ran, bounded when a larger
    batch of that run ran out of GPU memory in either file (the 12-03 3B fp32 search: 128 in one
    call, 456 in the next)."""
    from bench.peers import largest_marks

    rows = [{"run": "a", "batch_size": 128, "status": "ok", "largest_batch": True, "largest_batch_bounded": True},
            {"run": "a", "batch_size": 453, "status": "does not fit GPU memory"},
            {"run": "a", "batch_size": 400, "status": "ok", "largest_batch": True, "largest_batch_bounded": False},
            {"run": "b", "batch_size": 128, "status": "ok", "largest_batch": True, "largest_batch_bounded": False},
            {"run": "b", "batch_size": 456, "status": "ok", "largest_batch": True, "largest_batch_bounded": False},
            {"run": "b", "batch_size": 600, "status": "killed: host memory low (5.9 GB available)"},
            {"run": "c", "batch_size": 64, "status": "ok"}]
    largest_marks(rows)
    marked = [(r["run"], r["batch_size"], r["largest_batch_bounded"]) for r in rows if r.get("largest_batch")]
    assert marked == [("a", 400, True), ("b", 456, False)]
    assert all("largest_batch_bounded" not in r for r in rows if not r.get("largest_batch"))

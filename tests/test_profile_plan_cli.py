"""Profiler -> CostTable -> MILP -> executor, on the CPU with the built-in tiny model."""

from __future__ import annotations

import json
import logging

import pytest

from lazytrain.cli.main import main
from lazytrain.plan.costs import CostTable
from lazytrain.plan.plan import Plan

COMMON = ["training.batch_size=4", "data.max_seq_len=96", "data.builtin_train_size=64",
          "data.heldout_size=2", "training.progress=false"]


def test_profile_then_plan_then_train_with_the_solved_plan(tmp_path, capsys, caplog):
    out = f"training.output_dir={tmp_path}"
    assert main(["profile", out, *COMMON]) == 0
    assert "seq 96, causal attention:" in capsys.readouterr().err  # what was profiled, said
    costs = CostTable.load(tmp_path / "costs.json")
    assert (costs.attention, costs.optimizer) == ("causal", "fp32")
    assert (costs.batch_size, costs.seq_len, costs.num_layers) == (4, 96, 2)
    layer = costs.layers[0]
    assert layer.forward_ms > 0 and layer.backward_ms > 0 and layer.recompute_ms > 0
    # saved tensors: more than the input, bounded by a few dozen hidden-sized values per token
    assert layer.input_bytes == 4 * 96 * 128 * 4
    assert layer.input_bytes < layer.saved_bytes < 60 * layer.input_bytes
    assert costs.optimizer_ns_per_param > 0 and costs.h2d_gbps > 0
    assert CostTable.from_dict(json.loads((tmp_path / "costs.json").read_text())) == costs

    assert main(["plan", out, f"plan.costs={tmp_path / 'costs.json'}", *COMMON]) == 0
    printed = capsys.readouterr().out
    assert "plan 'solved'" in printed and "megatrain" in printed and "keep_all" in printed
    plan = Plan.load(tmp_path / "plan.json")
    assert plan.policy == "solved" and plan.predicted_step_time_s > 0 and plan.num_layers == 2

    with caplog.at_level(logging.INFO, logger="lazytrain"):
        assert main(["train", out, "plan.policy=solved", f"plan.costs={tmp_path / 'costs.json'}",
                     "training.steps=2", *COMMON]) == 0
    assert "plan:\nplan 'solved': batch 4 x seq 96" in caplog.text  # the run says what it runs
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert len(steps) == 2 and all(r["predicted_step_time_s"] > 0 for r in steps)
    # each step: the simulator's exposure per stream and activation peaks next to what ran
    # (the stream trace itself needs CUDA; the activation peaks are measured on any device)
    for r in steps:
        assert r["predicted_step_time_s"] >= r["predicted_gpu_compute_s"] > 0
        assert {"predicted_exposed_h2d_s", "predicted_exposed_d2h_s", "predicted_gpu_idle_other_s",
                "predicted_peak_gpu_gb", "predicted_act_host_gb", "predicted_act_nvme_gb"} <= r.keys()
        assert r["act_gpu_gb"] + r["act_host_gb"] > 0 and r["act_nvme_gb"] == 0


def test_profile_measures_the_nvme_tier_through_its_own_path(tmp_path):
    import torch

    from lazytrain.config import load_config
    from lazytrain.memory.nvme import NvmeStore
    from lazytrain.plan.costs import GPU_RESERVE_FRACTION
    from lazytrain.runtime.profiler import profile
    from lazytrain.train.session import build_session

    config = load_config(None, [f"training.output_dir={tmp_path / 'run'}", *COMMON])
    session = build_session(config)
    nvme = NvmeStore(tmp_path / "nvme")
    costs = profile(session.adapter, session.store, torch.device("cpu"), 4, 96,
                    session.make_optimizer, gpu_bytes=2**30, repeats=1, nvme=nvme)
    assert costs.nvme_write_gbps > 0 and costs.nvme_read_gbps > 0
    assert 0 < costs.nvme_bytes <= nvme.free_bytes()
    assert "measured" in costs.notes["nvme"]
    assert not list((tmp_path / "nvme").iterdir())  # the probe files are gone
    # a GPU cap leaves the allocator's reserve unplanned
    assert costs.gpu_bytes == int(2**30 * (1 - GPU_RESERVE_FRACTION))
    assert costs.head_chunk_tokens == config.plan.head_chunk_tokens
    without = profile(session.adapter, session.store, torch.device("cpu"), 4, 96,
                      session.make_optimizer, repeats=1)
    assert without.nvme_bytes == 0


def test_expandable_segments_only_when_the_user_set_nothing(monkeypatch, caplog):
    from lazytrain.runtime.device import prefer_expandable_segments

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    assert prefer_expandable_segments()
    import os

    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    assert not prefer_expandable_segments()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128"
    # too late (CUDA already initialised, as bench's --oom-sites once did before the session):
    # nothing set, and a warning that says so
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setattr("torch.cuda.is_initialized", lambda: True)
    with caplog.at_level("WARNING", logger="lazytrain.runtime.device"):
        assert not prefer_expandable_segments()
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
    assert "fixed segments" in caplog.text


def test_torchinductor_compiles_without_its_worker_pool_unless_the_user_set_it(monkeypatch):
    """`serial_compile`: TORCHINDUCTOR_COMPILE_THREADS=1 where nothing set it (inductor's
    workers hold host memory the plan does not count), the user's value kept, and nothing
    changed once a compile has decided its thread count."""
    import os

    import torch._inductor.config as inductor_config

    from lazytrain.runtime.device import serial_compile

    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    monkeypatch.setattr(inductor_config, "compile_threads", None)
    assert serial_compile() and os.environ["TORCHINDUCTOR_COMPILE_THREADS"] == "1"
    assert inductor_config.decide_compile_threads() == 1
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "4")
    assert not serial_compile() and os.environ["TORCHINDUCTOR_COMPILE_THREADS"] == "4"
    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS")
    monkeypatch.setattr(inductor_config, "compile_threads", 8)
    assert not serial_compile() and "TORCHINDUCTOR_COMPILE_THREADS" not in os.environ


def test_a_hybrid_model_is_profiled_per_layer_type_and_planned(tmp_path, capsys):
    """Qwen3.5-style stack: each layer type measured, the plan table shows the types."""
    out = f"training.output_dir={tmp_path}"
    hybrid = ["model.source=builtin:tiny-hybrid", "training.batch_size=2", "data.max_seq_len=64",
              "data.builtin_train_size=16", "data.heldout_size=2", "training.progress=false"]
    assert main(["profile", out, *hybrid]) == 0
    costs = CostTable.load(tmp_path / "costs.json")
    assert costs.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    types = costs.type_costs()
    assert types["linear_attention"].params != types["full_attention"].params
    assert all(lc.forward_ms > 0 and lc.saved_bytes > lc.input_bytes for lc in types.values())
    assert main(["plan", out, f"plan.costs={tmp_path / 'costs.json'}", *hybrid]) == 0
    printed = capsys.readouterr().out
    assert "linear_attention" in printed and "full_attention" in printed


def test_packed_runs_are_profiled_with_their_document_mask(tmp_path, monkeypatch):
    """data.packing=true profiles the layers with packed rows' block-diagonal mask and positions
    restarting per document (the kernels a packed step runs), and the table says so; a table
    profiled for other batches is refused as plan.costs."""
    import torch

    from lazytrain.config import load_config
    from lazytrain.plan.costs import CostTableMismatch
    from lazytrain.runtime import profiler
    from lazytrain.train.session import build_session

    adapter = build_session(load_config(None, [f"training.output_dir={tmp_path / 'a'}", *COMMON])).adapter
    masks, positions = profiler.profile_batch_masks(adapter, 2, 600, "packed")
    assert positions[0].tolist() == [*range(300), *range(300)]  # 2 documents of about 256 tokens
    attend = masks["full_attention"][0, 0]
    assert bool(attend[300, 300]) and not bool(attend[300, 299])  # its own document's keys only
    assert profiler.profile_batch_masks(adapter, 2, 96, "packed")[1][0].tolist() == list(range(96))  # one
    seen = []
    real = profiler.profile_batch_masks
    monkeypatch.setattr(profiler, "profile_batch_masks", lambda *a: seen.append(a[-1]) or real(*a))

    def table(out, *more):
        config = load_config(None, [f"training.output_dir={tmp_path / out}", *COMMON, *more])
        return build_session(config).cost_table()

    packed = table("p", "data.packing=true")
    assert packed.attention == "packed" and set(seen) == {"packed"}
    hybrid = table("h", "data.packing=true", "model.source=builtin:tiny-hybrid")  # segments for linear attention
    assert hybrid.attention == "packed" and set(hybrid.layer_types) == {"linear_attention", "full_attention"}
    seen.clear()
    assert table("c").attention == "causal" and set(seen) == {"causal"}
    packed.save(tmp_path / "packed.json")
    with pytest.raises(CostTableMismatch, match="profiled with packed attention, this run's batches take causal"):
        table("d", f"plan.costs={tmp_path / 'packed.json'}")
    assert table("e", "data.packing=true", f"plan.costs={tmp_path / 'packed.json'}").attention == "packed"
    # a table profiled with eager elementwise ops is refused by a run that compiles them
    assert packed.elementwise == "eager"
    with pytest.raises(CostTableMismatch, match="profiled with eager elementwise ops, this run's layers run compiled"):
        table("g", "data.packing=true", "model.fused_ops=compiled", f"plan.costs={tmp_path / 'packed.json'}")
    with pytest.raises(ValueError, match="attention must be causal, packed or packed_varlen"):
        real(None, 2, 10, "sliding")
    assert torch.equal(real(build_session(load_config(None, [f"training.output_dir={tmp_path / 'f'}", *COMMON])).adapter,
                            2, 10, "causal")[1][1], torch.arange(10))


def test_a_cost_table_says_which_optimizer_it_timed_and_a_run_of_another_refuses_it(tmp_path):
    from lazytrain.config import load_config
    from lazytrain.plan.costs import CostTableMismatch
    from lazytrain.train.session import build_session

    def table(out, *more):
        return build_session(load_config(None, [f"training.output_dir={tmp_path / out}", *COMMON, *more])).cost_table()

    eight = table("a", "optimizer.kind=hybrid8bit")
    assert eight.optimizer == "hybrid8bit/nearest"  # a built-in shape from scratch: nearest codes
    assert table("b").optimizer == "fp32"
    eight.save(tmp_path / "costs.json")
    with pytest.raises(CostTableMismatch, match="timed the CPU optimizer as hybrid8bit/nearest, this run steps "
                                                "hybrid8bit/stochastic"):
        table("c", "optimizer.kind=hybrid8bit", "optimizer.state_rounding=stochastic", f"plan.costs={tmp_path / 'costs.json'}")
    assert table("d", "optimizer.kind=hybrid8bit", f"plan.costs={tmp_path / 'costs.json'}").optimizer == "hybrid8bit/nearest"
    old = json.loads((tmp_path / "costs.json").read_text())
    del old["optimizer"]  # a table from before the field: taken as it is
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert table("e", f"plan.costs={tmp_path / 'old.json'}").optimizer == ""

"""``lazytrain plan`` from a model's shape: no weights read or allocated, the cost table from a
file or a built-in estimate, and the output says which."""

from __future__ import annotations

import json
import re

import pytest

from lazytrain.cli.main import main
from lazytrain.model.shapes import SHAPES
from lazytrain.plan.plan import Plan
from lazytrain.plan.synthetic import (
    QWEN25_32B,
    estimated_cost_table,
    layer_shape,
    synthetic_cost_table,
)


@pytest.fixture
def no_model(monkeypatch):
    """Building the model (or any host store) fails the test."""
    from lazytrain.memory import host_store
    from lazytrain.model import build
    from lazytrain.train import session

    def refuse(*args, **kwargs):
        raise AssertionError("lazytrain plan built the model")

    monkeypatch.setattr(build, "build_model", refuse)
    monkeypatch.setattr(session, "build_model", refuse)
    monkeypatch.setattr(host_store.HostStore, "__init__", refuse)


def test_plan_from_a_config_json_folder_and_a_builtin_shape(tmp_path, capsys, no_model):
    folder = tmp_path / "model"
    folder.mkdir()  # config.json alone: no weights, no tokenizer
    (folder / "config.json").write_text(json.dumps({**SHAPES["tiny"], "vocab_size": 1000}))
    common = ["training.batch_size=2", "data.max_seq_len=64", "memory.gpu_gb=4", "memory.host_limit_gb=2"]
    assert main(["plan", f"model.source={folder}", f"training.output_dir={tmp_path / 'a'}", *common]) == 0
    printed = capsys.readouterr().out
    assert "cost table: built-in estimate, not measured: synthetic H200" in printed
    assert "4 GiB of GPU memory (memory.gpu_gb)" in printed and "host memory 2 GiB (memory.host_limit_gb)" in printed
    assert "plan 'solved': batch 2 x seq 64" in printed and "megatrain" in printed
    plan = Plan.load(tmp_path / "a" / "plan.json")
    assert plan.num_layers == 2 and plan.batch_size == 2
    # the plan a run of plan.policy would start with, not the solved one (a baseline's host
    # gradient buffers count in its host memory)
    assert main(["plan", f"model.source={folder}", f"training.output_dir={tmp_path / 'm'}", *common,
                 "plan.policy=megatrain"]) == 0
    assert "plan 'megatrain': batch 2 x seq 64" in capsys.readouterr().out
    assert Plan.load(tmp_path / "m" / "plan.json").policy == "megatrain"

    assert main(["plan", "model.source=builtin:tiny-hybrid", f"training.output_dir={tmp_path / 'b'}", *common]) == 0
    printed = capsys.readouterr().out
    assert "linear_attention" in printed and "full_attention" in printed and "built-in estimate" in printed
    assert Plan.load(tmp_path / "b" / "plan.json").num_layers == 4
    # the estimate's CPU update is the run's optimizer's (fp32 states by default; 4-bit stochastic)
    assert "CPU optimizer 0.45 ns/param" in printed
    assert main(["plan", "model.source=builtin:tiny", f"training.output_dir={tmp_path / 'c'}", *common,
                 "optimizer.kind=hybrid4bit"]) == 0
    printed = capsys.readouterr().out
    assert "CPU optimizer 0.37 ns/param" in printed
    # a GPU optimizer step for the quantized states (fp32 AdamW has none): the embedding's and
    # head's at 30 ps/param, their 4-bit states (bf16 master: no remainder) kept on the GPU
    assert "GPU optimizer step 30 ps/param" in printed
    assert main(["plan", "model.source=builtin:tiny", f"training.output_dir={tmp_path / 'd'}", *common]) == 0
    assert "no GPU optimizer step" in capsys.readouterr().out
    from lazytrain.config import load_config
    from lazytrain.memory.budget import optimizer_bytes_per_param
    from lazytrain.train.plan_ahead import plan_ahead

    costs = plan_ahead(load_config(None, ["model.source=builtin:tiny", "optimizer.kind=hybrid4bit",
                                          "memory.master=bf16", *common])).costs
    assert costs.const_update_ms == pytest.approx(costs.const_params * 30e-9)
    embed = costs.const_params - costs.head_params
    assert costs.const_update_bytes == round(costs.const_params * optimizer_bytes_per_param("hybrid4bit", [embed]))
    assert costs.device_step_work_bytes == 1_700_000_000
    assert plan_ahead(load_config(None, ["model.source=builtin:tiny", *common])).costs.const_update_ms is None


def test_a_folder_without_config_json_is_refused(tmp_path, capsys):
    assert main(["plan", f"model.source={tmp_path}", f"training.output_dir={tmp_path / 'out'}"]) == 2
    assert "has no config.json" in capsys.readouterr().err


def test_the_estimate_of_a_qwen2_layer_is_the_synthetic_tables():
    """The estimate reads a layer's widths from its parameters' shapes; for a Qwen2 layer those
    are `synthetic_cost_table`'s dimensions, and so are its costs."""
    s = QWEN25_32B
    h, i, kv = s.hidden, s.intermediate, s.kv_dim
    params = [("self_attn.q_proj.weight", (h, h)), ("self_attn.q_proj.bias", (h,)),
              ("self_attn.k_proj.weight", (kv, h)), ("self_attn.k_proj.bias", (kv,)),
              ("self_attn.v_proj.weight", (kv, h)), ("self_attn.v_proj.bias", (kv,)),
              ("self_attn.o_proj.weight", (h, h)), ("mlp.gate_proj.weight", (i, h)), ("mlp.up_proj.weight", (i, h)),
              ("mlp.down_proj.weight", (h, i)), ("input_layernorm.weight", (h,)),
              ("post_attention_layernorm.weight", (h,))]
    shape = layer_shape(params, h, quadratic=True)
    assert (shape.params, shape.intermediate, shape.mixer_in, shape.mixer_out) == (s.layer_params, i, h + 2 * kv, h)
    final = s.head_params
    estimate = estimated_cost_table(["full_attention"] * s.num_layers, {"full_attention": shape}, vocab=s.vocab,
                                    embed_params=s.const_params - final, final_params=final, batch_size=2,
                                    seq_len=1024)
    synthetic = synthetic_cost_table(s, 2, 1024)
    mine, theirs = estimate.layers[0], synthetic.layers[0]
    for name in ("params", "forward_ms", "backward_ms", "input_bytes", "saved_bytes", "forward_work_bytes",
                 "backward_work_bytes"):
        assert getattr(mine, name) == pytest.approx(getattr(theirs, name), rel=1e-9), name
    for block, option in theirs.recompute_options.items():
        assert mine.recompute_options[block].saved_bytes == option.saved_bytes
        assert mine.recompute_options[block].backward_work_bytes == option.backward_work_bytes
        assert mine.recompute_options[block].recompute_ms == pytest.approx(option.recompute_ms, rel=1e-3)
    assert (estimate.const_params, estimate.head_params, estimate.head_ms) == (
        synthetic.const_params, synthetic.head_params, pytest.approx(synthetic.head_ms))
    with pytest.raises(ValueError, match="not a decoder layer"):
        layer_shape(params[:6], h, quadratic=True)


def test_a_cost_table_measured_elsewhere_plans_for_that_machine(tmp_path, capsys, no_model):
    """plan.costs from a GPU machine, planned on this CPU one: its capacities and bf16 state."""
    import dataclasses

    from lazytrain.config import load_config
    from lazytrain.train.plan_ahead import plan_ahead

    common = ["model.source=builtin:tiny", "training.batch_size=2", "data.max_seq_len=64", "memory.gpu_gb=4"]
    estimate = plan_ahead(load_config(None, common)).costs
    table = dataclasses.replace(estimate, device="NVIDIA H200", host_bytes=3 * 2**30, optimizer="fp32")
    table.save(tmp_path / "costs.json")
    ahead = plan_ahead(load_config(None, [*common, f"plan.costs={tmp_path / 'costs.json'}"]))
    assert ahead.source == f"plan.costs={tmp_path / 'costs.json'} (measured on NVIDIA H200)"
    assert ahead.costs.host_bytes == 3 * 2**30  # the profiled machine's room, not this one's
    assert ahead.host.limit == ahead.host.machine == 3 * 2**30 + ahead.host.state.total
    assert ahead.host.state.weights == 2 * ahead.num_params  # bf16, as on the GPU
    with pytest.raises(Exception, match="timed the CPU optimizer as fp32, this run steps hybrid8bit/nearest"):
        plan_ahead(load_config(None, [*common, f"plan.costs={tmp_path / 'costs.json'}", "optimizer.kind=hybrid8bit"]))


def test_the_flagship_plans_in_128_gib_with_its_gradients_held_on_the_gpu(tmp_path, capsys, no_model):
    """Qwen3.6-27B at batch 72 x 1024 (the paper's) in a 118 GiB host budget, 8-bit states and
    a bf16 master: the plan holds every layer's gradient on the GPU, the host then holds 4.31
    B/param (the embedding's and head's gradient buffers and the ring the only gradients), and
    the components are printed per tier."""
    args = ["plan", "model.source=builtin:qwen3.6-27b", "training.batch_size=72", "memory.host_limit_gb=118",
            "optimizer.kind=hybrid8bit", "memory.master=bf16", "memory.gradients=auto",
            f"training.output_dir={tmp_path}"]
    # every layer stepped on the CPU
    assert main([*args, "plan.const_update=host"]) == 0
    printed = capsys.readouterr().out
    assert "total           107.93 GiB   4.309 B/param: fits" in printed
    assert re.search(r"gradients +\d+\.\d\d +6\.16 +-", printed)  # GPU at the peak, host, NVMe
    assert all(lp.grad == "gpu" for lp in Plan.load(tmp_path / "plan.json").layers)
    # the estimate's GPU step (since 2026-12-07): the plan keeps layers resident and steps them
    # there; their gradients never leave the GPU, so they have no host buffer, as the planner
    # counted (with one each the host needed 151.25 GiB: 33 GiB over the budget)
    assert main([*args, "plan.device_layers=40"]) == 0  # (the search chooses 47: 4x the solve time)
    printed = capsys.readouterr().out
    plan = Plan.load(tmp_path / "plan.json")
    assert plan.device_layers == 40 and "GPU optimizer step 30 ps/param" in printed
    host = re.search(r"gradients +(\d+\.\d\d) GiB", printed)
    streamed_on_host = sum(lp.grad == "host" for lp in plan.layers[plan.device_layers:])
    per_layer = 2 * 26.90e9 / 64 / 2**30  # an upper bound of a layer's bf16 gradient, GiB
    # the embedding's and head's (2.5B parameters) and the ring: under 8 GiB; the resident
    # layers' buffers would add far more
    assert float(host[1]) < streamed_on_host * per_layer + 8 < plan.device_layers * per_layer
    assert re.search(r"total +\d+\.\d\d GiB +\d\.\d+ B/param: fits in the budget of 118\.00 GiB", printed)

"""Profiler -> CostTable -> MILP -> executor, on the CPU with the built-in tiny model."""

from __future__ import annotations

import json

from lazytrain.cli.main import main
from lazytrain.plan.costs import CostTable
from lazytrain.plan.plan import Plan

COMMON = ["training.batch_size=4", "data.max_seq_len=96", "data.builtin_train_size=64",
          "data.heldout_size=2", "training.progress=false"]


def test_profile_then_plan_then_train_with_the_solved_plan(tmp_path, capsys):
    out = f"training.output_dir={tmp_path}"
    assert main(["profile", out, *COMMON]) == 0
    costs = CostTable.load(tmp_path / "costs.json")
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

    assert main(["train", out, "plan.policy=solved", f"plan.costs={tmp_path / 'costs.json'}",
                 "training.steps=2", *COMMON]) == 0
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert len(steps) == 2 and all(r["predicted_step_time_s"] > 0 for r in steps)

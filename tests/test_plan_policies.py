"""One map from policy name to plan: every name means the same plan wherever it is asked for."""

from __future__ import annotations

import pytest

from lazytrain.plan.plan import checkpoint_all_plan, keep_all_plan, megatrain_plan
from lazytrain.plan.policies import (
    BASELINE_POLICIES,
    PolicyOptions,
    baseline_plan,
    comparison_plans,
    policy_plan,
)
from lazytrain.plan.synthetic import QWEN25_32B, synthetic_cost_table


def test_baselines_are_the_plan_constructors():
    o = PolicyOptions(megatrain_every=3, head_chunk_tokens=512, weight_prefetch=2, checkpoint_tier="host")
    assert baseline_plan("megatrain", 7, 2, 64, o).layers == megatrain_plan(7, 2, 64, 3, 512).layers
    assert baseline_plan("keep_all", 7, 2, 64, o).layers == keep_all_plan(7, 2, 64).layers
    host = checkpoint_all_plan(7, 2, 64, "host").layers
    assert baseline_plan("checkpoint_all", 7, 2, 64, o).layers == host  # the configured tier
    assert baseline_plan("checkpoint_host", 7, 2, 64, o).layers == host
    assert all(baseline_plan(n, 7, 2, 64, o).weight_prefetch == 2 for n in BASELINE_POLICIES)
    with pytest.raises(ValueError, match="not a baseline"):
        baseline_plan("solved", 7, 2, 64)


def test_policy_plan_solves_and_the_comparison_skips_nvme_unless_allowed():
    table = synthetic_cost_table(QWEN25_32B, 2, 1024)
    solved = policy_plan("solved", table, PolicyOptions(tiers=("gpu", "host")))
    assert solved.policy == "solved" and solved.num_layers == table.num_layers
    assert {lp.tier for lp in solved.layers} <= {"gpu", "host"}
    assert policy_plan("megatrain", table).layers == megatrain_plan(table.num_layers, 2, 1024).layers
    names = [p.policy for p in comparison_plans(table.num_layers, 2, 1024)]
    assert names == ["megatrain", "keep_all", "checkpoint_gpu", "checkpoint_host"]
    nvme = comparison_plans(table.num_layers, 2, 1024, PolicyOptions(tiers=("gpu", "host", "nvme")))
    assert nvme[-1].policy == "checkpoint_nvme"

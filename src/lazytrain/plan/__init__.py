"""Plans, cost tables, the step simulator, the MILP planner and the batch-size search.

Imports no torch: everything here is tested on tables alone.
"""

from lazytrain.plan.costs import CostTable, LayerCosts, ShapeFit
from lazytrain.plan.milp import PlanInfeasible, milp_evaluate, min_gpu_bytes, solve_plan
from lazytrain.plan.plan import (
    LayerPlan,
    Plan,
    checkpoint_all_plan,
    keep_all_plan,
    megatrain_plan,
)
from lazytrain.plan.policies import (
    BASELINE_POLICIES,
    POLICIES,
    PolicyOptions,
    baseline_plan,
    comparison_plans,
    policy_plan,
)
from lazytrain.plan.render import format_plan_table, render_plan_png
from lazytrain.plan.search import SearchResult, search_batch
from lazytrain.plan.simulate import SimResult, simulate

__all__ = [
    "BASELINE_POLICIES",
    "POLICIES",
    "CostTable",
    "LayerCosts",
    "LayerPlan",
    "Plan",
    "PlanInfeasible",
    "PolicyOptions",
    "SearchResult",
    "ShapeFit",
    "SimResult",
    "baseline_plan",
    "checkpoint_all_plan",
    "comparison_plans",
    "format_plan_table",
    "keep_all_plan",
    "megatrain_plan",
    "milp_evaluate",
    "min_gpu_bytes",
    "policy_plan",
    "render_plan_png",
    "search_batch",
    "simulate",
    "solve_plan",
]

"""The plans the MILP solves from committed cost tables (``bench/results/costs_*.json``) are the
ones recorded in ``tests/assets/solved_plans.json``: a guard for changes to how the program is
built that must not change it (splitting ``milp._build`` into its families of rows), and a
tripwire for ones that do.

Each case's size (rows, columns, binaries) and the MILP's evaluation of the recorded plans
(`milp_evaluate`, a linear program over fixed decisions) do not depend on the solver's search;
the solved plan itself is compared layer by layer where the solver is the one that wrote the
file (another HiGHS may break ties between equally fast plans differently), its predicted step
always. The time limit is far above each solve's time, so a busy machine changes nothing.

Regenerate only when the program is meant to change (and say why in the commit)::

    PYTHONPATH=src python tests/test_plan_solved.py --write
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import scipy

from lazytrain.plan.costs import CostTable
from lazytrain.plan.milp import milp_evaluate, min_gpu_bytes, solve_plan
from lazytrain.plan.plan import LayerPlan, Plan

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "assets" / "solved_plans.json"
GiB = 2**30
TIME_LIMIT_S = 120.0
"""Each case solves to optimality in 0.3-2 s on one core."""

CASES: dict[str, tuple[str, dict]] = {
    # hybrid stack (linear- and full-attention layers), everything at its default
    "9b_hybrid": ("costs_qwen3.5-9b_h200_2026-12-01_s1024_b64_fla_lean.json", {}),
    # long sequences under a 30 GiB cap, the CPU update overlapped: checkpoints on two tiers
    "7b_s32768_cap30_overlap": ("costs_qwen2.5-7b_h200_2026-12-03_s32768_b2_fused.json",
                                {"gpu_bytes": 30 * GiB, "optimizer_overlap": True}),
    # GPU only: recompute segments of drop layers
    "7b_s32768_cap30_gpu_only": ("costs_qwen2.5-7b_h200_2026-12-03_s32768_b2_fused.json",
                                 {"gpu_bytes": 30 * GiB, "tiers": ["gpu"]}),
    # offloads split over two stages
    "7b_s32768_cap30_window2": ("costs_qwen2.5-7b_h200_2026-12-03_s32768_b2_fused.json",
                                {"gpu_bytes": 30 * GiB, "tiers": ["gpu", "host"], "offload_window": 2}),
    # the embedding and head stepped on the GPU, one resident layer, three streamed GPU steps
    "7b_device_steps": ("costs_qwen2.5-7b_h200_2026-12-04_s1024_b64_lean_up_const.json",
                        {"const_update": "device", "device_layers": 1, "device_steps": 3,
                         "tiers": ["gpu", "host"]}),
}
MIN_GPU_CASE = ("costs_qwen2.5-7b_h200_2026-12-03_s32768_b2_fused.json", {})


def _table(name: str) -> CostTable:
    return CostTable.load(ROOT / "bench" / "results" / name)


def _solve(name: str, kwargs: dict) -> Plan:
    kw = dict(kwargs)
    if "tiers" in kw:
        kw["tiers"] = tuple(kw["tiers"])
    return solve_plan(_table(name), time_limit_s=TIME_LIMIT_S, **kw)


def _layers(plan: Plan) -> list[str]:
    return [f"{lp.mode}/{lp.tier}/{lp.recompute}" for lp in plan.layers]


def _with_layers(plan: Plan, layers: list[str]) -> Plan:
    return replace(plan, layers=[LayerPlan(mode=m, tier=t, prefetch=1, recompute=r)
                                 for m, t, r in (s.split("/") for s in layers)], notes={})


def _nvme_variant(layers: list[str]) -> list[str]:
    """Host-tier checkpoints moved to NVMe (where the MILP allows it): the NVMe rows, which no
    committed table's budget exercises."""
    return [s.replace("checkpoint/host", "checkpoint/nvme") if i < len(layers) - 4 else s
            for i, s in enumerate(layers)]


def _evaluations(plan: Plan, table: CostTable, layers: list[str]) -> dict[str, list[float]]:
    """The MILP's (step s, peak GPU bytes) of ``layers`` under ``plan``'s settings, without and
    with the overlapped CPU update, and of the NVMe variant where it differs (and the offloads
    keep one stage: the split copies model the host tier only)."""
    variants = {"plan": layers}
    if _nvme_variant(layers) != layers and plan.offload_window == 1:
        variants["nvme"] = _nvme_variant(layers)
    return {f"{key} overlap={overlap}": list(milp_evaluate(_with_layers(plan, v), table, overlap))
            for key, v in variants.items() for overlap in (False, True)}


def _record(name: str, kwargs: dict) -> dict:
    plan = _solve(name, kwargs)
    stats = plan.notes["milp"]
    return {
        "table": name,
        "solve_plan": kwargs,
        "status": stats["status"],
        "layers": _layers(plan),
        "const_update": plan.const_update,
        "device_layers": plan.device_layers,
        "device_steps": plan.device_steps,
        "predicted_step_time_s": plan.predicted_step_time_s,
        "size": [stats["num_rows"], stats["num_columns"], stats["num_binaries"]],
        "evaluate": _evaluations(plan, _table(name), _layers(plan)),
    }


def write() -> None:
    golden = {
        "scipy": scipy.__version__,
        "cases": {case: _record(name, kwargs) for case, (name, kwargs) in CASES.items()},
        "min_gpu_bytes": {"table": MIN_GPU_CASE[0], "bytes": min_gpu_bytes(_table(MIN_GPU_CASE[0]))},
    }
    for case, rec in golden["cases"].items():
        if rec["status"] != "optimal":
            raise SystemExit(f"{case}: the solve stopped at {rec['status']}, not optimal: pick another case")
    GOLDEN.write_text(json.dumps(golden, indent=1) + "\n")


@pytest.fixture(scope="module")
def golden() -> dict:
    return json.loads(GOLDEN.read_text())


@pytest.mark.parametrize("case", list(CASES))
def test_the_committed_tables_solve_to_the_recorded_plans(golden, case):
    expected = golden["cases"][case]
    name, kwargs = CASES[case]
    assert (expected["table"], expected["solve_plan"]) == (name, kwargs), "regenerate: the cases changed"
    plan = _solve(name, kwargs)
    stats = plan.notes["milp"]
    assert stats["status"] == "optimal"
    assert [stats["num_rows"], stats["num_columns"], stats["num_binaries"]] == expected["size"]
    if golden["scipy"] == scipy.__version__:
        assert _layers(plan) == expected["layers"]
        assert (plan.const_update, plan.device_layers, plan.device_steps) == (
            expected["const_update"], expected["device_layers"], expected["device_steps"])
        assert plan.predicted_step_time_s == pytest.approx(expected["predicted_step_time_s"], rel=1e-9)
    else:  # optimal within the solve's relative gap, 1e-4
        assert plan.predicted_step_time_s == pytest.approx(expected["predicted_step_time_s"], rel=2e-4)
    # the recorded plan (not this solve's) as the MILP evaluates it
    table = _table(name)
    recorded = replace(plan, const_update=expected["const_update"], device_layers=expected["device_layers"],
                       device_steps=expected["device_steps"])
    got = _evaluations(recorded, table, expected["layers"])
    assert got.keys() == expected["evaluate"].keys()
    for key, (step_s, gpu_bytes) in expected["evaluate"].items():
        assert got[key][0] == pytest.approx(step_s, rel=1e-7), key
        assert got[key][1] == pytest.approx(gpu_bytes, rel=1e-7), key


def test_the_least_gpu_memory_of_a_committed_table_is_the_recorded_one(golden):
    expected = golden["min_gpu_bytes"]
    assert expected["table"] == MIN_GPU_CASE[0]
    assert min_gpu_bytes(_table(MIN_GPU_CASE[0])) == pytest.approx(expected["bytes"], rel=1e-7)


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        raise SystemExit(f"usage: python {Path(__file__).name} --write  (rewrites {GOLDEN.relative_to(ROOT)})")
    write()

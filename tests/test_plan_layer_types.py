"""Cost tables of mixed stacks (Qwen3.5: linear- and full-attention layers): costs per layer
type, old one-type files still load, and the planner gives each layer its own type's plan."""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from lazytrain.plan.costs import CostTable, CostTableMismatch
from lazytrain.plan.milp import solve_plan
from lazytrain.plan.plan import keep_all_plan
from lazytrain.plan.render import format_plan_table, render_plan_png
from lazytrain.plan.simulate import simulate
from lazytrain.plan.synthetic import DecoderShape, synthetic_cost_table

RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results"
TYPES = ["linear_attention"] * 3 + ["full_attention"]


def mixed_table(num_layers: int = 12) -> CostTable:
    """Attention layers save 4x a linear layer's bytes but recompute 3x cheaper: under a GPU
    cap the best plan keeps the linear layers and recomputes attention ones."""
    shape = DecoderShape(num_layers=num_layers, hidden=2048, intermediate=6144, num_heads=16,
                         num_kv_heads=4, vocab=32000)
    table = synthetic_cost_table(shape, batch_size=8, seq_len=1024)
    # whole layers only: the synthetic sub-layer options are for the unmodified layer
    base = replace(table.layers[0], recompute_options={})
    costs = {
        "linear_attention": replace(base, saved_bytes=base.saved_bytes // 2, recompute_ms=3 * base.forward_ms,
                                    forward_ms=3 * base.forward_ms),
        "full_attention": replace(base, saved_bytes=2 * base.saved_bytes, weight_bytes=base.weight_bytes // 2),
    }
    kwargs = {f: getattr(table, f) for f in table.__dataclass_fields__ if f not in ("layers", "layer_types")}
    return CostTable.from_types([TYPES[i % 4] for i in range(num_layers)], costs, **kwargs)


@pytest.mark.parametrize("path", sorted(RESULTS.glob("costs_*.json")), ids=lambda p: p.name)
def test_tables_written_before_layer_types_load_as_one_type(path):
    d = json.loads(path.read_text())
    # tables written before the head's per-token bytes and the embedding's backward working
    # set were measured (they load only with them given; neither matters here)
    d = {"head_token_bytes": 0.0, "embed_backward_work_bytes": 0, **d}
    table = CostTable.from_dict(d)
    if "layer_types" not in json.loads(path.read_text()):
        assert set(table.layer_types) == {"full_attention"}
        assert list(table.type_costs()) == ["full_attention"]
    assert len(table.layer_types) == table.num_layers


def test_types_round_trip_and_survive_rescaling(tmp_path):
    table = mixed_table()
    table.save(tmp_path / "costs.json")
    loaded = CostTable.load(tmp_path / "costs.json")
    assert loaded == table
    scaled = loaded.at(4, 512)
    assert scaled.layer_types == table.layer_types
    for kind, lc in scaled.type_costs().items():
        assert lc.forward_ms < table.type_costs()[kind].forward_ms
    assert [lc.saved_bytes for lc in scaled.layers[:4]] == [
        scaled.type_costs()[t].saved_bytes for t in table.layer_types[:4]
    ]


def test_mismatched_types_are_rejected():
    table = mixed_table()
    with pytest.raises(ValueError, match="layer types"):
        replace(table, layer_types=table.layer_types[:-1])
    with pytest.raises(ValueError, match="no costs for layer types"):
        CostTable.from_types(["mamba"], table.type_costs())


def test_solved_plan_of_a_mixed_stack_follows_the_types(tmp_path):
    table = mixed_table()
    keep = simulate(keep_all_plan(table.num_layers, table.batch_size, table.seq_len), table)
    table.gpu_bytes = int(table.gpu_fixed_bytes + 0.75 * (keep.peak_gpu_bytes - table.gpu_fixed_bytes))
    plan = solve_plan(table, tiers=("gpu",))
    sim = simulate(plan, table)
    assert sim.feasible
    modes = {kind: {plan.layers[i].mode for i, t in enumerate(table.layer_types) if t == kind}
             for kind in ("linear_attention", "full_attention")}
    assert modes["linear_attention"] == {"keep"}
    assert "checkpoint" in modes["full_attention"]
    text = format_plan_table(plan, sim, table)
    assert "linear_attention" in text and "full_attention" in text and "decisions" in text
    pytest.importorskip("matplotlib")
    render_plan_png(plan, sim, tmp_path / "plan.png", table)
    assert (tmp_path / "plan.png").stat().st_size > 0


def test_one_type_table_prints_as_before():
    shape = DecoderShape(num_layers=4, hidden=512, intermediate=1536, num_heads=8, num_kv_heads=2, vocab=1000)
    table = synthetic_cost_table(shape, batch_size=2, seq_len=256)
    plan = keep_all_plan(4, 2, 256)
    assert "type" not in format_plan_table(plan, simulate(plan, table), table)


def test_a_table_of_another_stack_is_one_clear_error():
    table = mixed_table()
    table.check_layers(table.layer_types)
    with pytest.raises(CostTableMismatch, match="lazytrain profile"):
        table.check_layers(["full_attention"] * table.num_layers, "plan.costs=x.json")

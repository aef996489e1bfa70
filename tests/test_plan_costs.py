"""CostTable: JSON round trips, validation, rescaling to other batch shapes."""

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lazytrain.plan.costs import CostTable, CostTableMismatch, ShapeFit
from lazytrain.plan.synthetic import QWEN25_32B, random_cost_table, synthetic_cost_table


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), num_layers=st.integers(1, 12))
def test_json_round_trip(seed, num_layers, tmp_path_factory):
    table = random_cost_table(seed, num_layers)
    assert CostTable.from_dict(table.to_dict()) == table
    path = tmp_path_factory.mktemp("costs") / "costs.json"
    table.save(path)
    assert CostTable.load(path) == table


def test_at_reference_shape_is_identity():
    table = synthetic_cost_table(QWEN25_32B, 4, 4096)
    assert table.at(4, 4096) == table


def test_at_scales_bytes_with_tokens_and_attention_with_seq():
    table = synthetic_cost_table(QWEN25_32B, 4, 4096)
    double_batch = table.at(8, 4096)
    double_seq = table.at(4, 8192)
    ref, lb, ls = table.layers[0], double_batch.layers[0], double_seq.layers[0]
    assert lb.input_bytes == 2 * ref.input_bytes
    assert ls.saved_bytes == 2 * ref.saved_bytes
    # Same tokens, but twice the attention per token: longer sequences cost more per token.
    assert ls.forward_ms > lb.forward_ms > 1.9 * ref.forward_ms
    # the head's chunk is the same, its per-token tensors double
    assert double_batch.head_work_bytes == round(table.head_work_bytes + table.head_token_bytes * 4 * 4096)
    assert double_batch.embed_backward_work_bytes == 2 * table.embed_backward_work_bytes
    assert double_batch.head_ms == pytest.approx(2 * table.head_ms)


def test_shape_fit_recovers_coefficients():
    truth = ShapeFit(per_token=3e-4, per_token_seq=2e-8, const=0.5)
    samples = [(b, s, truth(b, s)) for b in (1, 2, 4) for s in (512, 2048, 8192)]
    fit = ShapeFit.fit(samples)
    for b, s, v in samples:
        assert fit(b, s) == pytest.approx(v, rel=1e-6)


def test_validation_says_what_to_do():
    table = random_cost_table(0, 2)
    with pytest.raises(ValueError, match="bidir_gbps"):
        replace(table, bidir_gbps=10 * table.h2d_gbps)
    with pytest.raises(ValueError, match="copy_slowdown"):
        replace(table, copy_slowdown=0.5)
    with pytest.raises(ValueError, match="saved tensors include the layer input"):
        replace(table.layers[0], saved_bytes=table.layers[0].input_bytes - 1)
    with pytest.raises(ValueError, match="refit"):
        ShapeFit(per_token=0.0)


def test_head_working_set_grows_by_its_measured_bytes_per_token():
    costs = replace(synthetic_cost_table(QWEN25_32B, 8, 1024), head_work_bytes=10**9, head_token_bytes=1000.0)
    assert costs.at(8, 1024).head_work_bytes == 10**9
    assert costs.at(16, 1024).head_work_bytes == 10**9 + 1000 * 8 * 1024
    assert costs.at(4, 1024).head_work_bytes == 10**9 - 1000 * 4 * 1024
    assert replace(costs, head_token_bytes=10**6).at(1, 1024).head_work_bytes == 0  # never below zero


def test_a_table_without_the_newer_fields_says_to_profile_again():
    d = synthetic_cost_table(QWEN25_32B, 8, 1024).to_dict()
    del d["embed_backward_work_bytes"], d["head_token_bytes"]
    with pytest.raises(CostTableMismatch, match="embed_backward_work_bytes, head_token_bytes.*profile again"):
        CostTable.from_dict(d)
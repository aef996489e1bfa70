"""The cost table of one data-parallel rank: shared host bandwidth and cores, 1/N of the
gradient copies and of the CPU step; simulator and MILP agree on it."""

import pytest

from lazytrain.plan.milp import milp_evaluate
from lazytrain.plan.plan import megatrain_plan
from lazytrain.plan.simulate import simulate
from lazytrain.plan.synthetic import random_cost_table


def test_for_ranks_shares_the_host():
    table = random_cost_table(3, 6, uniform=True)
    rank = table.for_ranks(world_size=8, local_world_size=4)
    assert rank.h2d_gbps == pytest.approx(table.h2d_gbps / 4)
    assert rank.bidir_gbps == pytest.approx(table.bidir_gbps / 4)
    # a rank steps 1/8 of the elements on 1/4 of the cores
    assert rank.optimizer_ms == pytest.approx(table.optimizer_ms * 4 / 8)
    assert rank.grad_share == 1 / 8
    # a table profiled with the host's ranks copying at once keeps its bandwidths
    measured = table.for_ranks(4, 4)
    again = measured.for_ranks(8, 4)
    assert again.h2d_gbps == measured.h2d_gbps
    assert again.optimizer_ms == pytest.approx(measured.optimizer_ms / 2)
    with pytest.raises(ValueError, match="divide"):
        table.for_ranks(6, 4)


def test_gradient_copies_shrink_with_ranks_and_milp_agrees():
    table = random_cost_table(5, 6, uniform=True)
    plan = megatrain_plan(6, table.batch_size, table.seq_len, 2)
    one = simulate(plan, table, optimizer_overlap=False)
    # same PCIe per rank (one rank per host), 4 ranks: each copies a quarter of the gradients
    four = table.for_ranks(4, 1)
    sim = simulate(plan, four, optimizer_overlap=False)
    assert sim.busy_s["d2h"] == pytest.approx(one.busy_s["d2h"] / 4, rel=1e-12)
    # the MILP's step time of a fixed plan is the simulator's, summed in another order
    step_s, _ = milp_evaluate(plan, four, optimizer_overlap=False)
    assert step_s == pytest.approx(sim.step_time_s, rel=1e-12)

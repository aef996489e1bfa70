"""The planner's mixed-integer program (DESIGN.md section 3), solved with HiGHS via scipy.

Per decoder layer i exactly one mode:

====  ===========================================  ==========================
f_i   keep all saved tensors on the GPU             LayerPlan(keep, gpu)
o_i   keep them, offloaded to pinned host memory    LayerPlan(keep, host)
g_i   keep the input only (checkpoint) on the GPU   LayerPlan(checkpoint, gpu)
p_i   ... on the host                               LayerPlan(checkpoint, host)
n_i   ... on NVMe                                   LayerPlan(checkpoint, nvme)
d_i   keep nothing (segment recompute)              LayerPlan(drop)
====  ===========================================  ==========================

A kept layer (f or o) may also recompute one block in its backward (``LayerPlan.recompute``:
``mlp`` or ``attention``, where the table has that option's costs): f_i and o_i are then sums
of one binary per option, each with the option's saved bytes, backward working set and the
block's re-forward added to the layer's backward stage.

The run-length of drop layers is explicit: a binary ``s[a, e]`` per possible segment [a, e)
(a checkpoint at a followed by e-a-1 drop layers, e - a <= ``max_segment``; e - a = 1 is a lone
checkpoint). The keeps and segments partition the layers (one equality row per layer), g/p/n
pick the tier of a segment start (g_a + p_a + n_a = sum_e s[a, e]) and d_i is implied. Every
segment-dependent cost is then a constant times ``s[a, e]``: its rebuild re-forward, its
weights, its cached inputs; only "segment whose checkpoint is off the GPU" needs a product,
bounded below by ``s[a, e] - g_a``. No big-M rows, and the partition part of the LP is integral.

The step is the simulator's list of stages (``simulate.py``): embed, fwd 0..L-1, head,
bwd L-1..0, embed bwd, optimizer. Each stage has a continuous time ``t_s`` bounded below by
every stream's busy time in that stage. With prefetch distance 1 everything a stage issues is
waited for by the next stage, so the simulator's step time is exactly the sum of per-stage
maxima, and every ``t_s`` has objective coefficient 1: at the optimum each equals the max of
its terms (no extra binaries for the max). Within one stage all streams start together, so:

- copies of ``h`` bytes H2D and ``d`` bytes D2H take ``X = max(h/B_h, d/B_d,
  h/B_bi + (d-h)/B_d, d/B_bi + (h-d)/B_h)`` (exact, given ``B_bi`` between the serial and the
  single-direction bandwidth, which `CostTable` checks);
- compute ``C`` slowed by ``sigma`` while copies run takes ``C + (1 - 1/sigma) X``;
- NVMe reads and writes share one stream.

A segment's first backward stage (its last layer) pays the re-forward of the rest of the
segment, and the stage before it prefetches the segment's weights and off-GPU checkpoint. GPU
memory is bounded at every forward stage, the head, every backward stage and every re-forward
of a segment rebuild, with the simulator's accounting. Host and NVMe bytes are bounded by their
totals (all offloaded tensors are resident at the head). Two families of valid rows tighten the
LP relaxation without changing the integer optimum: per-stage "hull" rows giving each possible
prefetch/offload its exact extra time (a fraction of an offload cannot hide in a stage's slack),
and a cardinality cut on the GPU-kept layers from the head's memory row.

The embedding and the final norm + head take their optimizer step on the host (their
gradients copied out in the embedding's backward stage, their new weights in before the
embedding and the head) or, ``const_update="device"``, on the GPU: no copies, and
``const_update_ms`` of compute in the embedding's stage (with ``optimizer_overlap``) or after
the CPU step (without), with ``const_update_bytes`` more GPU memory in every stage. With the
device step the first ``device_layers`` decoder layers may be resident and stepped there too: a
constant of the model (their weights copied neither way and held with their states in every
stage, their gradients from their backward on, no CPU time, a longer GPU step). `solve_plan`
solves either or both and keeps the faster; to choose the number of resident layers it solves
a few (`DEVICE_LAYER_CANDIDATES`) and bisects around the best. (In the model, residency is
linear in prefix binaries r_0 >= r_1 >= ...; only a recompute segment's or a kept layer's weight
copy, a product with r, would need extra rows, and the per-stage hull rows then no longer hold.)

The simulator and this model agree exactly (up to solver tolerances) on plans this model can
express: prefetch distances 1, no host/NVMe tier on the last layer, no NVMe tier on the last
four (tensors must reach the disk before they are read back). With ``optimizer_overlap`` a
layer's weight copy (and, stepped on the host, the head's in the last forward stage) waits for
its CPU update and may start after its stage does: the model bounds the cumulative forward time
by when it ends, sharing the link with the rest of the stage's copy out (exact), but slows the
stage's compute only for as long as its copies take together from the stage's start, where the
late copy and the copy out may be in flight apart. There the model is a lower bound of the
simulator's step, short of it by at most ``(1 - 1/copy_slowdown) * sum_i min(D_i / B_d, H_i / B_h)``
over the forward stages, D_i the stage's copy out and H_i its late copy in
(``overlap_gap_bound_s`` in tests/test_plan_simulate.py: 0.06% of the step at most on 1000
random draws, none without the slowdown). The streamed GPU steps' copies (`Plan.device_steps`)
it runs alone, not sharing the link: a lower bound too.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, replace

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

from lazytrain.errors import LazyTrainError
from lazytrain.plan.costs import RECOMPUTE_OPTIONS, CostTable
from lazytrain.plan.plan import CONST_UPDATES, GRAD_PLACES, LayerPlan, Plan, is_offload_window
from lazytrain.plan.simulate import STREAMED_STEP_SLOTS

MODE_LAYER = {
    "f": ("keep", "gpu"),
    "o": ("keep", "host"),
    "g": ("checkpoint", "gpu"),
    "p": ("checkpoint", "host"),
    "n": ("checkpoint", "nvme"),
    "d": ("drop", "gpu"),
}
GB = 1e9
GiB = 2**30
NVME_TAIL = 4
"""No NVMe checkpoint on the last NVME_TAIL layers."""
DEFAULT_MAX_SEGMENT = 8
"""Longest recompute segment (checkpoint + drop layers) the solver considers."""
_MARGIN_GB = 1e-6
"""Memory rows are tightened by this much so that solver tolerances never overshoot a cap."""


GRADIENT_CHOICES = (*GRAD_PLACES, "auto")
"""Where the CPU-stepped streamed layers' gradients wait (`solve_plan`'s ``gradients``): every
one on the host or on the GPU, or each where the program puts it (``auto``)."""


class PlanInfeasible(LazyTrainError, ValueError):
    """No plan fits the memory budgets; the message says how much GPU memory would do."""


class SolverTimeLimit(PlanInfeasible):
    """The solver found no plan within its time limit (one may exist): a caller searching
    batches treats it as the batch not fitting, and says which it was."""


def layer_mode(lp: LayerPlan) -> str:
    """The MILP mode letter of a layer plan (drop layers ignore their tier)."""
    if lp.mode == "drop":
        return "d"
    for m, (mode, tier) in MODE_LAYER.items():
        if (mode, tier) == (lp.mode, lp.tier):
            return m
    raise ValueError(f"layer mode {lp.mode!r} on tier {lp.tier!r} is not a MILP mode")


class _Expr:
    """A linear expression: {column: coefficient} + constant."""

    __slots__ = ("const", "terms")

    def __init__(self, terms: dict[int, float] | None = None, const: float = 0.0) -> None:
        self.terms = dict(terms or {})
        self.const = const

    def __add__(self, other: _Expr | float) -> _Expr:
        out = _Expr(self.terms, self.const)
        if isinstance(other, _Expr):
            for k, v in other.terms.items():
                out.terms[k] = out.terms.get(k, 0.0) + v
            out.const += other.const
        else:
            out.const += other
        return out

    __radd__ = __add__

    def __mul__(self, k: float) -> _Expr:
        return _Expr({c: v * k for c, v in self.terms.items()}, self.const * k)

    __rmul__ = __mul__

    def __sub__(self, other: _Expr | float) -> _Expr:
        return self + (-1.0) * other

    def __rsub__(self, other: float) -> _Expr:
        return (-1.0) * self + other

    def is_zero(self) -> bool:
        return self.const == 0 and not any(self.terms.values())


class _Model:
    def __init__(self) -> None:
        self.lb: list[float] = []
        self.ub: list[float] = []
        self.integer: list[int] = []
        self.cost: list[float] = []
        self.rows: list[tuple[dict[int, float], float, float]] = []
        self.objective_const = 0.0

    def var(
        self, lb: float = 0.0, ub: float = math.inf, integer: bool = False, cost: float = 0.0
    ) -> _Expr:
        self.lb.append(lb)
        self.ub.append(ub)
        self.integer.append(int(integer))
        self.cost.append(cost)
        return _Expr({len(self.lb) - 1: 1.0})

    def ge(self, lhs: _Expr | float, rhs: _Expr | float) -> None:
        """lhs >= rhs."""
        e = (_Expr() + lhs) - rhs
        terms = {k: v for k, v in e.terms.items() if v != 0}
        if terms:
            self.rows.append((terms, -e.const, math.inf))
        elif e.const < -1e-12:
            self.rows.append(({0: 0.0}, 1.0, math.inf))  # constant infeasible row

    def le(self, lhs: _Expr | float, rhs: _Expr | float) -> None:
        self.ge(rhs, lhs)

    def eq(self, lhs: _Expr, rhs: _Expr | float) -> None:
        e = lhs - rhs
        if not any(e.terms.values()):
            if abs(e.const) > 1e-12:
                self.rows.append(({0: 0.0}, 1.0, math.inf))
            return
        self.rows.append(({k: v for k, v in e.terms.items() if v != 0}, -e.const, -e.const))

    def solve(self, time_limit_s: float, mip_rel_gap: float):
        n = len(self.lb)
        r, c, v, lo, hi = [], [], [], [], []
        for i, (terms, lb, ub) in enumerate(self.rows):
            for col, coef in terms.items():
                r.append(i)
                c.append(col)
                v.append(coef)
            lo.append(lb)
            hi.append(ub)
        a = coo_matrix((v, (r, c)), shape=(len(self.rows), n)).tocsr()
        problem = {
            "c": np.array(self.cost),
            "integrality": np.array(self.integer),
            "bounds": Bounds(np.array(self.lb), np.array(self.ub)),
            "constraints": LinearConstraint(a, np.array(lo), np.array(hi)),
        }
        options = {"time_limit": time_limit_s, "mip_rel_gap": mip_rel_gap, "disp": False}
        res = milp(**problem, options=options)
        if res.status == 4:
            # HiGHS' presolve has failed with "Solve error" on a feasible program (the 14B
            # table at batch 62, bench/results/costs_qwen2.5-14b_h200_2026-12-01_*): without it
            # the same program solves
            res = milp(**problem, options={**options, "presolve": False})
        return res


@dataclass(slots=True)
class _Built:
    model: _Model
    layer_modes: list[dict[str, _Expr]]
    variants: list[dict[tuple[str, str], _Expr]]
    """Per layer, (f or o, recompute option) -> its binary."""
    segments: dict[tuple[int, int], _Expr]
    gpu_var: _Expr | None
    num_binaries: int
    grads: list[_Expr]
    """Per layer, 1 where its gradient is held on the GPU (`LayerPlan.grad`)."""


def _allowed(costs: CostTable, tiers: tuple[str, ...], i: int) -> set[str]:
    """Mode letters layer i may take."""
    L = costs.num_layers
    allowed = {"f", "g", "d"}
    if "host" in tiers and costs.host_bytes > 0 and i < L - 1:
        allowed |= {"o", "p"}
    if "nvme" in tiers and costs.nvme_bytes > 0 and i < L - NVME_TAIL:
        allowed.add("n")
    if i == 0:
        allowed.discard("d")
    if "gpu" not in tiers:
        allowed -= {"f", "g"}
    return allowed


def _build(
    costs: CostTable,
    *,
    gpu_bytes: float | None,
    tiers: tuple[str, ...],
    overlap: bool,
    max_segment: int,
    device: bool = False,
    device_layers: int = 0,
    device_steps: int = 0,
    fixed: Plan | None = None,
    memory: bool = True,
    minimize_gpu: bool = False,
    recompute: tuple[str, ...] = RECOMPUTE_OPTIONS,
    offload_window: int = 1,
    gradients: str = "host",
    hold_grads: tuple[int, ...] = (),
) -> _Built:
    """The MILP, in ms and GB. ``device``: the embedding and head stepped on the GPU
    (``const_update="device"``), with the first ``device_layers`` decoder layers resident there
    and the next ``device_steps`` streamed but stepped there (`Plan.device_steps`).
    ``fixed`` pins every decision to that plan's (evaluation). ``offload_window``
    (`Plan.offload_window`): a host-tier offload's copy may be split over that many stages
    after its layer's (never past the head), its GPU memory counted through all but the last.
    ``memory=False`` leaves out the memory rows; ``minimize_gpu`` minimises the GPU memory
    (``gpu_var``) instead of the step time. ``gradients`` (`GRADIENT_CHOICES`): where the
    CPU-stepped streamed layers' gradients wait (`_add_gradient_rows`); ``hold_grads``: layers
    whose gradients must be held on the GPU (they have no host buffer)."""
    prog = _Program(costs, tiers=tiers, overlap=overlap, max_segment=max_segment, device=device,
                    device_layers=device_layers, device_steps=device_steps, fixed=fixed,
                    minimize_gpu=minimize_gpu, recompute=recompute, offload_window=offload_window,
                    gradients=gradients, hold_grads=hold_grads)
    _add_partition_rows(prog)
    _add_gradient_rows(prog)
    _add_checkpoint_tier_rows(prog)
    _add_offload_rows(prog)
    t_embed, t_fwd = _add_forward_stage_rows(prog)
    _add_head_stage_rows(prog)
    _add_backward_stage_rows(prog)
    _add_update_rows(prog, t_embed, t_fwd)
    gpu_var = None
    if memory:
        budget = _gpu_budget(prog, gpu_bytes, minimize_gpu)
        kept_before = _add_forward_memory_rows(prog, budget)
        _add_head_memory_rows(prog, budget, kept_before)
        _add_backward_memory_rows(prog, budget, kept_before)
        _add_tier_capacity_rows(prog)
        gpu_var = budget.gpu_var
    return _Built(model=prog.m, layer_modes=prog.modes, variants=prog.variants, segments=prog.seg,
                  gpu_var=gpu_var, num_binaries=prog.num_binaries, grads=prog.q)


def _span(values: list[float], lo: int, hi: int) -> float:
    """sum(values[lo..hi]), inclusive; 0 when empty."""
    return float(sum(values[lo : hi + 1]))


def _total(terms) -> _Expr:
    return sum(terms, _Expr())


class _Program:
    """The program as `_build` makes it, in ms and GB: the model, the table's numbers per layer,
    the decisions and the expressions the families of rows share. Columns and rows are numbered
    as they are made, so the ``_add_*_rows`` functions run in `_build`'s order.

    Notation of the row families' docstrings (layer i, segment [a, e)): ``w_i`` weights as
    streamed (0 for a resident layer), ``x_i`` input, ``A_i`` saved bytes of a whole kept layer,
    ``A_i,r`` / ``R_i,r`` / ``Wf_i,r`` / ``Wb_i,r`` saved bytes / block re-forward / forward
    and backward working sets of keep variant r ("none" or a block it recomputes), ``Wf_i`` /
    ``Wb_i`` the whole layer's, ``F_i`` / ``Bw_i`` / ``Rc_i`` forward / backward / re-forward ms;
    binaries ``f_i,r``, ``o_i,r`` (f_i, o_i their sums), ``g_i``, ``p_i``, ``n_i``, ``s[a,e]``,
    ``q_i`` (layer i's gradient held on the GPU) with ``G_i`` its bytes and ``Q_i`` = sum_{j >= i}
    q_j G_j (`_add_gradient_rows`);
    ``B_h``, ``B_d``, ``B_bi``, ``B_nr``, ``B_nw`` the H2D, D2H, both-ways, NVMe read and write
    rates; ``sigma`` the compute slowdown under copies, ``kappa = 1 - 1/sigma``."""

    def __init__(
        self,
        costs: CostTable,
        *,
        tiers: tuple[str, ...],
        overlap: bool,
        max_segment: int,
        device: bool,
        device_layers: int,
        device_steps: int,
        fixed: Plan | None,
        minimize_gpu: bool,
        recompute: tuple[str, ...],
        offload_window: int,
        gradients: str = "host",
        hold_grads: tuple[int, ...] = (),
    ) -> None:
        if gradients not in GRADIENT_CHOICES:
            raise ValueError(f"gradients must be one of {GRADIENT_CHOICES}, got {gradients!r}")
        self.gradients, self.hold_grads = gradients, frozenset(hold_grads)
        c = self.c = costs
        L = self.L = c.num_layers
        self.m = _Model()
        lay = self.lay = c.layers
        self.overlap, self.device, self.offload_window = overlap, device, offload_window
        self.device_layers, self.device_steps = device_layers, device_steps
        # weights as streamed: a resident layer's are on the GPU all along (in the fixed part)
        self.w = [0.0 if i < device_layers else lc.weight_bytes / GB for i, lc in enumerate(lay)]
        self.on_gpu = device_layers + device_steps  # layers below it are stepped on the GPU
        self.resident_grads = [lc.weight_bytes / GB * c.grad_share if i < device_layers else 0.0
                               for i, lc in enumerate(lay)]
        self.x = [lc.input_bytes / GB for lc in lay]
        self.a = [lc.saved_bytes / GB for lc in lay]
        self.wf = [lc.forward_work_bytes / GB for lc in lay]
        self.wb = [lc.backward_work_bytes / GB for lc in lay]
        self.fw = [lc.forward_ms for lc in lay]
        self.ch, self.cd, self.cbi = 1e3 / c.h2d_gbps, 1e3 / c.d2h_gbps, 1e3 / c.bidir_gbps
        self.cnr, self.cnw = 1e3 / c.nvme_read_gbps, 1e3 / c.nvme_write_gbps
        self.kappa = 1.0 - 1.0 / c.copy_slowdown
        self.time_cost = 0.0 if minimize_gpu else 1.0
        self.allowed = [_allowed(c, tiers, i) for i in range(L)]
        # per layer, the ways to keep it: "none" (all saved tensors) and each block it may recompute
        self.options = [["none", *(k for k in recompute if k in lc.recompute_options)] for lc in lay]
        self.kept = [{k: lc.kept(k) for k in self.options[i]} for i, lc in enumerate(lay)]
        self.max_segment = max_segment
        self.fixed = fixed
        self.fixed_letter: list[str | None] = [None] * L
        self.fixed_option: list[str] = ["none"] * L
        self.fixed_segments: set[tuple[int, int]] = set()
        if fixed is not None:
            for i, lp in enumerate(fixed.layers):
                self.fixed_letter[i] = layer_mode(lp)
                self.fixed_option[i] = lp.recompute
                if self.fixed_letter[i] not in self.allowed[i] or lp.recompute not in self.options[i]:
                    raise ValueError(
                        f"layer {i}: {lp.mode}/{lp.tier} recomputing {lp.recompute!r} is not a mode "
                        "the MILP offers there"
                    )
            self.fixed_segments = {
                (s, e) for s, e in fixed.segments() if fixed.layers[s].mode == "checkpoint"
            }
            self.max_segment = max([e - s for s, e in self.fixed_segments] + [1])
        self.num_binaries = 0
        # the decisions (`_add_partition_rows`)
        self.variants: list[dict[tuple[str, str], _Expr]] = []
        """Per layer, (f or o, recompute option) -> its binary."""
        self.modes: list[dict[str, _Expr]] = []
        self.f: list[_Expr] = []
        self.o: list[_Expr] = []
        self.g: list[_Expr] = []
        self.p: list[_Expr] = []
        self.n: list[_Expr] = []
        self.seg: dict[tuple[int, int], _Expr] = {}
        self.covering: list[list[tuple[int, int]]] = []
        """Per layer, the segments it is in."""
        self.ending: list[list[tuple[int, int]]] = []
        """Per e in 0..L, the segments [a, e)."""
        # products of a segment and its checkpoint's tier (`_add_checkpoint_tier_rows`)
        self.held: dict[tuple[int, int], _Expr] = {}
        self.on_nvme: dict[tuple[int, int], _Expr] = {}
        # the forward's offloads (`_add_offload_rows`)
        self.d2h_in: list[_Expr] = []
        """D2H bytes of each forward stage i (1..L-1) and the head (L)."""
        self.held_on: list[_Expr] = []
        """Host-tier offloads still on the GPU at forward stage i beyond their own (the window)."""
        # the gradients (`_add_gradient_rows`)
        self.grad_gb = [wi * c.grad_share for wi in self.w]
        """G_i: GB of layer i's gradient (this rank's share; 0 for a resident layer, counted apart)."""
        self.q: list[_Expr] = []
        self.held_from: list[_Expr] = []
        """Q_i for i = 0..L (Q_L = 0), running-sum columns."""

    # -- decisions and the expressions over them --------------------------------------------

    def binary(self, ok: bool, pinned: bool | None) -> _Expr:
        """A decision: 0 where not ``ok``, the constant ``pinned`` where given, else a binary."""
        if not ok:
            return _Expr()
        if pinned is not None:
            return _Expr(const=float(pinned))
        self.num_binaries += 1
        return self.m.var(0, 1, integer=True)

    def pin(self, i: int, letter: str, option: str = "none") -> bool | None:
        if self.fixed_letter[i] is None:
            return None
        return self.fixed_letter[i] == letter and self.fixed_option[i] == option

    def by_option(self, i: int, letters: str, value) -> _Expr:
        """Sum over layer i's keep variants with a letter in ``letters`` of their binary times
        ``value`` of the variant's `RecomputeCosts`."""
        return _total(v * value(self.kept[i][opt]) for (k, opt), v in self.variants[i].items() if k in letters)

    def saved(self, i: int, letters: str) -> _Expr:
        """GB kept by layer i when it is kept with a letter in ``letters``."""
        return self.by_option(i, letters, lambda r: r.saved_bytes / GB)

    def not_keep(self, i: int) -> _Expr:
        return 1.0 - self.f[i] - self.o[i]

    def gpu_kept(self, i: int) -> _Expr:
        """GB layer i holds on the GPU from its forward to its backward."""
        return self.saved(i, "f") + self.g[i] * self.x[i]

    def offload(self, i: int) -> _Expr:
        """GB layer i sends to the host or NVMe in its forward."""
        return self.saved(i, "o") + (self.p[i] + self.n[i]) * self.x[i]

    def unit_bytes(self, i: int) -> _Expr:
        """Weights + host/NVMe tensors of the unit ending at layer i-1 (fetched before it)."""
        w = self.w
        keep = (self.f[i - 1] + self.o[i - 1]) * w[i - 1] + self.saved(i - 1, "o")
        return keep + _total(self.seg[u] * _span(w, u[0], i - 1) + self.held[u] * self.x[u[0]]
                             for u in self.ending[i])

    def unit_nvme(self, i: int) -> _Expr:
        """NVMe bytes of the unit ending at layer i-1."""
        return _total(self.on_nvme[u] * self.x[u[0]] for u in self.ending[i])

    def rebuild_ms(self, i: int) -> _Expr:
        """Re-forward of a segment ending at layer i, paid by its first backward stage."""
        return _total(self.seg[u] * _span(self.fw, u[0], i - 1) for u in self.ending[i + 1])

    def unit_options(self, i: int) -> list[tuple[_Expr, float, float]]:
        """(indicator, H2D bytes, bytes already counted) per way the unit ending at layer i-1
        can look; the indicators are exclusive (the held parts refine their segment's)."""
        w = self.w
        opts = [(self.f[i - 1], w[i - 1], 0.0)]
        opts += [
            (v, w[i - 1] + self.kept[i - 1][opt].saved_bytes / GB, 0.0)
            for (k, opt), v in self.variants[i - 1].items()
            if k == "o"
        ]
        for u in self.ending[i]:
            weights = _span(w, u[0], i - 1)
            opts.append((self.seg[u], weights, 0.0))
            opts.append((self.held[u], weights + self.x[u[0]], weights))
        return [opt for opt in opts if not opt[0].is_zero()]

    # -- stage times --------------------------------------------------------------------------

    def head_upload(self) -> float:
        """GB of the head's new weights (`CostTable.const_split`) copied in the last forward
        stage: overlapped and stepped on the host, they are copied then, as a layer's are in
        the stage before its own (0 otherwise)."""
        return self.c.const_split()[1][1] / GB if self.overlap and not self.device else 0.0

    def named(self, e: _Expr | float) -> _Expr:
        """A column equal to e when e has several terms: each appears in up to nine rows."""
        e = _Expr() + e
        if len(e.terms) <= 1:
            return e
        v = self.m.var()
        self.m.eq(v, e)
        return v

    def stage(
        self, compute: _Expr | float, h2d: _Expr | float, d2h: _Expr | float, nvme_ms: _Expr | float = 0.0
    ) -> _Expr:
        """A stage's time ``t`` (objective coefficient 1, or 0 when minimising GPU memory), with
        ``h`` = ``h2d`` and ``d`` = ``d2h`` GB copied and ``C`` = ``compute`` ms::

            t >= C,  t >= nvme_ms,  and for each copy term X:  t >= X,  t >= C + kappa X

        X: h/B_h and d/B_d, and where both copy, h/B_bi + (d-h)/B_d and d/B_bi + (h-d)/B_h."""
        m = self.m
        t = m.var(cost=self.time_cost)
        h2d, d2h, compute = (self.named(e) for e in (h2d, d2h, compute))
        copies: list[_Expr] = []
        if not h2d.is_zero():
            copies.append(h2d * self.ch)
        if not d2h.is_zero():
            copies.append(d2h * self.cd)
        if len(copies) == 2:
            copies.append(h2d * self.cbi + (d2h - h2d) * self.cd)
            copies.append(d2h * self.cbi + (h2d - d2h) * self.ch)
        for term in copies:
            m.ge(t, term)
            if self.kappa > 0:
                m.ge(t, compute + self.kappa * term)
        m.ge(t, compute)
        m.ge(t, nvme_ms)
        return t

    def stage_ms(self, compute: float, h2d: float, d2h: float) -> float:
        """Exact time of one stage whose streams start together (numbers, GB)."""
        ch, cd, cbi = self.ch, self.cd, self.cbi
        if h2d > 0 and d2h > 0:
            copy = max(
                h2d * ch, d2h * cd, h2d * cbi + (d2h - h2d) * cd, d2h * cbi + (h2d - d2h) * ch
            )
        else:
            copy = h2d * ch + d2h * cd
        return max(compute + self.kappa * copy, copy) if copy > 0 else compute

    def hull(self, t: _Expr, base: _Expr | float, ref_ms: float, options, d2h: float,
             relax: _Expr | None = None) -> None:
        """t >= base + the exact extra time each option's copy adds to a stage computing at
        least ref_ms. Valid for any plan, exact at integer points with compute ref_ms, and much
        tighter than the max rows in the LP relaxation (a fraction of an offload cannot hide in
        a stage's slack). With ``relax`` (a binary) the row holds where it is 0: the largest
        gain is taken off where it is 1 (the options exclude each other, and t >= base holds
        anyway)."""
        extra = _Expr() + base
        gains = []
        for ind, nbytes, counted in options:
            gain = self.stage_ms(ref_ms, nbytes, d2h) - self.stage_ms(ref_ms, counted, d2h)
            gains.append(gain)
            extra = extra + ind * gain
        if relax is not None:
            extra = extra - relax * max(gains, default=0.0)
        self.m.ge(t, extra)

    def grad_hulls(self, t: _Expr, base: _Expr | float, ref_ms: float, options, i: int) -> None:
        """`hull` rows of backward stage i, whose copy out is layer i+1's gradient unless the
        GPU holds it: one row for each case, each relaxed where the other holds."""
        full = self.grad_gb[i + 1] if i + 1 < self.L else 0.0
        q = self.q[i + 1] if i + 1 < self.L else _Expr()
        if q.terms:
            self.hull(t, base, ref_ms, options, full, relax=q)
            self.hull(t, base, ref_ms, options, 0.0, relax=1.0 - q)
        else:
            self.hull(t, base, ref_ms, options, full * (1.0 - q.const))


def _add_partition_rows(prog: _Program) -> None:
    """The decisions, and the rows that make each layer take exactly one mode::

        f_i = sum_r f_i,r,  o_i = sum_r o_i,r
        f_i + o_i + sum_{[a,e) containing i} s[a,e] = 1
        g_i + p_i + n_i = sum_e s[i,e]

    A segment [a, e) (a checkpoint at a, then e-a-1 drop layers) exists for e - a <= max_segment
    where a may be a checkpoint and a+1..e-1 may drop. Pinned decisions (``fixed``) are
    constants."""
    L, allowed, options, m = prog.L, prog.allowed, prog.options, prog.m
    # keep variants (letter f or o, option): f_i and o_i are their sums
    prog.variants = [
        {(k, opt): prog.binary(k in allowed[i], prog.pin(i, k, opt)) for k in "fo" for opt in options[i]}
        for i in range(L)
    ]
    prog.modes = [
        {
            **{k: sum((v for (kk, _), v in prog.variants[i].items() if kk == k), _Expr()) for k in "fo"},
            **{k: prog.binary(k in allowed[i], prog.pin(i, k)) for k in "gpn"},
        }
        for i in range(L)
    ]
    prog.f, prog.o, prog.g, prog.p, prog.n = ([prog.modes[i][k] for i in range(L)] for k in "fogpn")
    seg = prog.seg
    for s in range(L):
        if not allowed[s] & {"g", "p", "n"}:
            continue
        for e in range(s + 1, min(L, s + prog.max_segment) + 1):
            if any("d" not in allowed[i] for i in range(s + 1, e)):
                break
            seg[s, e] = prog.binary(True, None if prog.fixed is None else (s, e) in prog.fixed_segments)
    prog.covering = [[] for _ in range(L)]
    prog.ending = [[] for _ in range(L + 1)]
    for s, e in seg:
        prog.ending[e].append((s, e))
        for i in range(s, e):
            prog.covering[i].append((s, e))
    f, o, g, p, n = prog.f, prog.o, prog.g, prog.p, prog.n
    for i in range(L):
        m.eq(f[i] + o[i] + sum((seg[u] for u in prog.covering[i]), _Expr()), 1.0)
        m.eq(g[i] + p[i] + n[i], sum((seg[u] for u in seg if u[0] == i), _Expr()))


def _add_gradient_rows(prog: _Program) -> None:
    """Where each streamed layer's gradient waits until the clip coefficient is known
    (`LayerPlan.grad`): ``q_i`` = 1 held on the GPU, 0 copied out to its host buffer in the
    stage after its backward (0 for resident layers, whose gradients the device step places). A
    held gradient costs no copy out in the backward and, where `CostTable.host_grads` is False,
    none of the host's room; on the GPU it lives from its backward to the end of the step and,
    with the overlapped update, through the next forward until its layer's update: a CPU-stepped
    layer's is copied home through a small pinned ring (`runtime.update`) in the forward's
    order, layer j's before layer j's forward runs; a GPU-stepped streamed layer's
    (`Plan.device_steps`) is stepped from where it is, its state streamed in without it (the
    streamed steps' times here still count its copy in: an upper bound; the simulator's do
    not)::

        Q_i = q_i G_i + Q_{i+1},  Q_L = 0

    The ring's copies run on the D2H stream during the next forward, which carries only the
    forward's offloads, and a layer's CPU step waits for its own copy (G_j / B_d, ~14 ms for a
    27B layer against its ~0.2 s step): neither this model nor the simulator times them."""
    L, m = prog.L, prog.m
    choice = prog.gradients
    prog.q = []
    for i in range(L):
        if i < prog.device_layers:
            prog.q.append(_Expr())
            continue
        pinned = None if choice == "auto" else choice == "gpu"
        if i in prog.hold_grads:
            pinned = True
        if prog.fixed is not None:
            pinned = prog.fixed.layers[i].grad == "gpu"
        prog.q.append(prog.binary(pinned is not False, pinned))
    held = [_Expr()]
    for i in reversed(range(L)):
        term = prog.q[i] * prog.grad_gb[i]
        if term.is_zero():
            held.append(held[-1])
            continue
        v = m.var()
        m.eq(v, held[-1] + term)
        held.append(v)
    prog.held_from = held[::-1]


def _add_checkpoint_tier_rows(prog: _Program) -> None:
    """The off-GPU checkpoint of a segment (tier host or NVMe) and its NVMe part: products of a
    segment and its start's tier, bounded from below (they only ever cost)::

        held[a,e] >= s[a,e] - g_a,  on_nvme[a,e] >= s[a,e] - g_a - p_a  (both >= 0)"""
    m, g, p, n = prog.m, prog.g, prog.p, prog.n
    for (s, e), v in prog.seg.items():
        prog.held[s, e] = _Expr()
        prog.on_nvme[s, e] = _Expr()
        if not (p[s].is_zero() and n[s].is_zero()):
            prog.held[s, e] = m.var()
            m.ge(prog.held[s, e], v - g[s])
        if not n[s].is_zero():
            prog.on_nvme[s, e] = m.var()
            m.ge(prog.on_nvme[s, e], v - g[s] - p[s])


def _add_offload_rows(prog: _Program) -> None:
    """The D2H bytes of each forward stage i (1..L-1) and the head (L), ``d2h_i``: with
    ``offload_window`` 1 the offload of layer i-1, ``O_{i-1} + n_{i-1} x_{i-1}`` where
    ``O_j = sum_r o_j,r A_j,r + p_j x_j`` is its host-tier part. With a window W > 1 a host-tier
    offload's copy is split over the stages it may span (continuous splits: a FIFO copy stream
    meets the same deadlines whenever any split does)::

        sum_{k < W_j} part_j,k = O_j,  W_j = min(W, L - j)
        d2h_i = n_{i-1} x_{i-1} + sum_{j + 1 + k = i} part_j,k

    and ``O_j`` stays on the GPU through forward stages j+1 .. j+W_j-1 (``held_on``)."""
    L, m, p, n, x = prog.L, prog.m, prog.p, prog.n, prog.x
    held_on = prog.held_on = [_Expr() for _ in range(L + 1)]
    if prog.offload_window == 1:
        prog.d2h_in = [_Expr()] + [prog.offload(i - 1) for i in range(1, L + 1)]
        return
    d2h_in = prog.d2h_in = [_Expr() for _ in range(L + 1)]
    for j in range(L):
        host_out = prog.saved(j, "o") + p[j] * x[j]
        d2h_in[j + 1] = d2h_in[j + 1] + n[j] * x[j]
        span_j = min(prog.offload_window, L - j)
        if host_out.is_zero() or span_j == 1:
            d2h_in[j + 1] = d2h_in[j + 1] + host_out
            continue
        parts = [m.var() for _ in range(span_j)]
        m.eq(_total(parts), host_out)
        for k, part in enumerate(parts):
            d2h_in[j + 1 + k] = d2h_in[j + 1 + k] + part
        for i in range(j + 1, j + span_j):
            held_on[i] = held_on[i] + host_out


def _add_forward_stage_rows(prog: _Program) -> tuple[_Expr, list[_Expr]]:
    """The embedding's and each layer's forward stage (`_Program.stage`); returns their times.

    Embedding: C = its forward (+ the GPU step of the device groups, with ``optimizer_overlap``),
    h = w_0. Layer i: C = F_i, h = w_{i+1} (the next layer's prefetch; none after the last),
    d = d2h_i, NVMe = n_{i-2} x_{i-2}/B_nw (the write behind the copy out) and, in the last
    layer's stage, the reads of the head's unit. With ``offload_window`` 1 a hull row gives each
    offload of layer i-1 its exact extra time (T: `_Program.stage_ms`)::

        t_i >= T(F_i, w_{i+1}, 0) + (p_{i-1} + n_{i-1}) (T(F_i, w_{i+1}, x_{i-1}) - T(F_i, w_{i+1}, 0))
                                  + sum_r o_{i-1,r} (T(F_i, w_{i+1}, A_{i-1,r}) - T(F_i, w_{i+1}, 0))"""
    c, L, w, x, fw, n = prog.c, prog.L, prog.w, prog.x, prog.fw, prog.n
    # stepped on the GPU with the overlap, the embedding and head go ahead of the embedding forward
    # (the stage's copies start with them: the executor does not wait for the GPU step)
    device_ms = c.device_update_ms(prog.device_layers) if prog.device else 0.0
    t_embed = prog.stage(c.embed_forward_ms + (device_ms if prog.overlap else 0.0), w[0], 0.0)
    head_upload = prog.head_upload()
    t_fwd = []
    for i in range(L):
        nvme_ms = n[i - 2] * (x[i - 2] * prog.cnw) if i >= 2 else _Expr()
        if i == L - 1:
            nvme_ms = nvme_ms + prog.unit_nvme(L) * prog.cnr
        h2d = w[i + 1] if i + 1 < L else head_upload
        t_fwd.append(prog.stage(fw[i], h2d, prog.d2h_in[i] if i > 0 else 0.0, nvme_ms))
        if i > 0 and prog.offload_window == 1:  # (with splits an offload need not land in one stage)
            base = prog.stage_ms(fw[i], h2d, 0.0)
            offloads = [(prog.p[i - 1] + n[i - 1], x[i - 1])]
            offloads += [
                (v, prog.kept[i - 1][opt].saved_bytes / GB)
                for (k, opt), v in prog.variants[i - 1].items()
                if k == "o"
            ]
            prog.m.ge(
                t_fwd[-1],
                base + _total(ind * (prog.stage_ms(fw[i], h2d, nbytes) - base) for ind, nbytes in offloads),
            )
    return t_embed, t_fwd


def _add_head_stage_rows(prog: _Program) -> None:
    """The head's stage: C = the final norm + head + loss, h = the last unit's bytes
    (`_Program.unit_bytes`: the backward's first prefetch), d = d2h_L, NVMe = the unit's reads
    and layer L-2's write. Where the last layer offloads nothing, a hull row over the unit's
    shapes (`_Program.unit_options`)."""
    c, L, n, x = prog.c, prog.L, prog.n, prog.x
    head_nvme = prog.unit_nvme(L - 1) * prog.cnr + (n[L - 2] * (x[L - 2] * prog.cnw) if L >= 2 else 0.0)
    t_head = prog.stage(c.head_ms, prog.unit_bytes(L), prog.d2h_in[L], head_nvme)
    if prog.offload(L - 1).is_zero():
        prog.hull(t_head, c.head_ms, c.head_ms, prog.unit_options(L), 0.0)


def _add_backward_stage_rows(prog: _Program) -> None:
    """Each layer's backward stage, and the embedding's. Layer i::

        C = Bw_i + Rc_i (1 - f_i - o_i) + sum_r (f_i,r + o_i,r) R_i,r
            + sum_{[a, i+1), a < i} s[a,i+1] (F_a + ... + F_{i-1})     (a segment's rebuild)
        h = U_i (the next unit's weights and off-GPU tensors, `_Program.unit_bytes`; none at 0)
        d = (1 - q_{i+1}) G_{i+1} (the gradient of the layer after it, unless held),  NVMe = the unit's reads

    with hull rows over the unit's shapes (`_Program.hull`) at the computes a stage that
    prefetches can have: Bw_i + its largest re-forward, Bw_i, and Bw_i + each block's. The embedding's: its backward, d = (1 - q_0) G_0 + the
    head's and embedding's gradients (where stepped on the host) x grad_share."""
    c, L, lay, options, kept = prog.c, prog.L, prog.lay, prog.options, prog.kept
    prefetch = [_Expr()] + [prog.unit_bytes(i) for i in range(1, L)]
    for i in range(L):
        bw, rc = lay[i].backward_ms, lay[i].recompute_ms
        not_keep = prog.not_keep(i)
        block_ms = prog.by_option(i, "fo", lambda r: r.recompute_ms)
        compute = bw + rc * not_keep + block_ms + prog.rebuild_ms(i)
        grad_out = (1.0 - prog.q[i + 1]) * prog.grad_gb[i + 1] if i + 1 < L else 0.0
        nvme_ms = prog.unit_nvme(i - 1) * prog.cnr if i >= 2 else 0.0
        t = prog.stage(compute, prefetch[i], grad_out, nvme_ms)
        if i > 0:
            # A stage that prefetches ends its unit (a unit of one layer: no rebuild): it
            # computes bw, bw + a block's re-forward (keep) or bw + rc. Each hull holds for a
            # compute up to its reference.
            most = max(rc, *(kept[i][opt].recompute_ms for opt in options[i]))
            prog.grad_hulls(t, compute, bw + most, prog.unit_options(i), i)
            prog.grad_hulls(t, compute - rc * not_keep - block_ms, bw, prog.unit_options(i), i)
            for opt in options[i][1:]:
                # exact for a kept layer recomputing opt; below the truth for the others
                ind = _total(v for (_, k), v in prog.variants[i].items() if k == opt)
                r = kept[i][opt].recompute_ms
                if not ind.is_zero():
                    base = compute - rc * not_keep - block_ms + r * ind
                    prog.grad_hulls(t, base, bw + r, prog.unit_options(i), i)
    const_grads = 0.0 if prog.device else c.const_grad_bytes / GB  # stepped on the GPU: no copy out
    prog.stage(c.embed_backward_ms, 0.0, (1.0 - prog.q[0]) * prog.grad_gb[0] + const_grads * c.grad_share)


def _add_update_rows(prog: _Program, t_embed: _Expr, t_fwd: list[_Expr]) -> None:
    """The optimizer step's share of the step time (``objective_const``) and, with
    ``optimizer_overlap``, the rows that make the forward wait for it. The previous step's CPU
    update runs first: the embedding, then layer 0, 1, ..., then the final norm + head
    (`CostTable.const_split`; stepped on the GPU, the layers only); layer j's weights are copied
    only after its update, the head's before the head runs. With ``ns`` the update's ms per
    parameter, ``start`` = ns P_embedding + its weights / B_h (the constant)::

        t_embed + t_fwd_0 + ... + t_fwd_{j-1} >= ns (P_emb + the CPU-stepped P_0 .. P_j) + w_j/B_h - start
        (a layer stepped on the GPU but streamed: its bytes back on the host instead,
        `_streamed_steps_done`)
        t_embed + sum_j t_fwd_j >= ns (P_emb + sum_j P_j + P_head) + w_head/B_h - start

    Resident layers take no CPU time, and their forward waits for nothing. Without the overlap
    the update follows the step: the CPU's optimizer time and the weights of the embedding and
    head back, or (``const_update="device"``) the CPU's layers beside the GPU's steps."""
    c, L, lay, w, m = prog.c, prog.L, prog.lay, prog.w, prog.m
    device, device_layers, device_steps = prog.device, prog.device_layers, prog.device_steps
    if prog.overlap:
        ns = c.optimizer_ns_per_param * 1e-6
        (first_params, first_bytes), (head_params, head_bytes) = (
            ((0, 0.0), (0, 0.0)) if device else c.const_split()
        )
        opt_done = ns * first_params
        start = opt_done + first_bytes / GB * prog.ch
        m.objective_const = start

        ch, cd, cbi, fw, overlap = prog.ch, prog.cd, prog.cbi, prog.fw, prog.overlap
        device_ms = c.device_update_ms(device_layers) if device else 0.0
        head_upload = prog.head_upload()

        def ready(before: _Expr, at: _Expr, done_ms: float, h: float, d: _Expr, early: float) -> None:
            # The stage from ``before`` to ``at`` (ms after ``start``) copies h GB in once the
            # update is done (``done_ms`` after the step's start) and d GB out from its start:
            # the next stage waits for the copy in, which shares the link with what is left of
            # the copy out then (at least d less what it copied alone). Valid for any start,
            # implied by the stage's own rows where it starts (``early``, at the soonest) after
            # the update is done.
            m.ge(at, done_ms + h * ch - start)
            if h <= 0 or d.is_zero() or done_ms - start <= early:
                return
            rest = m.var()
            m.ge(rest, d - (done_ms - start - before) * (1.0 / cd))
            for copies in (rest * cd, h * cbi + (rest - h) * cd, rest * cbi + (h - rest) * ch):
                m.ge(at, done_ms - start + copies)

        elapsed, before = t_embed, _Expr()
        # the soonest each stage may start (ms after ``start``): its predecessors' compute and
        # copies in alone
        early = [0.0, prog.stage_ms(c.embed_forward_ms + (device_ms if overlap else 0.0), w[0], 0.0)]
        for i in range(L):
            early.append(early[-1] + prog.stage_ms(fw[i], w[i + 1] if i + 1 < L else head_upload, 0.0))
        streamed_done = _streamed_steps_done(c, device_layers, device_steps)
        for j in range(L):
            out = prog.d2h_in[j - 1] if j else _Expr()  # the copy out of the stage before fwd j
            if j >= prog.on_gpu:
                opt_done += ns * lay[j].params
                ready(before, elapsed, opt_done, w[j], out, early[j])
            elif j >= device_layers:
                ready(before, elapsed, streamed_done[j - device_layers], w[j], out, early[j])
            before, elapsed = elapsed, prog.named(elapsed + t_fwd[j])
        if head_params:
            ready(before, elapsed, opt_done + ns * head_params, head_bytes / GB, prog.d2h_in[L - 1], early[L])
    elif device:
        # the CPU steps the layers, then the GPU the embedding and head (`HostUpdater.start`)
        streamed = _streamed_steps_done(c, device_layers, device_steps)
        device_ms = c.device_update_ms(device_layers)
        # the streamed steps on their own streams, beside the embedding's and head's
        m.objective_const = (c.optimizer_ns_per_param * sum(lc.params for lc in lay[prog.on_gpu:]) * 1e-6
                             + max(device_ms, streamed[-1] if streamed else 0.0))
    else:
        m.objective_const = c.optimizer_ms + c.const_weight_bytes / GB * prog.ch


@dataclass(slots=True)
class _GpuBudget:
    """What every GPU memory row shares, in GB."""

    cap: _Expr | float
    """The budget less `_MARGIN_GB`, or the column minimised (``gpu_var``)."""
    gpu_var: _Expr | None
    step_fixed: float
    """Bytes held through the step (`CostTable.step_fixed_bytes`, the device groups')."""
    forward_fixed: float
    """... through the forward (`CostTable.forward_fixed_bytes`, the device groups')."""
    scratch: float
    """The streamed GPU steps' slots, until the last of them is stepped (in its forward)."""
    grads: float
    """The backward's gradient buffers."""


def _gpu_budget(prog: _Program, gpu_bytes: float | None, minimize_gpu: bool) -> _GpuBudget:
    c = prog.c
    gpu_var = None
    if minimize_gpu:
        gpu_var = prog.m.var(cost=1.0)
        cap: _Expr | float = gpu_var
    else:
        cap = (c.gpu_bytes if gpu_bytes is None else gpu_bytes) / GB - _MARGIN_GB
    device_gb = (c.const_update_bytes + c.device_resident_bytes(prog.device_layers)) / GB if prog.device else 0.0
    return _GpuBudget(
        cap=cap,
        gpu_var=gpu_var,
        step_fixed=c.step_fixed_bytes / GB + device_gb,
        forward_fixed=c.forward_fixed_bytes / GB + device_gb,
        scratch=_streamed_scratch_bytes(c, prog.device_layers, prog.device_steps) / GB,
        grads=c.grad_buffers * max(lc.weight_bytes for lc in prog.lay) / GB,
    )


def _add_forward_memory_rows(prog: _Program, budget: _GpuBudget) -> list[_Expr]:
    """GPU memory at the embedding and at each forward stage; returns ``K_i``, the GPU-kept
    bytes of layers < i (i = 0..L), as running-sum columns (keeps the matrix sparse)::

        K_{i+1} = K_i + sum_r f_i,r A_i,r + g_i x_i
        embedding:  fixed + scratch + w_0 + max(x_0, device groups' gradients) + Q_0 <= cap
        layer i:    fixed + scratch (while GPU steps are ahead) + w_i + w_{i+1} + K_i + Q_{i+1}
                    + x_i + sum_r (f_i,r + o_i,r) (A_i,r - x_i)     (its input and saved tensors)
                    + held_on_i + (1 - f_i - o_i) Wf_i + sum_r (f_i,r + o_i,r) Wf_i,r  <= cap

    Before the head no gradients of the embedding and head are held, and an offloaded tensor's
    GPU copy is freed in its own stage (or, with a window, at its copy's last stage). Held
    gradients (the Q terms) are there only with the overlapped update (without it the update
    ends before the step starts)."""
    m, L, w, x, cap = prog.m, prog.L, prog.w, prog.x, budget.cap
    kept_before = [_Expr()]
    for i in range(L):
        total_i = m.var()
        m.eq(total_i, kept_before[-1] + prog.gpu_kept(i))
        kept_before.append(total_i)
    # the embedding's output; stepped on the GPU, before it the update with their gradients
    held_grads = prog.c.const_grad_bytes / GB + sum(prog.resident_grads) if prog.device else 0.0
    held = prog.held_from if prog.overlap else [_Expr()] * (L + 1)
    m.le(budget.forward_fixed + budget.scratch + w[0] + max(x[0], held_grads) + held[0], cap)
    for i in range(L):
        current = x[i] + prog.saved(i, "fo") - (prog.f[i] + prog.o[i]) * x[i]
        m.le(
            budget.forward_fixed
            + (budget.scratch if i < prog.on_gpu else 0.0)
            + w[i]
            + (w[i + 1] if i + 1 < L else 0.0)
            + kept_before[i]
            + current
            + prog.held_on[i]
            + held[i + 1]
            # the forward's transient: a kept variant's own (under autograd, beyond its saved
            # tensors), else the no-grad forward's
            + prog.not_keep(i) * prog.wf[i]
            + prog.by_option(i, "fo", lambda r: r.forward_work_bytes / GB),
            cap,
        )
    return kept_before


def _add_head_memory_rows(prog: _Program, budget: _GpuBudget, kept_before: list[_Expr]) -> None:
    """GPU memory at the head, where every GPU-kept tensor is live::

        fixed + K_L + x_{L-1} + the head's working set + U_L <= cap

    and, under a cap, a cardinality cut from it: at most k layers fit kept on the GPU, k from
    the k smallest saved sizes (``sum_i f_i <= k``). Valid, and it spares the solver proving
    it by branching over interchangeable layers."""
    c, L, x, cap = prog.c, prog.L, prog.x, budget.cap
    prog.m.le(
        budget.forward_fixed
        + kept_before[L]
        + x[L - 1]
        + c.head_work_bytes / GB
        + prog.unit_bytes(L),
        cap,
    )
    if budget.gpu_var is None:
        room = cap - budget.forward_fixed - x[L - 1] - c.head_work_bytes / GB - prog.w[L - 1]
        sizes = sorted(
            min(prog.kept[i][opt].saved_bytes for opt in prog.options[i]) / GB
            for i in range(L)
            if not prog.f[i].is_zero()
        )
        k = int(np.searchsorted(np.cumsum(sizes), room, side="right"))
        if k < len(sizes):
            prog.m.le(_total(prog.f), float(k))


def _add_backward_memory_rows(prog: _Program, budget: _GpuBudget, kept_before: list[_Expr]) -> None:
    """GPU memory at each layer's backward stage, at each re-forward of a segment's rebuild,
    and at the embedding's backward. With ``G_i`` = the gradient buffers + the gradients of
    resident layers >= i (held from their backward on) + Q_i (the held gradients)::

        layer i:   fixed + K_i + cache_i + A_i + Wb_i
                   + sum_r (f_i,r + o_i,r) (A_i,r + Wb_i,r) - (f_i + o_i) (A_i + Wb_i)
                   + weights_i + G_i + U_i <= cap
        cache_i    = sum_{[a,e) containing i, a < i} s[a,e] (x_{a+1} + ... + x_{i-1}) + held[a,e] x_a
        weights_i  = (f_i + o_i) w_i + sum_{[a,e) containing i} s[a,e] (w_a + ... + w_i)
        rebuild of [a, i+1), a < i: fixed + K_i + G_i
            + sum s[a,i+1] (max_{a <= j < i} (x_{a+1} + ... + x_j + Wf_j) + w_a + ... + w_i)
            + held[a,i+1] x_a <= cap
        embedding: fixed + the gradient buffers and all resident layers' + its working set <= cap"""
    c, L, m, cap = prog.c, prog.L, prog.m, budget.cap
    w, x, a, wf, wb = prog.w, prog.x, prog.a, prog.wf, prog.wb
    f, o, seg, held = prog.f, prog.o, prog.seg, prog.held
    prefetch = [_Expr()] + [prog.unit_bytes(i) for i in range(1, L)]
    for i in range(L):
        weights = (f[i] + o[i]) * w[i] + _total(seg[u] * _span(w, u[0], i) for u in prog.covering[i])
        cache = _total(
            seg[u] * _span(x, u[0] + 1, i - 1) + held[u] * x[u[0]]
            for u in prog.covering[i]
            if u[0] < i
        )
        # a kept layer's backward holds its option's saved bytes and working set
        kept_work = prog.by_option(i, "fo", lambda r: (r.saved_bytes + r.backward_work_bytes) / GB)
        kept_work = kept_work - (f[i] + o[i]) * (a[i] + wb[i])
        # resident layers' gradients, from their backward on
        grads_i = budget.grads + sum(prog.resident_grads[i:]) + prog.held_from[i]
        m.le(
            budget.step_fixed
            + kept_before[i]
            + cache
            + a[i]
            + wb[i]
            + kept_work
            + weights
            + grads_i
            + prefetch[i],
            cap,
        )
        rebuilds = [u for u in prog.ending[i + 1] if u[0] < i]
        if rebuilds:
            # Each re-forward j of the rebuild: inputs rebuilt so far + its working set,
            # with every weight of the segment loaded.
            peak = _total(
                seg[u]
                * (max(_span(x, u[0] + 1, j) + wf[j] for j in range(u[0], i)) + _span(w, u[0], i))
                + held[u] * x[u[0]]
                for u in rebuilds
            )
            m.le(budget.step_fixed + kept_before[i] + peak + grads_i, cap)
    m.le(budget.step_fixed + budget.grads + sum(prog.resident_grads) + prog.held_from[0]
         + c.embed_backward_work_bytes / GB, cap)


def _add_tier_capacity_rows(prog: _Program) -> None:
    """Host and NVMe bytes within their totals (all offloaded tensors are resident at the
    head), where `CostTable.host_grads` is False with the host gradient buffers of the streamed
    layers whose gradients are not held on the GPU::

        sum_i (sum_r o_i,r A_i,r + p_i x_i) [+ sum_{i streamed} (1 - q_i) G_i] <= host,
        sum_i n_i x_i <= NVMe"""
    c, L, x = prog.c, prog.L, prog.x
    grads = _Expr() if c.host_grads else _total((1.0 - prog.q[i]) * prog.grad_gb[i] for i in range(L))
    prog.m.le(
        _total(prog.saved(i, "o") + prog.p[i] * x[i] for i in range(L)) + grads,
        max(c.host_bytes / GB - _MARGIN_GB, 0.0),
    )
    prog.m.le(_total(prog.n[i] * x[i] for i in range(L)), max(c.nvme_bytes / GB - _MARGIN_GB, 0.0))


def _streamed_steps_done(c: CostTable, device_layers: int, device_steps: int) -> list[float]:
    """When each streamed GPU step (`Plan.device_steps`) has its bytes back on the host, in ms
    from the step's start, as the simulator runs them alone: copies in one after another, each
    into a slot its layer but `STREAMED_STEP_SLOTS` before has left, stepped, copied out behind
    it; a copy at its direction's rate, or the bidirectional one while the other runs too (the
    step's other copies are not counted)."""
    layers = list(range(device_layers, device_layers + device_steps))
    left = {"in": [c.streamed_in_bytes(j) / GB for j in layers], "step": [c.streamed_step_ms(j) for j in layers],
            "out": [c.streamed_out_bytes(j) / GB for j in layers]}
    done: list[float] = []
    head = {"in": 0, "step": 0, "out": 0}
    t = 0.0
    while len(done) < len(layers):
        n_in, n_step, n_out = head["in"], head["step"], head["out"]
        ready = {
            "in": n_in < len(layers) and (n_in < STREAMED_STEP_SLOTS or len(done) > n_in - STREAMED_STEP_SLOTS),
            "step": n_step < n_in,
            "out": n_out < n_step,
        }
        active = [k for k in head if ready[k]]
        both = "in" in active and "out" in active
        rate = {"in": (c.bidir_gbps if both else c.h2d_gbps) / 1e3, "out": (c.bidir_gbps if both else c.d2h_gbps) / 1e3,
                "step": 1.0}
        dt = min(left[k][head[k]] / rate[k] for k in active)
        t += dt
        for k in active:
            left[k][head[k]] -= rate[k] * dt
            if left[k][head[k]] <= 1e-12:
                head[k] += 1
                if k == "out":
                    done.append(t)
    return done


def _streamed_scratch_bytes(c: CostTable, device_layers: int, device_steps: int) -> float:
    """GPU bytes of the streamed steps' scratch slots (`simulate.STREAMED_STEP_SLOTS`) and the
    step's temporaries."""
    if not device_steps:
        return 0.0
    largest = max(c.streamed_in_bytes(j) for j in range(device_layers, device_layers + device_steps))
    return min(STREAMED_STEP_SLOTS, device_steps) * largest + c.device_step_work_bytes


def hiding_device_steps(costs: CostTable, device_layers: int) -> int:
    """How many streamed layers after the ``device_layers`` resident ones to step on the GPU
    (`Plan.device_steps`): the fewest for which every layer's weights are ready when its forward
    would start (every prefetch distance 1, no copy slowdown), a CPU-stepped layer's after the
    overlapped CPU update at the table's rate, a GPU-stepped one's after its bytes are back;
    where none is, the one with the least lateness."""
    c, L = costs, costs.num_layers
    ns = c.optimizer_ns_per_param * 1e-6
    starts, t = [], c.embed_forward_ms + c.device_update_ms(device_layers)
    for lc in c.layers:
        starts.append(t)
        t += lc.forward_ms

    def upload_ms(j: int) -> float:
        return c.layers[j].weight_bytes / GB * 1e3 / c.h2d_gbps

    def lateness(s: int) -> float:
        late = 0.0
        for n, done in enumerate(_streamed_steps_done(c, device_layers, s)):
            j = device_layers + n
            late = max(late, done + upload_ms(j) - starts[j])
        cpu = 0.0
        for j in range(device_layers + s, L):
            cpu += ns * c.layers[j].params
            late = max(late, cpu + upload_ms(j) - starts[j])
        return late

    return min(range(L - device_layers + 1), key=lambda s: (lateness(s), s))


def _value(e: _Expr, sol: np.ndarray) -> float:
    return e.const + sum(v * sol[k] for k, v in e.terms.items())


def _decode(built: _Built, sol: np.ndarray, num_layers: int) -> list[LayerPlan]:
    letters: list[str] = [""] * num_layers
    recompute = ["none"] * num_layers
    for i, variants in enumerate(built.variants):
        for (k, opt), v in variants.items():
            if _value(v, sol) > 0.5:
                letters[i], recompute[i] = k, opt
    for (s, e), v in built.segments.items():
        if _value(v, sol) > 0.5:
            letters[s] = max("gpn", key=lambda k: _value(built.layer_modes[s][k], sol))
            for i in range(s + 1, e):
                letters[i] = "d"
    if not all(letters):
        raise RuntimeError(f"MILP solution leaves layers without a mode: {letters}")
    return [
        LayerPlan(mode=MODE_LAYER[k][0], tier=MODE_LAYER[k][1], prefetch=1, recompute=r,
                  grad="gpu" if _value(q, sol) > 0.5 else "host")
        for k, r, q in zip(letters, recompute, built.grads)
    ]


@dataclass(kw_only=True, slots=True)
class SolveStats:
    """What the solver did (also stored in ``Plan.notes["milp"]``)."""

    status: str
    solve_time_s: float
    """Of every solve: with ``const_update=None`` the host's and the device's."""
    objective_s: float
    mip_gap: float
    num_binaries: int
    num_rows: int
    num_columns: int


def _const_update_choices(costs: CostTable, const_update: str | None) -> tuple[str, ...]:
    """Where the embedding and head may take their step: ``const_update``, or (None) the host
    and, where the table has the GPU step's time, the device."""
    if const_update is None:
        return ("host", "device") if costs.const_update_ms is not None else ("host",)
    if const_update not in CONST_UPDATES:
        raise ValueError(
            f"const_update {const_update!r} is not one of {CONST_UPDATES}, or None for the faster of them"
        )
    costs.check_const_update(const_update)
    return (const_update,)


DEVICE_LAYER_CANDIDATES = (0, 1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)
"""The first numbers of resident layers `solve_plan` tries with ``device_layers=None``; it then
bisects between the best and its neighbours."""

DEVICE_LAYER_TOLERANCE = 0.001
"""The search does not bisect toward a neighbour predicted within this fraction of the best: near
the optimum the step changes by tenths of a percent per layer, and each MILP solve takes seconds
(`bench/studies/device_layers_search.py` on 2 cores, the 12-05 7B table: 20 s at the profiled update rate
whatever the tolerance, 78 s at 0.2715 ns/param against 63 s at 0.005, 87 against 82 at 0.313).
0.005 until 2026-12-05: on the H200 at 7B a recalibration (0.2715 ns/param) kept k = 4 (5.331 s
predicted) with k = 8 0.35% behind and never tried 5-7 (5: 5.312 s; 6: 5.317); measured in that
process, 4 took 5.352 s a step and 6 (fixed) 5.267 s
(`bench/results/plan_qwen2.5-7b_h200_2026-12-05_as_trained.json`,
`bench/results/device_layers_search_cpu-amd-epyc_2026-12-05.md`)."""


def _check_device_layers(costs: CostTable, const_update: str | None, device_layers: int | None) -> None:
    if device_layers is None or device_layers == 0:
        return
    if not 0 < device_layers <= costs.num_layers:
        raise ValueError(
            f"device_layers={device_layers} is not in 0..{costs.num_layers} (the table's layers), or None to choose"
        )
    if const_update == "host":
        raise ValueError(
            f"device_layers={device_layers} steps layers on the GPU beside the embedding and head: it needs "
            "const_update='device' (or None), got 'host'"
        )
    costs.check_const_update("device")


def _check_device_steps(costs: CostTable, const_update: str | None, device_layers: int | None,
                        device_steps: int | None) -> None:
    if device_steps is None or device_steps == 0:
        return
    if device_steps < 0 or (device_layers or 0) + device_steps > costs.num_layers:
        raise ValueError(
            f"device_steps={device_steps} is not in 0..{costs.num_layers - (device_layers or 0)} (the table's "
            f"{costs.num_layers} layers less device_layers={device_layers}), or None to choose"
        )
    if const_update == "host":
        raise ValueError(
            f"device_steps={device_steps} steps streamed layers on the GPU beside the embedding and head: it "
            "needs const_update='device' (or None), got 'host'"
        )
    costs.check_const_update("device")


def solve_plan(
    costs: CostTable,
    *,
    gpu_bytes: int | None = None,
    tiers: tuple[str, ...] = ("gpu", "host", "nvme"),
    optimizer_overlap: bool = False,
    head_chunk_tokens: int = 4096,
    max_segment: int = DEFAULT_MAX_SEGMENT,
    time_limit_s: float = 10.0,
    mip_rel_gap: float = 1e-4,
    recompute: tuple[str, ...] = RECOMPUTE_OPTIONS,
    const_update: str | None = None,
    device_layers: int | None = 0,
    device_steps: int | None = 0,
    offload_window: int = 1,
    gradients: str = "host",
    hold_grads: tuple[int, ...] = (),
) -> Plan:
    """The plan with the least predicted step time at ``costs``' batch shape.

    ``gpu_bytes`` overrides ``costs.gpu_bytes`` (a memory cap); ``tiers`` limits where
    activations may live; ``max_segment`` bounds a recompute segment's length (checkpoint +
    drop layers); ``recompute`` lists the blocks a kept layer may recompute (where the table
    has their costs; ``()``: whole layers only). ``const_update`` is where the embedding and
    head take their optimizer step (`Plan.const_update`): ``host``, ``device``, or None: each
    the table allows (device only with its ``const_update_ms``) is solved and the faster plan
    kept (the host on a tie); ``notes["const_update"]`` holds each one's predicted step (None:
    no plan fits). ``device_layers`` is how many of the first decoder layers the device plan
    keeps resident and steps on the GPU (`Plan.device_layers`; the host plan has none): a
    number, or None to try `DEVICE_LAYER_CANDIDATES` (up to the first that does not fit; memory
    only grows with them) and bisect around the best, each one's predicted step in
    ``notes["device_layers"]``. ``device_steps`` is how many streamed layers after those the
    device plan steps on the GPU (`Plan.device_steps`; at most the layers left): a number, or
    None for `hiding_device_steps` of each number of resident layers (0 without
    ``optimizer_overlap``). The plan is optimal within ``mip_rel_gap`` (relative), or the
    best found in ``time_limit_s`` per solve (``notes["milp"]["status"] == "time limit"``, with
    its gap). ``offload_window`` (`Plan.offload_window`): how many stages a host-tier offload's
    copy may take. ``gradients`` (`GRADIENT_CHOICES`): where the CPU-stepped streamed layers'
    gradients wait, each placed by the program with ``auto`` (`LayerPlan.grad`), those of
    ``hold_grads`` on the GPU in any case (a run whose layers have no host buffer). Raises
    `PlanInfeasible` when no plan fits.
    """
    _check_offload_window(offload_window, tiers)
    start = time.perf_counter()
    choices = _const_update_choices(costs, const_update)
    _check_device_layers(costs, const_update, device_layers)
    _check_device_steps(costs, const_update, device_layers, device_steps)
    solved: dict[tuple[str, int], tuple[_Built, object]] = {}
    steps: dict[tuple[str, int], int] = {}

    def solve_at(choice: str, k: int, s: int) -> tuple[float | None, tuple[_Built, object] | None]:
        """(predicted step ms: None if no plan fits, inf if the solver's time ran out before it
        found one; the solved program) with the embedding and head stepped at ``choice``, ``k``
        resident layers and ``s`` streamed GPU steps."""
        built = _build(
            costs,
            gpu_bytes=gpu_bytes,
            tiers=tiers,
            overlap=optimizer_overlap,
            max_segment=max_segment,
            device=choice == "device",
            device_layers=k,
            device_steps=s,
            recompute=recompute,
            offload_window=offload_window,
            gradients=gradients,
            hold_grads=hold_grads,
        )
        res = built.model.solve(time_limit_s, mip_rel_gap)
        if res.x is None and res.status == 1:  # the time limit came before any plan was found
            return math.inf, None
        if res.x is None and res.status != 2:
            raise RuntimeError(f"MILP solver failed: {res.message}")
        return (None, None) if res.x is None else (float(res.fun) + built.model.objective_const, (built, res))

    def objective(choice: str, k: int) -> float | None:
        """Solve with the embedding and head stepped at ``choice``, ``k`` resident layers and
        the streamed steps for them: the predicted step in ms, None if no plan fits, inf if the
        solver's time ran out before it found one (one may exist). Chosen streamed steps
        (``device_steps=None``) are the count that hides the CPU update, or where that does not
        fit, the most that do (`_most_that_fit`)."""
        if choice == "host":
            s = 0
        elif device_steps is None:
            s = hiding_device_steps(costs, k) if optimizer_overlap else 0
        else:
            s = min(device_steps, costs.num_layers - k)
        ms, found = solve_at(choice, k, s)
        if ms is None and device_steps is None and s > 0:
            ms, found, s = _most_that_fit(lambda n: solve_at(choice, k, n), s)
        steps[choice, k] = s
        if ms == math.inf:
            timed_out.append((choice, k))
        if found is not None:
            solved[choice, k] = found
        return ms

    timed_out: list[tuple[str, int]] = []
    objective_ms: dict[tuple[str, int], float | None] = {}
    for choice in choices:
        if choice == "host" or device_layers is not None:
            k = 0 if choice == "host" else device_layers
            objective_ms[choice, k] = objective(choice, k)
        else:
            objective_ms.update(_search_device_layers(costs.num_layers, lambda k: objective("device", k),
                                                      search_workers()))
    elapsed = time.perf_counter() - start
    fits = {key: ms for key, ms in objective_ms.items() if ms is not None and ms < math.inf}
    if not fits:
        raise _no_plan(costs, time_limit_s, len(timed_out), len(objective_ms), lambda: _infeasible_message(
            costs, gpu_bytes, tiers, max_segment, recompute, const_update, device_layers, offload_window, gradients,
            hold_grads))
    # the fewest resident layers on a tie
    best = {choice: min((key for key in fits if key[0] == choice), key=lambda key: (fits[key], key[1]), default=None)
            for choice in choices}
    choice, k = min((key for key in best.values() if key is not None), key=fits.__getitem__)
    built, res = solved[choice, k]
    layers = _decode(built, res.x, costs.num_layers)
    notes = _solve_notes(built, res, elapsed, fits[choice, k], optimizer_overlap,
                         {c: None if best[c] is None else fits[best[c]] for c in choices}, objective_ms, steps)
    plan = Plan(
        policy="solved",
        batch_size=costs.batch_size,
        seq_len=costs.seq_len,
        layers=layers,
        head_chunk_tokens=head_chunk_tokens,
        weight_prefetch=1,
        const_update=choice,
        device_layers=k,
        device_steps=steps[choice, k],
        offload_window=offload_window,
        predicted_step_time_s=fits[choice, k] * 1e-3,
        notes=notes,
    )
    if offload_window > 1:
        # split copies approximate the copy stream's order (on random host-tier tables the MILP's
        # step was up to ~4% short of the simulator's, on the 7B tables within 0.1%): the
        # simulator's prediction stands; ``notes`` keep the MILP's objectives, which chose the plan
        from lazytrain.plan.simulate import simulate

        plan.predicted_step_time_s = simulate(plan, costs, optimizer_overlap=optimizer_overlap).step_time_s
    return plan


def _solve_notes(built: _Built, res, elapsed: float, objective_ms: float, optimizer_overlap: bool,
                 best_ms: dict[str, float | None], searched: dict[tuple[str, int], float | None],
                 steps: dict[tuple[str, int], int]) -> dict:
    """`Plan.notes` of a solved plan: the MILP's statistics, each embedding-and-head choice's
    best predicted step (s; None: no plan fits) and, where the device plan was solved, each
    resident-layer count's predicted step and streamed GPU steps."""
    stats = SolveStats(
        status={0: "optimal", 1: "time limit"}.get(res.status, f"status {res.status}"),
        solve_time_s=elapsed,
        objective_s=objective_ms * 1e-3,
        mip_gap=float(getattr(res, "mip_gap", 0.0) or 0.0),
        num_binaries=built.num_binaries,
        num_rows=len(built.model.rows),
        num_columns=len(built.model.lb),
    )
    notes = {
        "optimizer_overlap": optimizer_overlap,
        "milp": {key: getattr(stats, key) for key in SolveStats.__slots__},
        "const_update": {c: None if ms is None else ms * 1e-3 for c, ms in best_ms.items()},
    }
    if "device" in best_ms:
        # str keys: the plan file is JSON
        notes["device_layers"] = {  # (None: no plan fits, or none found in the solver's time)
            str(n): None if ms is None or ms == math.inf else ms * 1e-3
            for (c, n), ms in sorted(searched.items()) if c == "device"
        }
        # (a candidate the search solved at once with others and dropped is not among them)
        notes["device_steps"] = {str(n): s for (c, n), s in sorted(steps.items())
                                 if c == "device" and (c, n) in searched}
    return notes


def _most_that_fit(solve: Callable[[int], tuple[float | None, object]], over: int) -> tuple[float | None, object, int]:
    """``solve(s)``'s result (ms, solved program) at the most streamed GPU steps ``s`` below
    ``over`` (which does not fit) that fit, and that ``s``: 0 first (if it does not fit either,
    its result), then a bisection, a step count whose solve ran out of time taken as not fitting.
    Each streamed step holds the GPU's step slots through more of the forward and, where its
    gradient is not held on the GPU, a host gradient buffer, so what fits shrinks as ``s``
    grows: the Qwen3-30B-A3B table measured on an H100 (2026-12-07) at batch 128 hides its
    update with 33 steps; with streamed steps' gradients always on the host 21 fit (8,544
    tokens/s predicted, 6,970 with none, the chosen count 33 or nothing until then); held
    where the program places them, all 33 do (10,249)."""
    ms, found = solve(0)
    if ms is None or ms == math.inf:
        return ms, found, 0
    lo, hi = 0, over
    while hi - lo > 1:
        mid = (lo + hi) // 2
        mid_ms, mid_found = solve(mid)
        if mid_ms is None or mid_ms == math.inf:
            hi = mid
        else:
            lo, ms, found = mid, mid_ms, mid_found
    return ms, found, lo


def _check_offload_window(offload_window: int, tiers: tuple[str, ...]) -> None:
    """An integer >= 1, and 1 where the NVMe tier may be used: the split copies model host-tier
    offloads alone (an NVMe offload's copy, which its disk write follows, keeps one stage, and
    the copy stream would run it behind an earlier host copy the model lets it pass)."""
    if not is_offload_window(offload_window):
        raise ValueError(f"offload_window must be an integer >= 1, got {offload_window!r}")
    if offload_window > 1 and "nvme" in tiers:
        raise ValueError(f"offload_window={offload_window} models host-tier offloads only: plan without the "
                         "NVMe tier (no memory.nvme_dir; tiers gpu, host) or with offload_window 1")


SEARCH_WORKERS = 8
"""Most MILP solves the search for k runs at once (threads: HiGHS releases the GIL while it
solves, and solves on one core). On the 7B tables a solve takes 0.4-10 s and the search ran
11 of them one after another, 83 s on the H200's host (2026-12-05)."""


def search_workers() -> int:
    """Solves the search runs at once here: the cores this process may use, at most
    `SEARCH_WORKERS` (a time-limited solve given less than a core finds a worse plan)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(SEARCH_WORKERS, cores))


def _evaluate(objective: Callable[[int], float | None], ks: Sequence[int],
              pool: ThreadPoolExecutor | None) -> list[float | None]:
    """``objective`` at each of ``ks``, in order: at once on ``pool``, else one after another."""
    if pool is None or len(ks) < 2:
        return [objective(k) for k in ks]
    return list(pool.map(objective, ks))


def _search_device_layers(num_layers: int, objective: Callable[[int], float | None],
                          workers: int = 1) -> dict[tuple[str, int], float | None]:
    """``objective(k)`` (ms; None: does not fit; inf: no plan found in the solver's time, which
    neither stops the search nor counts as slower) at `DEVICE_LAYER_CANDIDATES` and ``num_layers``
    up to the first k that does not fit or the second in a row slower than the one before, then
    at midpoints between the best and its neighbours until they are adjacent or predicted within
    `DEVICE_LAYER_TOLERANCE` of it: a search for the least of a step time taken as unimodal in k
    (more resident layers: less CPU time before the forward, more GPU time and memory).

    ``workers`` > 1 evaluates that many of the first candidates at once, and both midpoints of a
    round: the same k are kept as one after another (a candidate past where the first ones stop
    the search is solved and dropped), so the plan is the same but for time-limited solves."""
    candidates = sorted({n for n in DEVICE_LAYER_CANDIDATES if n < num_layers} | {num_layers})
    tried: dict[int, float | None] = {}
    rises, workers = 0, max(1, workers)
    with ThreadPoolExecutor(workers) if workers > 1 else nullcontext() as pool:
        stopped = False
        for first in range(0, len(candidates), workers):
            batch = candidates[first: first + workers]
            for k, value in zip(batch, _evaluate(objective, batch, pool)):
                tried[k] = value
                if value is None:
                    stopped = True
                    break
                if value == math.inf:  # unknown: more resident layers may still fit
                    continue
                previous = [v for n, v in tried.items() if n < k and v != math.inf]
                rises = rises + 1 if previous and value > previous[-1] else 0
                if rises == 2:
                    stopped = True
                    break
            if stopped:
                break
        while True:
            fits = {k: v for k, v in tried.items() if v is not None and v < math.inf}
            if not fits:
                break
            best = min(fits, key=fits.__getitem__)
            lower = max((k for k in tried if k < best), default=best)
            upper = min((k for k in tried if k > best), default=best)
            close = fits[best] * (1 + DEVICE_LAYER_TOLERANCE)
            mids = sorted({m for m, side in (((lower + best) // 2, lower), ((best + upper) // 2, upper))
                           if m not in tried and (tried[side] is None or tried[side] > close)})
            if not mids:
                break
            tried.update(zip(mids, _evaluate(objective, mids, pool)))
    return {("device", k): v for k, v in tried.items()}


def milp_evaluate(
    plan: Plan, costs: CostTable, optimizer_overlap: bool | None = None
) -> tuple[float, int]:
    """(step time s, peak GPU bytes) of a fixed plan as the MILP models them.

    A check of the model against the simulator; host and NVMe capacities are ignored.
    """
    if plan.weight_prefetch != 1 or any(lp.prefetch != 1 for lp in plan.layers):
        raise ValueError("the MILP models prefetch distance 1 only")
    _check_offload_window(plan.offload_window, tuple({lp.tier for lp in plan.layers if lp.mode != "drop"}))
    plan.check(costs.num_layers)
    costs.check_const_update(plan.const_update)
    if optimizer_overlap is None:
        optimizer_overlap = bool(plan.notes.get("optimizer_overlap", False))
    unbounded = replace(costs, host_bytes=2**62, nvme_bytes=2**62)
    kw = {
        "gpu_bytes": None,
        "tiers": ("gpu", "host", "nvme"),
        "overlap": optimizer_overlap,
        "max_segment": 0,
        "device": plan.const_update == "device",
        "device_layers": plan.device_layers,
        "device_steps": plan.device_steps,
        "fixed": plan,
        "offload_window": plan.offload_window,
        "gradients": "auto",  # each layer's as the plan has it
    }
    timed = _build(unbounded, memory=False, **kw)
    res = timed.model.solve(30.0, 1e-9)
    sized = _build(unbounded, minimize_gpu=True, **kw)
    res_gpu = sized.model.solve(30.0, 1e-9)
    if res.x is None or res_gpu.x is None:
        raise RuntimeError(f"MILP evaluation failed: {res.message} / {res_gpu.message}")
    step_s = (float(res.fun) + timed.model.objective_const) * 1e-3
    return step_s, round(_value(sized.gpu_var, res_gpu.x) * GB)


def min_gpu_bytes(
    costs: CostTable,
    *,
    tiers: tuple[str, ...] = ("gpu", "host", "nvme"),
    max_segment: int = DEFAULT_MAX_SEGMENT,
    time_limit_s: float = 30.0,
    recompute: tuple[str, ...] = RECOMPUTE_OPTIONS,
    const_update: str | None = None,
    offload_window: int = 1,
    gradients: str = "host",
    hold_grads: tuple[int, ...] = (),
) -> int:
    """The least GPU memory (fixed part included) any plan needs at ``costs``' batch shape,
    within the host and NVMe capacities, with the embedding and head stepped where
    ``const_update`` says (None: either; that is the host, as the device step only adds), its
    offloads modelled with ``offload_window`` (a longer one holds them longer), and the
    gradients of ``hold_grads`` held on the GPU (layers without a host buffer), as
    `solve_plan` holds them."""
    _check_offload_window(offload_window, tiers)
    built = _build(
        costs,
        gpu_bytes=None,
        tiers=tiers,
        overlap=False,
        max_segment=max_segment,
        device=_const_update_choices(costs, const_update)[0] == "device",
        minimize_gpu=True,
        recompute=recompute,
        offload_window=offload_window,
        gradients=gradients,
        hold_grads=hold_grads,
    )
    res = built.model.solve(time_limit_s, 1e-6)
    if res.x is None and res.status == 2:  # infeasible whatever the GPU holds: the host rows
        grads = 0.0 if costs.host_grads or gradients == "gpu" else costs.layer_grad_bytes
        raise PlanInfeasible(
            f"host memory: no plan fits batch {costs.batch_size} x seq {costs.seq_len} in the "
            f"{costs.host_bytes / GiB:.2f} GiB of host memory the model state leaves"
            + (f", which the streamed layers' gradient buffers ({grads / GiB:.2f} GiB, memory.gradients="
               f"{gradients}) must share: set memory.gradients=auto or gpu to hold gradients on the GPU"
               if grads else "")
            + "; raise memory.host_limit_gb, or make the model state smaller (`lazytrain plan` lists it)"
        )
    if res.x is None and res.status == 1:
        raise SolverTimeLimit(_time_limit_message(costs, time_limit_s, " while minimising GPU memory"))
    if res.x is None:
        raise RuntimeError(f"MILP solver failed while minimising GPU memory: {res.message}")
    return math.ceil((_value(built.gpu_var, res.x) + _MARGIN_GB) * GB)


def _no_plan(costs: CostTable, time_limit_s: float, timed_out: int, programs: int,
             infeasible: Callable[[], str]) -> PlanInfeasible:
    """The error of a solve without a plan: ``timed_out`` of its ``programs`` ran out of the
    solver's time before finding one (all of them: `SolverTimeLimit`, one may exist; until
    2026-12-07 a traceback, Qwen3-30B-A3B's batch sweep in 78 GiB on 2 cores), the others were
    infeasible (``infeasible()``: the message saying how much GPU memory would do)."""
    if timed_out == programs:
        return SolverTimeLimit(_time_limit_message(costs, time_limit_s))
    message = infeasible()
    if timed_out:
        message += (f" ({timed_out} of the {programs} programs ran out of the solver's {time_limit_s:g} s "
                    "without a plan: one of them may have one)")
    return PlanInfeasible(message)


def _time_limit_message(costs: CostTable, time_limit_s: float, what: str = "") -> str:
    """`SolverTimeLimit`'s: no plan found at ``costs``' batch shape within the solver's time."""
    return (f"the MILP solver found no plan for batch {costs.batch_size} x seq {costs.seq_len} within its time "
            f"limit ({time_limit_s:g} s a solve){what}; one may exist: lower the batch size, or plan on a machine "
            "with more cores")


def _infeasible_message(
    costs: CostTable,
    gpu_bytes: int | None,
    tiers: tuple[str, ...],
    max_segment: int,
    recompute: tuple[str, ...],
    const_update: str | None,
    device_layers: int | None = 0,
    offload_window: int = 1,
    gradients: str = "host",
    hold_grads: tuple[int, ...] = (),
) -> str:
    budget = costs.gpu_bytes if gpu_bytes is None else gpu_bytes
    need = min_gpu_bytes(costs, tiers=tiers, max_segment=max_segment, recompute=recompute,
                         const_update=const_update, offload_window=offload_window, gradients=gradients,
                         hold_grads=hold_grads)
    device = ""
    if hold_grads:
        device = (f", or give the {len(hold_grads)} layers whose gradients are held on the GPU host buffers "
                  f"(they have none: {sum(costs.layers[i].weight_bytes for i in hold_grads) * costs.grad_share / GiB:.2f} GiB held, "
                  "placed by the run's first plan)")
    if const_update == "device":
        device += (f", or step the embedding and head on the host (const_update=host: their GPU step "
                  f"holds {costs.const_update_bytes / GiB:.2f} GiB)")
    if device_layers:
        device += (f", or keep fewer layers resident on the GPU (device_layers={device_layers} hold "
                   f"{costs.device_resident_bytes(device_layers) / GiB:.2f} GiB and their gradients)")
    return (
        f"GPU memory: no plan fits batch {costs.batch_size} x seq {costs.seq_len} in "
        f"{budget / GiB:.2f} GiB; the cheapest plan needs {need / GiB:.2f} GiB (with "
        f"{costs.host_bytes / GiB:.1f} GiB host and {costs.nvme_bytes / GiB:.1f} GiB NVMe for "
        f"activations, tiers {list(tiers)}); lower the batch size or sequence length, allow "
        f"host/NVMe activation tiers, or raise the GPU memory cap{device}"
    )

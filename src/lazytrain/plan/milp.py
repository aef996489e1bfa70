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
from lazytrain.plan.plan import CONST_UPDATES, LayerPlan, Plan, is_offload_window
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


class PlanInfeasible(LazyTrainError, ValueError):
    """No plan fits the memory budgets; the message says how much GPU memory would do."""


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
) -> _Built:
    """The MILP, in ms and GB. ``device``: the embedding and head stepped on the GPU
    (``const_update="device"``), with the first ``device_layers`` decoder layers resident there
    and the next ``device_steps`` streamed but stepped there (`Plan.device_steps`).
    ``fixed`` pins every decision to that plan's (evaluation). ``offload_window``
    (`Plan.offload_window`): a host-tier offload's copy may be split over that many stages
    after its layer's (never past the head), its GPU memory counted through all but the last."""
    c = costs
    L = c.num_layers
    m = _Model()
    lay = c.layers
    # weights as streamed: a resident layer's are on the GPU all along (in the fixed part)
    w = [0.0 if i < device_layers else lc.weight_bytes / GB for i, lc in enumerate(lay)]
    on_gpu = device_layers + device_steps  # layers below it are stepped on the GPU
    resident_grads = [lc.weight_bytes / GB * c.grad_share if i < device_layers else 0.0 for i, lc in enumerate(lay)]
    x = [lc.input_bytes / GB for lc in lay]
    a = [lc.saved_bytes / GB for lc in lay]
    wf = [lc.forward_work_bytes / GB for lc in lay]
    wb = [lc.backward_work_bytes / GB for lc in lay]
    fw = [lc.forward_ms for lc in lay]
    ch, cd, cbi = 1e3 / c.h2d_gbps, 1e3 / c.d2h_gbps, 1e3 / c.bidir_gbps
    cnr, cnw = 1e3 / c.nvme_read_gbps, 1e3 / c.nvme_write_gbps
    kappa = 1.0 - 1.0 / c.copy_slowdown
    time_cost = 0.0 if minimize_gpu else 1.0

    def span(values: list[float], lo: int, hi: int) -> float:
        """sum(values[lo..hi]), inclusive; 0 when empty."""
        return float(sum(values[lo : hi + 1]))

    # -- decisions --------------------------------------------------------------------------
    # Per layer: keep on GPU (f) / host (o); as a checkpoint start, its tier (g, p, n).
    # Per segment [s, e) (a checkpoint at s followed by e-s-1 drop layers; e-s = 1 is a lone
    # checkpoint): a binary. The segments and keeps partition the layers, so the shape of every
    # recompute segment is explicit and every cost below is linear without big-M rows.
    allowed = [_allowed(c, tiers, i) for i in range(L)]
    # per layer, the ways to keep it: "none" (all saved tensors) and each block it may recompute
    options = [["none", *(k for k in recompute if k in lc.recompute_options)] for lc in lay]
    kept = [{k: lc.kept(k) for k in options[i]} for i, lc in enumerate(lay)]
    fixed_letter: list[str | None] = [None] * L
    fixed_option: list[str] = ["none"] * L
    fixed_segments: set[tuple[int, int]] = set()
    if fixed is not None:
        for i, lp in enumerate(fixed.layers):
            fixed_letter[i] = layer_mode(lp)
            fixed_option[i] = lp.recompute
            if fixed_letter[i] not in allowed[i] or lp.recompute not in options[i]:
                raise ValueError(
                    f"layer {i}: {lp.mode}/{lp.tier} recomputing {lp.recompute!r} is not a mode "
                    "the MILP offers there"
                )
        fixed_segments = {
            (s, e) for s, e in fixed.segments() if fixed.layers[s].mode == "checkpoint"
        }
        max_segment = max([e - s for s, e in fixed_segments] + [1])

    nbin = 0

    def binary(ok: bool, pinned: bool | None) -> _Expr:
        nonlocal nbin
        if not ok:
            return _Expr()
        if pinned is not None:
            return _Expr(const=float(pinned))
        nbin += 1
        return m.var(0, 1, integer=True)

    def pin(i: int, letter: str, option: str = "none") -> bool | None:
        if fixed_letter[i] is None:
            return None
        return fixed_letter[i] == letter and fixed_option[i] == option

    # keep variants (letter f or o, option): f_i and o_i are their sums
    variants = [
        {(k, opt): binary(k in allowed[i], pin(i, k, opt)) for k in "fo" for opt in options[i]}
        for i in range(L)
    ]
    modes = [
        {
            **{k: sum((v for (kk, _), v in variants[i].items() if kk == k), _Expr()) for k in "fo"},
            **{k: binary(k in allowed[i], pin(i, k)) for k in "gpn"},
        }
        for i in range(L)
    ]
    f, o, g, p, n = ([modes[i][k] for i in range(L)] for k in "fogpn")

    def by_option(i: int, letters: str, value) -> _Expr:
        """Sum over layer i's keep variants with a letter in ``letters`` of their binary times
        ``value`` of the variant's `RecomputeCosts`."""
        return total(v * value(kept[i][opt]) for (k, opt), v in variants[i].items() if k in letters)

    def total(terms) -> _Expr:
        return sum(terms, _Expr())

    def saved(i: int, letters: str) -> _Expr:
        """GB kept by layer i when it is kept with a letter in ``letters``."""
        return by_option(i, letters, lambda r: r.saved_bytes / GB)

    seg: dict[tuple[int, int], _Expr] = {}
    for s in range(L):
        if not allowed[s] & {"g", "p", "n"}:
            continue
        for e in range(s + 1, min(L, s + max_segment) + 1):
            if any("d" not in allowed[i] for i in range(s + 1, e)):
                break
            seg[s, e] = binary(True, None if fixed is None else (s, e) in fixed_segments)
    covering: list[list[tuple[int, int]]] = [[] for _ in range(L)]
    ending: list[list[tuple[int, int]]] = [[] for _ in range(L + 1)]
    for s, e in seg:
        ending[e].append((s, e))
        for i in range(s, e):
            covering[i].append((s, e))
    for i in range(L):
        m.eq(f[i] + o[i] + sum((seg[u] for u in covering[i]), _Expr()), 1.0)
        m.eq(g[i] + p[i] + n[i], sum((seg[u] for u in seg if u[0] == i), _Expr()))
    # Off-GPU checkpoint of a segment (tier host or nvme), and its NVMe part: products of a
    # segment and its start's tier, bounded from below (they only ever cost).
    held: dict[tuple[int, int], _Expr] = {}
    on_nvme: dict[tuple[int, int], _Expr] = {}
    for (s, e), v in seg.items():
        held[s, e] = _Expr()
        on_nvme[s, e] = _Expr()
        if not (p[s].is_zero() and n[s].is_zero()):
            held[s, e] = m.var()
            m.ge(held[s, e], v - g[s])
        if not n[s].is_zero():
            on_nvme[s, e] = m.var()
            m.ge(on_nvme[s, e], v - g[s] - p[s])

    not_keep = [1.0 - f[i] - o[i] for i in range(L)]
    gpu_kept = [saved(i, "f") + g[i] * x[i] for i in range(L)]
    offload = [saved(i, "o") + (p[i] + n[i]) * x[i] for i in range(L)]
    # D2H bytes of each forward stage i (1..L-1) and the head (L): the offload of layer i - 1, or
    # with a longer window a host-tier offload's parts over the stages it may span (continuous
    # splits: a FIFO copy stream meets the same deadlines whenever any split does)
    d2h_in: list[_Expr] = [_Expr()] + [offload[i - 1] for i in range(1, L + 1)]
    held_on: list[_Expr] = [_Expr() for _ in range(L + 1)]
    """Host-tier offloads still on the GPU at forward stage i beyond their own (the window)."""
    if offload_window > 1:
        d2h_in = [_Expr() for _ in range(L + 1)]
        for j in range(L):
            host_out = saved(j, "o") + p[j] * x[j]
            d2h_in[j + 1] = d2h_in[j + 1] + n[j] * x[j]
            span_j = min(offload_window, L - j)
            if host_out.is_zero() or span_j == 1:
                d2h_in[j + 1] = d2h_in[j + 1] + host_out
                continue
            parts = [m.var() for _ in range(span_j)]
            m.eq(total(parts), host_out)
            for k, part in enumerate(parts):
                d2h_in[j + 1 + k] = d2h_in[j + 1 + k] + part
            for i in range(j + 1, j + span_j):
                held_on[i] = held_on[i] + host_out

    def unit_bytes(i: int) -> _Expr:
        """Weights + host/NVMe tensors of the unit ending at layer i-1 (fetched before it)."""
        keep = (f[i - 1] + o[i - 1]) * w[i - 1] + saved(i - 1, "o")
        return keep + total(seg[u] * span(w, u[0], i - 1) + held[u] * x[u[0]] for u in ending[i])

    def unit_nvme(i: int) -> _Expr:
        """NVMe bytes of the unit ending at layer i-1."""
        return total(on_nvme[u] * x[u[0]] for u in ending[i])

    def rebuild_ms(i: int) -> _Expr:
        """Re-forward of a segment ending at layer i, paid by its first backward stage."""
        return total(seg[u] * span(fw, u[0], i - 1) for u in ending[i + 1])

    # -- stage times ------------------------------------------------------------------------
    def _named(e: _Expr | float) -> _Expr:
        """A column equal to e when e has several terms: each appears in up to nine rows."""
        e = _Expr() + e
        if len(e.terms) <= 1:
            return e
        v = m.var()
        m.eq(v, e)
        return v

    def stage(
        compute: _Expr | float, h2d: _Expr | float, d2h: _Expr | float, nvme_ms: _Expr | float = 0.0
    ) -> _Expr:
        t = m.var(cost=time_cost)
        h2d, d2h, compute = (_named(e) for e in (h2d, d2h, compute))
        copies: list[_Expr] = []
        if not h2d.is_zero():
            copies.append(h2d * ch)
        if not d2h.is_zero():
            copies.append(d2h * cd)
        if len(copies) == 2:
            copies.append(h2d * cbi + (d2h - h2d) * cd)
            copies.append(d2h * cbi + (h2d - d2h) * ch)
        for term in copies:
            m.ge(t, term)
            if kappa > 0:
                m.ge(t, compute + kappa * term)
        m.ge(t, compute)
        m.ge(t, nvme_ms)
        return t

    def stage_ms(compute: float, h2d: float, d2h: float) -> float:
        """Exact time of one stage whose streams start together (numbers, GB)."""
        if h2d > 0 and d2h > 0:
            copy = max(
                h2d * ch, d2h * cd, h2d * cbi + (d2h - h2d) * cd, d2h * cbi + (h2d - d2h) * ch
            )
        else:
            copy = h2d * ch + d2h * cd
        return max(compute + kappa * copy, copy) if copy > 0 else compute

    def unit_options(i: int) -> list[tuple[_Expr, float, float]]:
        """(indicator, H2D bytes, bytes already counted) per way the unit ending at layer i-1
        can look; the indicators are exclusive (the held parts refine their segment's)."""
        opts = [(f[i - 1], w[i - 1], 0.0)]
        opts += [
            (v, w[i - 1] + kept[i - 1][opt].saved_bytes / GB, 0.0)
            for (k, opt), v in variants[i - 1].items()
            if k == "o"
        ]
        for u in ending[i]:
            weights = span(w, u[0], i - 1)
            opts.append((seg[u], weights, 0.0))
            opts.append((held[u], weights + x[u[0]], weights))
        return [opt for opt in opts if not opt[0].is_zero()]

    def hull(t: _Expr, base: _Expr | float, ref_ms: float, options, d2h: float) -> None:
        """t >= base + the exact extra time each option's copy adds to a stage computing at
        least ref_ms. Valid for any plan, exact at integer points with compute ref_ms, and much
        tighter than the max rows in the LP relaxation (a fraction of an offload cannot hide in
        a stage's slack)."""
        extra = _Expr() + base
        for ind, nbytes, counted in options:
            gain = stage_ms(ref_ms, nbytes, d2h) - stage_ms(ref_ms, counted, d2h)
            extra = extra + ind * gain
        m.ge(t, extra)

    # stepped on the GPU with the overlap, the embedding and head go ahead of the embedding forward
    # (the stage's copies start with them: the executor does not wait for the GPU step)
    device_ms = c.device_update_ms(device_layers) if device else 0.0
    t_embed = stage(c.embed_forward_ms + (device_ms if overlap else 0.0), w[0], 0.0)
    # overlapped and stepped on the host, the head's new weights (`CostTable.const_split`) are
    # copied in the last forward stage, as a layer's are in the stage before its own
    head_upload = c.const_split()[1][1] / GB if overlap and not device else 0.0
    t_fwd = []
    for i in range(L):
        nvme_ms = n[i - 2] * (x[i - 2] * cnw) if i >= 2 else _Expr()
        if i == L - 1:
            nvme_ms = nvme_ms + unit_nvme(L) * cnr
        h2d = w[i + 1] if i + 1 < L else head_upload
        t_fwd.append(stage(fw[i], h2d, d2h_in[i] if i > 0 else 0.0, nvme_ms))
        if i > 0 and offload_window == 1:  # (with splits an offload need not land in one stage)
            base = stage_ms(fw[i], h2d, 0.0)
            offloads = [(p[i - 1] + n[i - 1], x[i - 1])]
            offloads += [
                (v, kept[i - 1][opt].saved_bytes / GB)
                for (k, opt), v in variants[i - 1].items()
                if k == "o"
            ]
            m.ge(
                t_fwd[-1],
                base + total(ind * (stage_ms(fw[i], h2d, nbytes) - base) for ind, nbytes in offloads),
            )
    head_nvme = unit_nvme(L - 1) * cnr + (n[L - 2] * (x[L - 2] * cnw) if L >= 2 else 0.0)
    t_head = stage(c.head_ms, unit_bytes(L), d2h_in[L], head_nvme)
    if offload[L - 1].is_zero():
        hull(t_head, c.head_ms, c.head_ms, unit_options(L), 0.0)
    prefetch = [_Expr()] + [unit_bytes(i) for i in range(1, L)]
    for i in range(L):
        bw, rc = lay[i].backward_ms, lay[i].recompute_ms
        block_ms = by_option(i, "fo", lambda r: r.recompute_ms)
        compute = bw + rc * not_keep[i] + block_ms + rebuild_ms(i)
        grad_out = w[i + 1] * c.grad_share if i + 1 < L else 0.0
        nvme_ms = unit_nvme(i - 1) * cnr if i >= 2 else 0.0
        t = stage(compute, prefetch[i], grad_out, nvme_ms)
        if i > 0:
            # A stage that prefetches ends its unit (a unit of one layer: no rebuild): it
            # computes bw, bw + a block's re-forward (keep) or bw + rc. Each hull holds for a
            # compute up to its reference.
            most = max(rc, *(kept[i][opt].recompute_ms for opt in options[i]))
            hull(t, compute, bw + most, unit_options(i), grad_out)
            hull(t, compute - rc * not_keep[i] - block_ms, bw, unit_options(i), grad_out)
            for opt in options[i][1:]:
                # exact for a kept layer recomputing opt; below the truth for the others
                ind = total(v for (_, k), v in variants[i].items() if k == opt)
                r = kept[i][opt].recompute_ms
                if not ind.is_zero():
                    base = compute - rc * not_keep[i] - block_ms + r * ind
                    hull(t, base, bw + r, unit_options(i), grad_out)
    const_grads = 0.0 if device else c.const_grad_bytes / GB  # stepped on the GPU: no copy out
    stage(c.embed_backward_ms, 0.0, (w[0] + const_grads) * c.grad_share)

    if overlap:
        # The previous step's CPU update runs first: the embedding, then layer 0, 1, ..., then
        # the final norm + head (`CostTable.const_split`; stepped on the GPU, the layers only);
        # layer j's weights are copied only after its update, the head's before the head runs.
        # Resident layers take no CPU time, and their forward waits for nothing.
        ns = c.optimizer_ns_per_param * 1e-6
        (first_params, first_bytes), (head_params, head_bytes) = (
            ((0, 0.0), (0, 0.0)) if device else c.const_split()
        )
        opt_done = ns * first_params
        start = opt_done + first_bytes / GB * ch
        m.objective_const = start

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
        early = [0.0, stage_ms(c.embed_forward_ms + (device_ms if overlap else 0.0), w[0], 0.0)]
        for i in range(L):
            early.append(early[-1] + stage_ms(fw[i], w[i + 1] if i + 1 < L else head_upload, 0.0))
        streamed_done = _streamed_steps_done(c, device_layers, device_steps)
        for j in range(L):
            out = d2h_in[j - 1] if j else _Expr()  # the copy out of the stage before fwd j
            if j >= on_gpu:
                opt_done += ns * lay[j].params
                ready(before, elapsed, opt_done, w[j], out, early[j])
            elif j >= device_layers:
                ready(before, elapsed, streamed_done[j - device_layers], w[j], out, early[j])
            before, elapsed = elapsed, _named(elapsed + t_fwd[j])
        if head_params:
            ready(before, elapsed, opt_done + ns * head_params, head_bytes / GB, d2h_in[L - 1], early[L])
    elif device:
        # the CPU steps the layers, then the GPU the embedding and head (`HostUpdater.start`)
        streamed = _streamed_steps_done(c, device_layers, device_steps)
        # the streamed steps on their own streams, beside the embedding's and head's
        m.objective_const = (c.optimizer_ns_per_param * sum(lc.params for lc in lay[on_gpu:]) * 1e-6
                             + max(device_ms, streamed[-1] if streamed else 0.0))
    else:
        m.objective_const = c.optimizer_ms + c.const_weight_bytes / GB * ch

    # -- memory -----------------------------------------------------------------------------
    gpu_var = None
    if memory:
        if minimize_gpu:
            gpu_var = m.var(cost=1.0)
            cap: _Expr | float = gpu_var
        else:
            cap = (c.gpu_bytes if gpu_bytes is None else gpu_bytes) / GB - _MARGIN_GB
        device_gb = (c.const_update_bytes + c.device_resident_bytes(device_layers)) / GB if device else 0.0
        fixed_gb = c.step_fixed_bytes / GB + device_gb
        forward_fixed_gb = c.forward_fixed_bytes / GB + device_gb
        # the streamed steps' scratch slots, until the last of them is stepped (in its forward)
        scratch_gb = _streamed_scratch_bytes(c, device_layers, device_steps) / GB
        grads = c.grad_buffers * max(lc.weight_bytes for lc in lay) / GB
        # GPU-kept bytes of layers < i, as running-sum columns (keeps the matrix sparse).
        kept_before = [_Expr()]
        for i in range(L):
            total_i = m.var()
            m.eq(total_i, kept_before[-1] + gpu_kept[i])
            kept_before.append(total_i)

        # before the head: no gradients of the embedding and head; an offloaded tensor's GPU
        # copy is freed in its own stage
        # the embedding's output; stepped on the GPU, before it the update with their gradients
        held_grads = c.const_grad_bytes / GB + sum(resident_grads) if device else 0.0
        m.le(forward_fixed_gb + scratch_gb + w[0] + max(x[0], held_grads), cap)
        for i in range(L):
            current = x[i] + saved(i, "fo") - (f[i] + o[i]) * x[i]
            m.le(
                forward_fixed_gb
                + (scratch_gb if i < on_gpu else 0.0)
                + w[i]
                + (w[i + 1] if i + 1 < L else 0.0)
                + kept_before[i]
                + current
                + held_on[i]
                # the forward's transient: a kept variant's own (under autograd, beyond its saved
                # tensors), else the no-grad forward's
                + not_keep[i] * wf[i]
                + by_option(i, "fo", lambda r: r.forward_work_bytes / GB),
                cap,
            )
        m.le(
            forward_fixed_gb
            + kept_before[L]
            + x[L - 1]
            + c.head_work_bytes / GB
            + unit_bytes(L),
            cap,
        )
        if not minimize_gpu:
            # Cardinality cut from the head row (every GPU-kept tensor is live there): at most
            # k layers fit kept on the GPU, k from the k smallest saved sizes. Valid, and it
            # spares the solver proving it by branching over interchangeable layers.
            room = cap - forward_fixed_gb - x[L - 1] - c.head_work_bytes / GB - w[L - 1]
            sizes = sorted(
                min(kept[i][opt].saved_bytes for opt in options[i]) / GB
                for i in range(L)
                if not f[i].is_zero()
            )
            k = int(np.searchsorted(np.cumsum(sizes), room, side="right"))
            if k < len(sizes):
                m.le(total(f), float(k))
        for i in range(L):
            weights = (f[i] + o[i]) * w[i] + total(seg[u] * span(w, u[0], i) for u in covering[i])
            cache = total(
                seg[u] * span(x, u[0] + 1, i - 1) + held[u] * x[u[0]]
                for u in covering[i]
                if u[0] < i
            )
            # a kept layer's backward holds its option's saved bytes and working set
            kept_work = by_option(i, "fo", lambda r: (r.saved_bytes + r.backward_work_bytes) / GB)
            kept_work = kept_work - (f[i] + o[i]) * (a[i] + wb[i])
            # resident layers' gradients, from their backward on
            grads_i = grads + sum(resident_grads[i:])
            m.le(
                fixed_gb
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
            rebuilds = [u for u in ending[i + 1] if u[0] < i]
            if rebuilds:
                # Each re-forward j of the rebuild: inputs rebuilt so far + its working set,
                # with every weight of the segment loaded.
                peak = total(
                    seg[u]
                    * (max(span(x, u[0] + 1, j) + wf[j] for j in range(u[0], i)) + span(w, u[0], i))
                    + held[u] * x[u[0]]
                    for u in rebuilds
                )
                m.le(fixed_gb + kept_before[i] + peak + grads_i, cap)
        m.le(fixed_gb + grads + sum(resident_grads) + c.embed_backward_work_bytes / GB, cap)
        m.le(
            total(saved(i, "o") + p[i] * x[i] for i in range(L)),
            max(c.host_bytes / GB - _MARGIN_GB, 0.0),
        )
        m.le(total(n[i] * x[i] for i in range(L)), max(c.nvme_bytes / GB - _MARGIN_GB, 0.0))

    return _Built(model=m, layer_modes=modes, variants=variants, segments=seg, gpu_var=gpu_var,
                  num_binaries=nbin)


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
        LayerPlan(mode=MODE_LAYER[k][0], tier=MODE_LAYER[k][1], prefetch=1, recompute=r)
        for k, r in zip(letters, recompute)
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
    copy may take. Raises `PlanInfeasible` when no plan fits.
    """
    _check_offload_window(offload_window, tiers)
    start = time.perf_counter()
    choices = _const_update_choices(costs, const_update)
    _check_device_layers(costs, const_update, device_layers)
    _check_device_steps(costs, const_update, device_layers, device_steps)
    solved: dict[tuple[str, int], tuple[_Built, object]] = {}
    steps: dict[tuple[str, int], int] = {}

    def objective(choice: str, k: int) -> float | None:
        """Solve with the embedding and head stepped at ``choice``, ``k`` resident layers and
        the streamed steps for them: the predicted step in ms, None if no plan fits."""
        if choice == "host":
            s = 0
        elif device_steps is None:
            s = hiding_device_steps(costs, k) if optimizer_overlap else 0
        else:
            s = min(device_steps, costs.num_layers - k)
        steps[choice, k] = s
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
        )
        res = built.model.solve(time_limit_s, mip_rel_gap)
        if res.x is None and res.status != 2:
            raise RuntimeError(f"MILP solver failed: {res.message}")
        solved[choice, k] = (built, res)
        return None if res.x is None else float(res.fun) + built.model.objective_const

    objective_ms: dict[tuple[str, int], float | None] = {}
    for choice in choices:
        if choice == "host" or device_layers is not None:
            k = 0 if choice == "host" else device_layers
            objective_ms[choice, k] = objective(choice, k)
        else:
            objective_ms.update(_search_device_layers(costs.num_layers, lambda k: objective("device", k),
                                                      search_workers()))
    elapsed = time.perf_counter() - start
    fits = {key: ms for key, ms in objective_ms.items() if ms is not None}
    if not fits:
        raise PlanInfeasible(
            _infeasible_message(costs, gpu_bytes, tiers, max_segment, recompute, const_update, device_layers,
                                offload_window)
        )
    # the fewest resident layers on a tie
    best = {choice: min((key for key in fits if key[0] == choice), key=lambda key: (fits[key], key[1]), default=None)
            for choice in choices}
    choice, k = min((key for key in best.values() if key is not None), key=fits.__getitem__)
    built, res = solved[choice, k]
    layers = _decode(built, res.x, costs.num_layers)
    stats = SolveStats(
        status={0: "optimal", 1: "time limit"}.get(res.status, f"status {res.status}"),
        solve_time_s=elapsed,
        objective_s=fits[choice, k] * 1e-3,
        mip_gap=float(getattr(res, "mip_gap", 0.0) or 0.0),
        num_binaries=built.num_binaries,
        num_rows=len(built.model.rows),
        num_columns=len(built.model.lb),
    )
    notes = {
        "optimizer_overlap": optimizer_overlap,
        "milp": {key: getattr(stats, key) for key in SolveStats.__slots__},
        "const_update": {c: None if best[c] is None else fits[best[c]] * 1e-3 for c in choices},
    }
    if "device" in choices:
        # str keys: the plan file is JSON
        notes["device_layers"] = {
            str(n): None if ms is None else ms * 1e-3
            for (c, n), ms in sorted(objective_ms.items()) if c == "device"
        }
        # (a candidate the search solved at once with others and dropped is not among them)
        notes["device_steps"] = {str(n): s for (c, n), s in sorted(steps.items())
                                 if c == "device" and (c, n) in objective_ms}
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
    """``objective(k)`` (ms, None: does not fit) at `DEVICE_LAYER_CANDIDATES` and ``num_layers``
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
                previous = [v for n, v in tried.items() if n < k]
                rises = rises + 1 if previous and value > previous[-1] else 0
                if rises == 2:
                    stopped = True
                    break
            if stopped:
                break
        while True:
            fits = {k: v for k, v in tried.items() if v is not None}
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
) -> int:
    """The least GPU memory (fixed part included) any plan needs at ``costs``' batch shape,
    within the host and NVMe capacities, with the embedding and head stepped where
    ``const_update`` says (None: either; that is the host, as the device step only adds), its
    offloads modelled with ``offload_window`` (a longer one holds them longer)."""
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
    )
    res = built.model.solve(time_limit_s, 1e-6)
    if res.x is None:
        raise RuntimeError(f"MILP solver failed while minimising GPU memory: {res.message}")
    return math.ceil((_value(built.gpu_var, res.x) + _MARGIN_GB) * GB)


def _infeasible_message(
    costs: CostTable,
    gpu_bytes: int | None,
    tiers: tuple[str, ...],
    max_segment: int,
    recompute: tuple[str, ...],
    const_update: str | None,
    device_layers: int | None = 0,
    offload_window: int = 1,
) -> str:
    budget = costs.gpu_bytes if gpu_bytes is None else gpu_bytes
    need = min_gpu_bytes(costs, tiers=tiers, max_segment=max_segment, recompute=recompute,
                         const_update=const_update, offload_window=offload_window)
    device = ""
    if const_update == "device":
        device = (f", or step the embedding and head on the host (const_update=host: their GPU step "
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

"""The planner against the executor on a real shape: profile, solve, run, predicted vs measured.

One process, one model in host memory (random init of a real config):

    python -m bench.plan_bench --model qwen2.5-7b --optimizer hybrid8bit --seq 1024 --batch 64 \
        --runs solved megatrain keep_all:max --cap-gb 24 --out bench/results

1. ``lazytrain profile``'s measurement (`runtime.profiler.profile`) at ``--batch x --seq``;
   the `CostTable` is written next to the results.
2. Each run in ``--runs`` at ``--batch``: ``solved`` (the MILP's plan), ``megatrain``,
   ``keep_all``, ``checkpoint_gpu|host``; ``POLICY:max`` runs the largest batch <=
   ``--max-batch`` (default ``--batch``) the simulator says fits the GPU; on out-of-memory a solved plan (any
   run) is first re-solved at that batch with less GPU memory, as the trainer does
   (`gpu_budget_after_oom`, up to `MAX_OOM_REPLANS` times), then a ``:max`` run's batch walks
   down by 1/16; ``POLICY@GIB`` plans
   that run with a host limit of GIB GiB (its room for host activations: GIB less the model
   state), ``KERNELS/RUN`` runs it only with ``--kernels KERNELS``. Per run: tokens/s,
   TFLOPS by both formulas, step time, the stream breakdown from CUDA events, peak GPU memory
   and activation bytes per tier, host RSS, each next to the simulator's prediction.
3. With ``--cap-gb``: the allocator is capped (``torch.cuda.set_per_process_memory_fraction``)
   and, per policy in ``--cap-runs``, the largest batch is found by running one step at the
   planner's predicted maximum and walking up until out-of-memory (or down until it fits);
   ``--cap-measure`` then times the solved and megatrain plans at their largest batches.

4. Mixed stacks (``--model qwen3.5-9b``): the profile has one entry per layer type; each run
   adds, per type, the planner's decisions, the table's forward / backward / recompute times at
   the run's batch against one layer of that type timed alone at that batch (fwd + bwd), and
   the type's predicted share of the step's GPU compute. ``--kernels torch`` runs the
   Gated-DeltaNet layers on transformers' torch reference instead of fla-core's kernels.
5. ``--split-master on|off`` (default on): fp32 masters as the streamed bf16 weight plus a
   16-bit remainder (``optim/split.py``), or whole. ``--baseline OTHER.json`` (a run of the same
   shape with the other setting) adds each run's tokens/s ratio against the baseline's run of
   the same policy and batch. The host budget (model state per component, the plan's host
   activations, against ``--host-limit-gb`` or the machine less its reserve) is in the records.
6. ``--update cpu skipped``: each run also with the CPU update's cost removed
   (`common.SkippedUpdate`: a step writes nothing), planned and predicted with
   ``optimizer_ns_per_param=0``: what the update costs the step, measured (issue 19; the rows
   of 2026-12-04 used ``--costs`` with the committed 12-03 tables instead of profiling).

7. ``--recalibrate N``: a solved run as the trainer runs it with ``plan.recalibrate_after=N``:
   N + 1 steps first, the CPU update's rate measured in them as the trainer measures it (updates
   2..N, `policies.measured_update_rate`) and the plan re-solved on it when the table's is off
   (`policies.recalibrate`); a plan it switched to is measured and re-solved in turn, as in the
   trainer (up to `policies.MAX_RECALIBRATIONS` rounds, each planned for the measured rate
   `policies.UPDATE_RATE_MARGIN` slower, after the first never faster than the table's); then the measured steps, on the last plan and its table (the
   record's ``recalibration``: the first round's rates, update times and predictions at the top,
   ``changed`` when any round switched, every round in ``rounds``).

JSON (written after every run, so a cut-off call keeps what finished) and Markdown to ``--out``.
``--time-limit SECONDS`` (the call's limit less a margin): a try that cannot finish in what is
left, by the simulator's step time, is a record saying so instead of a run killed with nothing
written (on 2026-12-02 two 9B ``solved:max`` calls ended that way).

The issue-15 rows on the H200 (two commands, each well under 8 minutes):

    python -m bench.plan_bench --model qwen2.5-7b --seq 1024 --batch 64 --runs solved \
        --split-master off --tag _whole --out $OUT
    python -m bench.plan_bench --model qwen2.5-7b --seq 1024 --batch 64 --runs solved \
        --split-master on --tag _split --baseline $OUT/plan_qwen2.5-7b_h200_DATE_s1024_whole.json --out $OUT
    python -m bench.plan_bench --model qwen2.5-14b --seq 1024 --batch 64 --runs solved:max \
        --split-master on --tag _split --out $OUT
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from bench.common import (
    SkippedUpdate,
    bench_session,
    device_tag,
    oom_record,
    random_batch,
    record_oom_sites,
    run_header,
    timed_steps,
    today,
    write_results,
)
from lazytrain.model.kernels import select_linear_attention_kernels
from lazytrain.plan.costs import RECOMPUTE_OPTIONS, CostTable, usable_gpu_bytes
from lazytrain.plan.milp import PlanInfeasible
from lazytrain.plan.plan import Plan, keep_all_plan
from lazytrain.plan.policies import (
    MAX_RECALIBRATIONS,
    PolicyOptions,
    measured_update_rate,
    planned_update_rate,
    policy_plan,
    recalibrate,
)
from lazytrain.plan.search import MAX_OOM_REPLANS, gpu_budget_after_oom, search_batch
from lazytrain.plan.simulate import simulate
from lazytrain.runtime.device import cap_gpu_memory, oom_need_bytes
from lazytrain.runtime.executor import Executor
from lazytrain.runtime.profiler import CONSTANTS, measure_constants

GiB = 2**30


def store_gradients(args) -> str:
    """memory.gradients of the session: the one ``--gradients`` value (``placed``: auto, as the
    trainer runs it), or ``auto`` (every host buffer allocated, so that each run places its
    gradients as its value says) for several."""
    if args.gradients == ["placed"]:
        return "auto"
    return args.gradients[0] if len(args.gradients) == 1 else "auto"


def held_layers(store, num_layers: int) -> tuple[int, ...]:
    """The decoder layers the store has no host gradient buffer for (`HostStore.host_grad_groups`;
    none before the first plan has run)."""
    if store.host_grad_groups is None:
        return ()
    return tuple(i for i in range(num_layers) if i + 1 not in store.host_grad_groups)


def options(args, const_update: str = "auto", device_layers: str = "0", device_steps: str = "0",
            offload_window: int = 1, gradients: str | None = None) -> PolicyOptions:
    """A run's policy options. With ``--gradients placed`` the first plan that runs places each
    layer's gradient and allocates only the host buffers it uses, as the trainer does; every later
    plan (baselines too) holds the rest on the GPU (``args.hold_grads``, set after each run)."""
    gradients = gradients or store_gradients(args)
    return PolicyOptions(megatrain_every=args.every, head_chunk_tokens=args.head_chunk, tiers=tuple(args.tiers),
                         recompute=tuple(args.recompute), const_update=const_update,
                         device_layers=None if device_layers == "auto" else int(device_layers),
                         device_steps=None if device_steps == "auto" else int(device_steps),
                         offload_window=offload_window,
                         gradients="auto" if gradients == "placed" else gradients,
                         hold_grads=args.hold_grads)


MAX_TRIES = 8
"""Runs a `tries` search may take in all."""


STARTED = time.perf_counter()
TRY_SETUP_S = 30
"""A try's time beyond its predicted steps (the executor, pinned host buffers, kernel compiles
at a new batch), for ``--time-limit``: a guess, not measured."""


def tries(policy: str, batch: int, costs: CostTable, seq: int, plan_at: Callable[[CostTable], Plan],
          run_at: Callable[[CostTable, Plan, int], dict | None], walk_down: bool) -> int:
    """Run ``policy`` at ``batch``. After an out-of-memory a solved plan is re-solved at the same
    batch with less GPU memory and run again, as the trainer does (`gpu_budget_after_oom`, up to
    `MAX_OOM_REPLANS` times); with ``walk_down`` (``POLICY:max``) the batch then walks down too
    (the re-solve first: a smaller batch's
    solved plan fills the card again, and on 2026-12-02 all six batches from 206 down to 151
    failed in the same stage), then the batch walks down by 1/16 (one step per try: a try at 9B
    and b200+ takes a minute). ``run_at(table, plan, replans)`` runs a plan and returns None,
    or the out-of-memory record (``predicted_peak_gpu_gb``, ``seen_peak_gpu_gb``). The batch
    that ran, or 0. A smaller batch starts from the last budget a re-solve found a plan for
    (the excess the failures showed is the planner's, not the batch's), and the tries end at
    `MAX_TRIES` (a minute each at 9B)."""
    budget, replans, feasible, tried = costs.gpu_bytes, 0, costs.gpu_bytes, 0
    while batch >= 1 and tried < MAX_TRIES:
        table = dataclasses.replace(costs.at(batch, seq), gpu_bytes=budget)
        t0 = time.perf_counter()
        try:
            plan = plan_at(table)
        except PlanInfeasible:  # no plan at this batch within the lowered budget
            print(f"{policy}: no plan at batch {batch} within {budget / 1e9:.1f} GB", flush=True)
            plan = None
        failed = None
        if plan is not None:
            feasible, tried = budget, tried + 1
            # a cut-off call's log then shows where its time went (2026-12-02: two 9B solved:max
            # calls were killed at the time limit with nothing logged after the batch search)
            print(f"{policy} b{batch}: planned in {time.perf_counter() - t0:.0f} s; try {tried} of {MAX_TRIES} "
                  f"starts at {time.strftime('%H:%M:%S')}", flush=True)
            failed = run_at(table, plan, replans)
            if failed is None:
                return batch
            if "not_started" in failed or "error" in failed:  # no time left for a try at this batch, or a
                return 0  # failure other than running out of memory (its record says which)
        if failed is not None and policy == "solved" and replans < MAX_OOM_REPLANS:
            # what the release left beyond the try's start (as the trainer counts it)
            left = (failed["gpu_alloc_after_release_gb"] - failed["gpu_alloc_at_start_gb"]
                    if "gpu_alloc_after_release_gb" in failed and "gpu_alloc_at_start_gb" in failed else 0.0)
            budget = gpu_budget_after_oom(budget, int(failed["predicted_peak_gpu_gb"] * 1e9),
                                          int(failed["seen_peak_gpu_gb"] * 1e9), int(left * 1e9))
            replans += 1
            if budget > 0:
                print(f"{policy} b{batch}: re-solving for {budget / 1e9:.1f} GB (try {replans} of "
                      f"{MAX_OOM_REPLANS}, as the trainer would)", flush=True)
                continue
        if not walk_down:
            return 0
        budget, replans = feasible, 0
        batch -= max(1, batch // 16)
    return 0


def predicted_max_batch(policy: str, costs: CostTable, seq: int, cap: int, args, limit: int,
                        offload_window: int = 1) -> int:
    """The largest batch <= ``limit`` whose ``policy`` plan the simulator fits in ``cap`` bytes
    (a solved plan's offloads modelled with ``offload_window``)."""
    if policy == "solved":
        o = options(args)
        try:
            return search_batch(costs, seq, goal="max_batch", batch_sizes=range(1, limit + 1), gpu_bytes=cap,
                                tiers=tuple(args.tiers), optimizer_overlap=True,
                                head_chunk_tokens=args.head_chunk,
                                offload_window=offload_window, gradients=o.gradients,
                                hold_grads=o.hold_grads).plan.batch_size
        except PlanInfeasible:
            return 0
    best = 0
    for b in range(1, limit + 1):
        table = dataclasses.replace(costs.at(b, seq), gpu_bytes=cap)
        if not simulate(policy_plan(policy, table, options(args)), table, optimizer_overlap=True).feasible:
            break
        best = b
    return best


def per_type(plan: Plan, table: CostTable, measured_ms: dict[str, float]) -> dict:
    """Per layer type: the plan's decisions, the table's times at the run's batch and the
    type's predicted GPU compute in the step (forward, backward, recompute of recomputed
    layers, the no-grad rebuild of dropped ones), next to ``measured_ms`` (fwd + bwd of one
    layer of the type, alone)."""
    out = {}
    for kind, lc in table.type_costs().items():
        members = [i for i, t in enumerate(table.layer_types) if t == kind]
        decisions: dict[str, int] = {}
        compute_ms = 0.0
        for i in members:
            lp = plan.layers[i]
            label = lp.mode if lp.mode == "drop" else f"{lp.mode}/{lp.tier}"
            if lp.recompute != "none":
                label += f"+{lp.recompute}"
            decisions[label] = decisions.get(label, 0) + 1
            compute_ms += lc.forward_ms + lc.backward_ms
            if lp.mode == "keep":
                compute_ms += lc.kept(lp.recompute).recompute_ms
            else:
                compute_ms += lc.recompute_ms
            if lp.mode == "drop":
                compute_ms += lc.forward_ms
        out[kind] = {
            "layers": len(members),
            "decisions": decisions,
            "predicted_forward_ms": lc.forward_ms,
            "predicted_backward_ms": lc.backward_ms,
            "predicted_recompute_ms": lc.recompute_ms,
            "predicted_fwd_bwd_ms": lc.recompute_ms + lc.backward_ms,
            "measured_fwd_bwd_ms": measured_ms.get(kind),
            "predicted_compute_s": compute_ms / 1e3,
            "weight_bytes": lc.weight_bytes,
            "saved_bytes": lc.saved_bytes,
            "recompute_options": {k: {"saved_bytes": rc.saved_bytes, "recompute_ms": rc.recompute_ms}
                                  for k, rc in lc.recompute_options.items()},
        }
    return out


def probe(session, plan) -> tuple[bool, str, float]:
    """One forward+backward of ``plan``: (fits, out-of-memory message, peak allocated GB)."""
    device = session.device
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    executor = None
    try:
        executor = Executor(session.adapter, session.store, plan, device, nvme=session.nvme)
        ids, labels = random_batch(plan.batch_size, plan.seq_len, session.adapter.vocab_size, seed=0)
        executor.forward_backward(ids, labels)
        torch.cuda.synchronize(device)
        return True, "", torch.cuda.max_memory_allocated(device) / 1e9
    except torch.OutOfMemoryError as error:
        return False, str(error).split("\n")[0], torch.cuda.max_memory_allocated(device) / 1e9
    finally:
        del executor
        gc.collect()
        torch.cuda.empty_cache()


def largest_batch(policy, costs, seq, cap, args, session) -> dict:
    """Predicted and measured largest batch of ``policy`` under the cap (a solved plan's offloads
    modelled with the first ``--offload-window``)."""
    window = args.offload_window[0] if policy == "solved" else 1
    predicted = predicted_max_batch(policy, costs, seq, cap, args, args.cap_max_batch, window)
    tries = []

    def attempt(b: int) -> bool:
        table = dataclasses.replace(costs.at(b, seq), gpu_bytes=cap)
        try:
            plan = policy_plan(policy, table, options(args, offload_window=window), gpu_bytes=cap)
        except PlanInfeasible as error:
            tries.append({"batch_size": b, "fits": False, "why": f"no plan: {error}"[:200]})
            return False
        ok, why, peak = probe(session, plan)
        tries.append({"batch_size": b, "fits": ok, "peak_alloc_gb": peak, **({"why": why} if why else {})})
        print(f"  cap {args.cap_gb} GiB {policy} b{b}: {'fits' if ok else 'OOM'} (peak {peak:.1f} GB) {why[:120]}",
              flush=True)
        return ok

    b = max(predicted, 1)
    if attempt(b):
        measured = b
        for up in range(b + 1, b + 1 + args.cap_up):
            if not attempt(up):
                break
            measured = up
    else:
        lo, hi = 0, b  # lo fits (0: nothing known to), hi does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if attempt(mid) else (lo, mid)
        measured = lo
    return {"policy": policy, "cap_gb": args.cap_gb, "predicted_max_batch": predicted,
            "measured_max_batch": measured, "tries": tries,
            "capped_search": measured == b + args.cap_up and measured > 0}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-7b")
    parser.add_argument("--optimizer", choices=["fp32", "hybrid8bit", "hybrid4bit"], default="hybrid8bit")
    parser.add_argument("--fetch-allocation", choices=["h2d", "compute"], default="compute",
                        help="GPU memory pool of activations fetched back from the host tier (ActivationStore)")
    parser.add_argument("--state-rounding", choices=["auto", "nearest", "stochastic"], default="auto",
                        help="optimizer.state_rounding of 8-bit or 4-bit states (the profile times that step; "
                             "auto: the config's rule, nearest for 8-bit states of a built-in shape, stochastic "
                             "for 4-bit states)")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--runs", nargs="*", default=["solved", "megatrain", "keep_all:max"])
    parser.add_argument("--max-batch", type=int, default=None,
                        help="largest batch a POLICY:max run may take (default --batch)")
    parser.add_argument("--kernels", nargs="+", choices=["auto", "torch"], default=["auto"],
                        help="Gated-DeltaNet kernels: auto (fla-core on CUDA when installed) or torch; "
                             "with both, one study each on the same model in host memory (a run spec "
                             "KERNELS/POLICY[:max] runs with those kernels only)")
    parser.add_argument("--tiers", nargs="+", default=["gpu", "host"], help="activation tiers the MILP may use")
    parser.add_argument("--recompute", nargs="*", choices=RECOMPUTE_OPTIONS, default=list(RECOMPUTE_OPTIONS),
                        help="what the MILP may recompute inside a kept layer (plan.recompute_blocks); none: whole "
                             "layers only")
    parser.add_argument("--nvme-dir", default=None, help="profile the NVMe tier here (and let runs use it)")
    parser.add_argument("--every", type=int, default=4, help="megatrain checkpoint interval")
    parser.add_argument("--head-chunk", type=int, default=4096)
    parser.add_argument("--stage-memory", action="store_true",
                        help="record each stage's peak GPU allocation in the last step, against the simulator's")
    parser.add_argument("--oom-sites", action="store_true",
                        help="keep every CUDA allocation's Python stack; an out-of-memory record then sums what "
                             "was live per allocation site and stream (oom_live; costs time per allocation)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--time-limit", type=float, default=0,
                        help="seconds from the start this process may take: a try whose predicted steps (plus "
                             f"{TRY_SETUP_S} s set-up) do not fit in what is left is a record saying so, not "
                             "a run killed from outside with nothing written")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--cap-gb", type=float, default=None)
    parser.add_argument("--cap-runs", nargs="*", default=["solved", "megatrain", "keep_all"])
    parser.add_argument("--cap-max-batch", type=int, default=64)
    parser.add_argument("--cap-up", type=int, default=3, help="batches tried above the first that fits")
    parser.add_argument("--cap-measure", action="store_true", help="time solved and megatrain at their cap batch")
    parser.add_argument("--update", nargs="+", choices=["cpu", "skipped"], default=["cpu"],
                        help="the CPU update as trained (cpu), and/or with its cost removed (skipped: a "
                             "step writes nothing; the plan is solved and predicted with "
                             "optimizer_ns_per_param=0, bench/studies/ceiling_bound.py's 'free CPU update' row); "
                             "each run is measured once per choice")
    parser.add_argument("--const-update", nargs="+", choices=["auto", "host", "device"], default=["auto"],
                        help="where the embedding and head take their optimizer step (plan.const_update); "
                             "several: each run once per choice")
    parser.add_argument("--device-layers", nargs="+", default=["0"],
                        help="first decoder layers resident on the GPU and stepped there with the embedding and "
                             "head (plan.device_layers): numbers, or auto (the MILP chooses); several: each "
                             "run once per value (runs with --const-update host take 0)")
    parser.add_argument("--device-steps", nargs="+", default=["0"],
                        help="streamed decoder layers after the resident ones stepped on the GPU, their states "
                             "copied in and out (plan.device_steps): numbers, or auto (the fewest that hide the "
                             "CPU update at the table's rate); several: each run once per value, crossed with "
                             "--device-layers (runs with --const-update host take 0)")
    parser.add_argument("--offload-window", type=int, nargs="+", default=[1],
                        help="stages a host-tier offload's copy may take in the solved plan's model "
                             "(plan.offload_window); several: each run once per value")
    parser.add_argument("--recalibrate", type=int, default=0, metavar="N",
                        help="solved runs with the CPU update: N + 1 steps first, then the plan re-solved on the "
                             "update rate they measured, as the trainer does with plan.recalibrate_after=N (N >= 2); "
                             "0: off")
    parser.add_argument("--optimizer-threads", nargs="+", type=int, default=[],
                        help="torch intra-op threads (the CPU optimizer's team) for the runs: several: each run "
                             "once per value (default: torch's, one per core)")
    parser.add_argument("--costs", nargs="+", default=[], metavar="[KERNELS=]FILE",
                        help="use this costs.json instead of profiling (KERNELS=FILE: for that kernel study only)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--tag", default="")
    parser.add_argument("--split-master", choices=["on", "off"], default="on",
                        help="fp32 masters split into the bf16 weight + a 16-bit remainder (on) or whole; "
                             "--master, where given, decides")
    parser.add_argument("--master", choices=["fp32", "split", "bf16"], default=None,
                        help="memory.master of every run (bf16: the streamed weight is the master, not exact)")
    parser.add_argument("--gradients", nargs="+", choices=["host", "gpu", "auto", "placed"], default=["host"],
                        help="memory.gradients of every run: each decoder layer's gradient on the host, or held on "
                             "the GPU (no host buffers: the flagship's host budget; every plan, baselines too), or "
                             "auto: the solved plan places each one (every host buffer allocated, so that any plan "
                             "runs: the A/B of its time against host, not of host memory), or placed: auto as the "
                             "trainer runs it (the first plan to run places each gradient and only its host buffers "
                             "are allocated; later plans, baselines too, hold the others on the GPU: put the solved "
                             "run first); several: each run once per value, every host buffer allocated as for auto")
    parser.add_argument("--host-limit-gb", type=float, default=None,
                        help="host budget in GiB (default: the machine less its reserve)")
    parser.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto",
                        help="model.dtype (auto: bf16 on a GPU, fp32 on the CPU; bf16 on the CPU rehearses a bf16 "
                             "or split master run's code paths)")
    parser.add_argument("--baseline", default=None, help="records of the same shape to compare tokens/s with")
    parser.add_argument("--report", default=None, metavar="FILE",
                        help="write FILE's Markdown report again (no run): give the options it ran with")
    args = parser.parse_args(argv)
    args.hold_grads = ()  # the layers with no host gradient buffer, once a run allocated them (`options`)
    if "placed" in args.gradients and len(args.gradients) > 1:
        parser.error(f"--gradients {' '.join(args.gradients)}: placed allocates the first plan's host buffers "
                     "only, so it cannot be A/B'd against other values in one process; give it alone")
    if any(w < 1 for w in args.offload_window):
        parser.error(f"--offload-window {' '.join(map(str, args.offload_window))}: each must be >= 1")
    if args.master is None:
        args.master = "split" if args.split_master == "on" else "fp32"
    if args.report:  # the options the records ran with, --state-rounding resolved
        path = Path(args.report)
        records = json.loads(path.read_text())
        write_results(records, path.name.removesuffix(".json"), markdown(records, args), path.parent)
        print(path.with_suffix(".md"))
        return
    if args.recalibrate and args.recalibrate < 2:
        parser.error(f"--recalibrate {args.recalibrate}: N must be 0 (off) or >= 2 (updates 2..N are timed)")
    for spec in args.costs or ():  # before the model is built (minutes at 7B)
        path = Path(spec.rpartition("=")[2])
        if not path.is_file():
            parser.error(f"--costs {spec}: there is no file {str(path)!r} (relative to {os.getcwd()}); give a "
                         "cost table written by a profile (bench/results/costs_*.json, lazytrain profile)")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("plan_bench needs a CUDA device (--device cpu runs a smoke test of the script)")
    if args.device != "cuda" and args.cap_gb:
        raise SystemExit("--cap-gb needs a CUDA device")
    if args.oom_sites and args.device == "cuda":
        record_oom_sites()
    t0 = time.perf_counter()
    session = bench_session(
        args.model, optimizer=args.optimizer, device=args.device, batch=args.batch, seq=args.seq,
        head_chunk=args.head_chunk, nvme_dir=args.nvme_dir,
        overrides=(f"model.dtype={args.dtype}", f"memory.master={args.master}", f"memory.gradients={store_gradients(args)}",
                   *([f"memory.host_limit_gb={args.host_limit_gb}"] if args.host_limit_gb else []),
                   f"optimizer.state_rounding={args.state_rounding}"))
    args.state_rounding = session.config.state_rounding()  # auto resolved: what the records say
    print(f"model {args.model}: {session.store.num_params / 1e9:.2f}B params, built in "
          f"{time.perf_counter() - t0:.0f} s ("
          + ", ".join(f"{k} {v:.1f} s" for k, v in session.store.build_seconds.items()) + ")", flush=True)
    for kernels in args.kernels:
        study(session, args, kernels)


def recalibrated(session, table: CostTable, plan: Plan, policy_options: PolicyOptions,
                 args, running: dict) -> tuple[CostTable, Plan, dict]:
    """What the trainer's recalibration (``plan.recalibrate_after`` = ``args.recalibrate``) makes
    of ``plan`` (`Trainer._recalibrate`), round by round as in the trainer: the updates of steps
    1..N timed (each read at the next step's start: N + 1 steps run), their rate taken as the
    trainer takes it (`policies.measured_update_rate`: the first left out) and planned for with
    the trainer's margin (`policies.planned_update_rate`: after the first round never faster
    than the table's) and the plan re-solved on it
    (`policies.recalibrate`); a round that switched plans is followed by one on the new plan, up to
    `MAX_RECALIBRATIONS` rounds (a further round that ``args.time_limit`` cannot hold is not run).
    The table and plan to measure, and what happened: the first round's fields (its table's rate
    as ``profiled_ns_per_param``), ``changed`` when any round switched, and every round in
    ``rounds`` (each with ``table_ns_per_param``: the rate of the table it started from).
    ``running`` holds the plan, table and rounds so far, for a round whose steps run out of memory."""
    n = args.recalibrate
    rounds: list[dict] = []
    while len(rounds) < MAX_RECALIBRATIONS:
        if rounds and args.time_limit:
            step = simulate(plan, table, optimizer_overlap=True).step_time_s
            need = (n + 1 + args.warmup + args.steps) * step + 2 * TRY_SETUP_S
            if need > args.time_limit - (time.perf_counter() - STARTED):
                rounds[-1]["stopped"] = f"no room in --time-limit {args.time_limit:g} for another round"
                break
        running.update(plan=plan, table=table, rounds=rounds)
        calibration = timed_steps(session, plan, warmup=1, steps=n, fetch_allocation=args.fetch_allocation)
        info = {"calibration_steps": n + 1, "changed": False, "device_layers": plan.device_layers,
                "table_ns_per_param": table.optimizer_ns_per_param}
        rounds.append(info)
        if calibration["update_out_of_memory"] is not None:  # some GPU steps went to the CPU midway
            info["skipped"] = "a GPU optimizer step ran out of memory: " + calibration["update_out_of_memory"]
            break
        measured = measured_update_rate(calibration["cpu_update_s_by_step"], calibration["cpu_update_params"])
        if measured is None or not measured > 0:
            info["skipped"] = "no CPU update to measure"
            break
        planned = planned_update_rate(measured, table, earlier=len(rounds) > 1)
        found = recalibrate(plan, table, planned, policy_options)
        info.update(measured_ns_per_param=measured, planned_ns_per_param=planned, changed=bool(found and found.changed),
                    update_s_by_step=calibration["cpu_update_s_by_step"],
                    calibration_step_time_s=calibration["step_time_s"])
        if found is not None:
            info.update(predicted_current_s=found.current_s, predicted_resolved_s=found.resolved_s)
            table, plan = found.costs, found.plan
        print(f"recalibration round {len(rounds)}: the CPU update ran at {measured:.3f} ns/param (updates 2-{n}) "
              f"against {info['table_ns_per_param']:.3f} in the table"
              + f" (planned for {planned:.3f}"
              + (" with the margin" if planned != info["table_ns_per_param"] else ": the table's") + "); "
              + ("within the tolerance: the plan kept" if found is None else
                 f"current plan predicted at {found.current_s:.3f} s, re-solved at {found.resolved_s:.3f} s: "
                 + ("switching to it" if found.changed else "keeping the current one")), flush=True)
        if not info["changed"]:
            break
    running.update(plan=plan, table=table, finished=True)
    return table, plan, {**rounds[0], "profiled_ns_per_param": rounds[0]["table_ns_per_param"],
                         "changed": any(r["changed"] for r in rounds), "rounds": rounds}


def predicted_stages(record: dict, predicted) -> None:
    """Each measured stage's peak next to the simulator's: [stage, measured GB, predicted GB]."""
    if "stage_memory_gb" in record:
        by_name = dict(zip(predicted.stage_names, predicted.gpu_bytes_by_stage))
        record["stage_memory_gb"] = [[name, gb, by_name.get(name, 0) / 1e9] for name, gb in record["stage_memory_gb"]]


def load_costs(path: str, session, args) -> CostTable:
    """A saved cost table with this run's host budget (``--host-limit-gb``) and GPU; one written
    before the embedding's and the head's working sets were measured as now
    (`profiler.CONSTANTS`) gets those constants measured here, on this model at the table's
    shape, so an older profile's layer costs stay usable."""
    d = json.loads(Path(path).read_text())
    missing = [name for name in CONSTANTS if name not in d]
    if missing:
        batch, seq = d["batch_size"], d["seq_len"]
        executor = Executor(session.adapter, session.store,
                            keep_all_plan(session.adapter.num_layers, batch, seq, args.head_chunk), session.device)
        measured = measure_constants(executor, session.store, session.device, batch, seq)
        print(f"{path} has no {', '.join(missing)}: embedding and head measured now at b{batch} s{seq}: "
              + ", ".join(f"{k} {v:.4g}" for k, v in measured.items()), flush=True)
        d = {**d, **measured, "notes": {**d.get("notes", {}), "constants": (
            f"{', '.join(CONSTANTS)} measured by bench/plan_bench.py on {today()}: the table predates {', '.join(missing)}")}}
    chunk = session.optimizer.device_step_chunk
    stale = chunk is not None and d.get("device_step_chunk") != chunk  # timed in other pieces (or unrecorded)
    if ("const_update_ms" not in d or not d.get("device_step_work_bytes") or stale) and session.device.type == "cuda":
        from lazytrain.runtime.profiler import const_update_costs, release_gpu_garbage

        ms, nbytes, work, chunk = const_update_costs(session.make_optimizer, session.store, session.adapter,
                                                     session.device, 5)
        release_gpu_garbage(session.device)  # its scratch step's GPU memory, before any plan runs
        measured = {"device_step_work_bytes": work, "device_step_chunk": chunk}
        if "const_update_ms" not in d or stale:
            measured.update(const_update_ms=ms, const_update_bytes=nbytes)
        print(f"{path} has no {', '.join(k for k in measured if k not in d)} or measured them in other pieces "
              f"({d.get('device_step_chunk')}): the device step measured now in pieces of {chunk}: {ms} ms, "
              f"{nbytes / 1e9:.2f} GB held, {work / 1e9:.2f} GB while it runs", flush=True)
        key = "const_update" if "const_update_ms" in measured else "device_step_work"
        d = {**d, **measured, "notes": {**d.get("notes", {}), key: (
            f"{', '.join(measured)} measured by bench/plan_bench.py on {today()}: the table predates them or "
            "measured them in other pieces")}}
    return session.for_this_run(CostTable.from_dict(d))


def study(session, args, kernels: str) -> None:
    """Profile, then every run of ``args.runs`` meant for ``kernels``; one record file."""
    device, store = session.device, session.store
    date, dev = today(), device_tag(device)
    kernels_tag = "_torch-kernels" if kernels == "torch" else ""
    stem = f"plan_{args.model}_{dev}_{date}_s{args.seq}{kernels_tag}{args.tag}"
    common = run_header(device, model=args.model, optimizer=args.optimizer, overlap_optimizer=True,
                        cuda_alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
                        split_master=args.master == "split", master=args.master,
                        gradients="placed" if args.gradients == ["placed"] else store_gradients(args),
                        world_size=1, runner="lazytrain",
                        state_rounding=args.state_rounding, fetch_allocation=args.fetch_allocation,
                        recompute_allowed=list(args.recompute))
    baseline = json.loads(Path(args.baseline).read_text()) if args.baseline else []
    records: list[dict] = []
    os.makedirs(args.out, exist_ok=True)

    def save() -> None:
        write_results(records, stem, markdown(records, args), args.out)

    adapter = session.adapter
    if adapter.kernels is not None:
        adapter.kernels = select_linear_attention_kernels(device, kernels)
        common["kernels"] = {"delta_rule": adapter.kernels.delta_rule, "conv": adapter.kernels.conv}
        common["layer_types"] = {kind: adapter.layer_types.count(kind) for kind in adapter.layer_type_names()}
    host = store.bytes(session.optimizer.state_bytes())
    common["num_params"] = store.num_params
    common["host_bytes_per_param"] = host.per_param()
    print(f"host bytes/param {host.per_param()}", flush=True)

    t0 = time.perf_counter()
    given = dict(spec.rpartition("=")[::2] for spec in args.costs)
    costs_file = given.get(kernels) or given.get("")
    if store_gradients(args) == "auto" and args.gradients != ["placed"] and store.host_grad_groups is None:
        store.allocate_grads(range(len(store.weights)))  # before the table: its host room counts them
    if costs_file:
        costs = load_costs(costs_file, session, args).at(args.batch, args.seq)
    else:
        costs = session.cost_table()  # (its host room without the gradients' buffers where they are held)
        costs.save(os.path.join(args.out, f"costs_{args.model}_{dev}_{date}_s{args.seq}_b{args.batch}{kernels_tag}{args.tag}.json"))
    if store_gradients(args) == "gpu" and store.host_grad_groups is None:
        # every plan holds every decoder layer's gradient: host buffers for the embedding and head
        # only, allocated once the profile (whose executor keeps its layers' on the host) is done
        store.allocate_grads([0, len(store.weights) - 1])
    layers = "; ".join(
        f"{kind}: fwd {lc.forward_ms:.1f} ms, bwd {lc.backward_ms:.1f} ms, recompute {lc.recompute_ms:.1f} ms, "
        f"saved {lc.saved_bytes / 1e9:.2f} GB, input {lc.input_bytes / 1e9:.2f} GB"
        + "".join(f", {k} recomputed: saved {rc.saved_bytes / 1e9:.2f} GB, +{rc.recompute_ms:.1f} ms"
                  for k, rc in lc.recompute_options.items())
        for kind, lc in costs.type_costs().items()
    )
    print(f"profiled in {time.perf_counter() - t0:.0f} s: {layers}; "
          f"H2D {costs.h2d_gbps:.1f} D2H {costs.d2h_gbps:.1f} both {costs.bidir_gbps:.1f} GB/s, slowdown "
          f"{costs.copy_slowdown:.3f} {costs.notes.get('copy_slowdown', '')}; optimizer {costs.optimizer_ns_per_param:.3f} ns/param; NVMe write "
          f"{costs.nvme_write_gbps:.2f} read {costs.nvme_read_gbps:.2f} GB/s", flush=True)
    records.append({"name": "costs", **common, "costs": costs.to_dict()})
    save()


    def measure(policy: str, table: CostTable, plan, name: str, cap_gb: float | None = None,
                host_limit_gib: float | None = None, update: str = "cpu",
                policy_options: PolicyOptions | None = None) -> bool:
        """Time ``plan``; record it with its prediction (or its out-of-memory, or why it was not
        started). Whether it ran. With ``--recalibrate`` and ``policy_options`` (a solved plan,
        the CPU update), re-solved on the update rate its first steps measure first."""
        recalibrating = bool(args.recalibrate and policy_options is not None and policy == "solved"
                             and update == "cpu")
        if args.time_limit:
            step = simulate(plan, table, optimizer_overlap=True).step_time_s
            steps, setups = args.warmup + args.steps, 1
            if recalibrating:  # its own steps and executor first, and the re-solve (10 s on the H200
                # at 7B, 2026-12-04; up to ~60 s with auto k on 2 cores): a set-up's time more
                steps, setups = steps + args.recalibrate + 1, 3
            need = steps * step + setups * TRY_SETUP_S
            left = args.time_limit - (time.perf_counter() - STARTED)
            if need > left:
                records.append({"name": name, **common, "policy": policy, "batch_size": plan.batch_size,
                                "seq_len": args.seq, "not_started": (
                                    f"{steps} steps of {step:.1f} s predicted + {setups} x {TRY_SETUP_S} s "
                                    f"set-up need {need:.0f} s, {left:.0f} s left of --time-limit {args.time_limit:g}")})
                print(f"{name}: not started: {records[-1]['not_started']}", flush=True)
                save()
                return False
        host_short = [v for v in simulate(plan, table, optimizer_overlap=True).violations if v.startswith("host")]
        if host_short:  # a run the host cannot hold is not tried: pinned buffers past the RAM can take the machine
            records.append({"name": name, **common, "policy": policy, "batch_size": plan.batch_size,
                            "seq_len": args.seq, "not_started": f"does not fit: {'; '.join(host_short)}"})
            print(f"{name}: not started: {records[-1]['not_started']}", flush=True)
            save()
            return False
        recalibration, running = None, {}
        try:
            if recalibrating:
                table, plan, recalibration = recalibrated(session, table, plan, policy_options, args, running)
            record = timed_steps(session, plan, warmup=args.warmup, steps=args.steps, stage_memory=args.stage_memory,
                                 fetch_allocation=args.fetch_allocation,
                                 optimizer=SkippedUpdate(session.optimizer) if update == "skipped" else None)
        except torch.OutOfMemoryError as error:
            # a recalibration round's plan when one of its steps ran out (``running``)
            table, plan = running.get("table", table), running.get("plan", plan)
            records.append(oom_record(name, common, policy, plan.batch_size, args.seq, error))
            if "rounds" in running:  # the recalibration so far, and which steps ran out
                records[-1]["recalibration"] = {"rounds": running["rounds"], "out_of_memory_in": (
                    "the measured steps" if running.get("finished") else f"round {len(running['rounds']) + 1}")}
            predicted = simulate(plan, table, optimizer_overlap=True)
            predicted_stages(records[-1], predicted)
            records[-1]["plan"] = plan.to_dict()  # what ran out of memory, for bench/studies/stage_memory_check.py
            records[-1]["planner_gpu_budget_gb"] = table.gpu_bytes / 1e9
            records[-1]["predicted_peak_gpu_gb"] = predicted.peak_gpu_bytes / 1e9
            # with stage memory the allocator's peak is reset per stage: the finished stages' too
            stages = tuple(int(b * 1e9) for _, b, *_ in records[-1].get("stage_memory_gb", []))
            records[-1]["seen_peak_gpu_gb"] = oom_need_bytes(error, device, stages) / 1e9
            print(f"{name}: out of memory: {records[-1]['oom']}"
                  + (f" after stage {records[-1]['oom_after_stage']}" if "oom_after_stage" in records[-1] else ""),
                  flush=True)
            save()
            return False
        except Exception as error:  # noqa: BLE001 -- recorded, and the next run still tried
            records.append({"name": name, **common, "policy": policy, "batch_size": plan.batch_size,
                            "seq_len": args.seq, "error": f"{type(error).__name__}: {error}"[:2000],
                            "traceback": traceback.format_exc()[-4000:], "plan": plan.to_dict()})
            print(f"{name}: failed: {records[-1]['traceback']}", flush=True)
            save()
            return False
        finally:  # the first plan to run allocated its host gradient buffers (``--gradients placed``)
            args.hold_grads = held_layers(store, adapter.num_layers)
        predicted = simulate(plan, table, optimizer_overlap=True)
        record.update(predicted.metrics())
        predicted_stages(record, predicted)
        record["prediction_error"] = record["predicted_step_time_s"] / record["step_time_s"] - 1
        record["per_layer_type"] = per_type(plan, table, record["compute_only_layer_ms_by_type"])
        record["gpu_mem_cap_gb"] = cap_gb
        record["update"] = update
        if recalibration is not None:
            record["recalibration"] = recalibration
        record["cpu_threads"] = torch.get_num_threads()
        host = session.host_memory(int(record["predicted_act_host_gb"] * 1e9), table)
        limit = host.limit if host_limit_gib is None else int(host_limit_gib * GiB)
        record["host_budget_gb"] = {**{k: v / 1e9 for k, v in host.components().items()},
                                    "total": host.total / 1e9, "limit": limit / 1e9,
                                    "machine": host.machine / 1e9, "fits": host.total <= limit}
        base = next((b for b in baseline if b.get("policy") == policy and b.get("batch_size") == plan.batch_size
                     and "tokens_per_s" in b), None)
        if base is not None:
            record["baseline"] = base["name"] + (" (split master)" if base.get("split_master") else " (whole master)")
            record["tokens_per_s_vs_baseline"] = record["tokens_per_s"] / base["tokens_per_s"]
        record["plan"] = plan.to_dict()
        record["planner_gpu_budget_gb"] = table.gpu_bytes / 1e9
        records.append({"name": name, **common, **record})
        if policy_options is not None:  # (several --gradients: this run's)
            records[-1]["gradients"] = policy_options.gradients
        if args.gradients == ["placed"]:  # the layers with no host buffer, held on the GPU by every plan
            records[-1]["held_grad_layers"] = list(args.hold_grads)
        print(json.dumps({k: v for k, v in records[-1].items() if k not in ("plan", "step_times_s")}), flush=True)
        save()
        return True

    def plan_for(policy: str, const_update: str, device_layers: str, device_steps: str, window: int,
                 gradients: str, table: CostTable) -> Plan:
        return policy_plan(policy, table, options(args, const_update, device_layers, device_steps, window,
                                                  gradients))

    def run_for(policy: str, suffix: str, host_gib: str, update: str, policy_options: PolicyOptions,
                table: CostTable, plan: Plan, replans: int) -> dict | None:
        """Measure ``plan``: None when it ran, else its out-of-memory record."""
        name = f"{args.model}_{policy}_b{plan.batch_size}_s{args.seq}{suffix}{args.tag}" + (
            f"_replan{replans}" if replans else "")
        if measure(policy, table, plan, name, host_limit_gib=float(host_gib) if host_gib else None,
                   update=update, policy_options=policy_options):
            return None
        return records[-1]

    for spec in args.runs:
        only, _, spec = spec.rpartition("/")
        if only and only != kernels:
            continue
        spec, _, host_gib = spec.partition("@")
        policy, _, size = spec.partition(":")
        run_costs, suffix = costs, ""
        if host_gib:  # this run's host limit: the room for host activations is what it leaves
            state = session.host_memory()
            run_costs = dataclasses.replace(costs, host_bytes=max(int(float(host_gib) * GiB) - state.total, 0))
            suffix = f"_host{host_gib}"
        for update in args.update:
            # skipped: planned as if the update were free, which it then is
            table = run_costs if update == "cpu" else dataclasses.replace(run_costs, optimizer_ns_per_param=0.0)
            for const_update, device_layers, device_steps, threads, window, gradients in [
                    (c, k, s, t, w, g) for c in args.const_update for k in (["0"] if c == "host" else args.device_layers)
                    for s in (["0"] if c == "host" else args.device_steps)
                    for t in args.optimizer_threads or [None]
                    for w in (args.offload_window if policy == "solved" else [1])
                    for g in args.gradients]:
                if threads is not None:
                    torch.set_num_threads(threads)  # a new updater thread takes it up too
                run_suffix = (suffix + ("" if update == "cpu" else "_update-skipped")
                              + ("" if args.const_update == ["auto"] else f"_const-{const_update}")
                              + ("" if args.device_layers == ["0"] or const_update == "host" else f"_dl{device_layers}")
                              + ("" if args.device_steps == ["0"] or const_update == "host" else f"_ds{device_steps}")
                              + ("" if threads is None else f"_t{threads}")
                              + ("" if len(args.gradients) == 1 else f"_grad-{gradients}")
                              + ("" if args.offload_window == [1] or policy != "solved" else f"_ow{window}")
                              + (f"_recal{args.recalibrate}" if args.recalibrate and policy == "solved"
                                 and update == "cpu" else ""))
                batch = args.batch
                if size == "max":
                    t0 = time.perf_counter()
                    batch = predicted_max_batch(policy, table, args.seq, table.gpu_bytes, args,
                                                args.max_batch or args.batch, window)
                    print(f"{policy}{run_suffix}: largest batch the simulator fits: {batch} (searched in "
                          f"{time.perf_counter() - t0:.0f} s)", flush=True)
                tries(policy, batch, table, args.seq, functools.partial(plan_for, policy, const_update, device_layers,
                                                                      device_steps, window, gradients),
                      functools.partial(run_for, policy, run_suffix, host_gib, update,
                                        options(args, const_update, device_layers, device_steps, window,
                                                gradients)),
                      walk_down=size == "max")

    if args.cap_gb:
        cap_gpu_memory(device, args.cap_gb)
        cap = usable_gpu_bytes(int(args.cap_gb * GiB))  # what the planner may fill
        found = {}
        for policy in args.cap_runs:
            result = largest_batch(policy, costs, args.seq, cap, args, session)
            found[policy] = result["measured_max_batch"]
            records.append({"name": f"cap{args.cap_gb:g}_{policy}_s{args.seq}{args.tag}", **common,
                            "seq_len": args.seq, **result})
            print(json.dumps(records[-1]), flush=True)
            save()
        if args.cap_measure:
            for policy in ("solved", "megatrain"):
                b = found.get(policy, 0)
                if b < 1:
                    continue
                table = dataclasses.replace(costs.at(b, args.seq), gpu_bytes=cap)
                window = args.offload_window[0] if policy == "solved" else 1
                plan = policy_plan(policy, table, options(args, offload_window=window), gpu_bytes=cap)
                # one step fitted; a few in a row may not: measure records that rather than lose the run
                measure(policy, table, plan, f"{args.model}_{policy}_b{b}_s{args.seq}_cap{args.cap_gb:g}", args.cap_gb)
    save()
    print(markdown(records, args))


NAN = float("nan")  # a figure only a GPU run measures (stream trace, CUDA peaks)


def markdown(records: list[dict], args) -> str:
    head = records[0] if records else {}
    lines = [
        f"# Planner vs executor: {args.model}, seq {args.seq}",
        "",
        f"{head.get('date')}, {head.get('device')}, torch {head.get('torch')}, optimizer {args.optimizer} "
        + (f"with {args.state_rounding} rounding of sqrt(v) " if args.optimizer == "hybrid8bit" else "")
        + (f"with {args.state_rounding} rounding of m and sqrt(v) " if args.optimizer == "hybrid4bit" else "")
        + f"(overlapped), {args.master} masters, gradients {'placed by the first plan' if args.gradients == ['placed'] else 'on the ' + ' / '.join(args.gradients)}, {args.warmup} warm-up + "
        f"{args.steps} measured steps (median), random tokens. Host bytes/param: "
        f"{head.get('host_bytes_per_param', {}).get('total', float('nan')):.3f}. Command: "
        f"`python -m bench.plan_bench --model {args.model} --optimizer {args.optimizer} --seq {args.seq} "
        f"--batch {args.batch} --runs {' '.join(args.runs)}"
        + (f" --state-rounding {args.state_rounding}" if args.state_rounding != "nearest" else "")
        + (f" --fetch-allocation {args.fetch_allocation}" if args.fetch_allocation != "compute" else "")
        + (f" --update {' '.join(args.update)}" if args.update != ["cpu"] else "")
        + (f" --const-update {' '.join(args.const_update)}" if args.const_update != ["auto"] else "")
        + (f" --device-layers {' '.join(args.device_layers)}" if args.device_layers != ["0"] else "")
        + (f" --device-steps {' '.join(args.device_steps)}" if args.device_steps != ["0"] else "")
        + (f" --optimizer-threads {' '.join(map(str, args.optimizer_threads))}" if args.optimizer_threads else "")
        + (f" --costs {' '.join(args.costs)}" if args.costs else "")
        + (f" --max-batch {args.max_batch}" if args.max_batch else "")
        + (f" --kernels {' '.join(args.kernels)}" if args.kernels != ["auto"] else "")
        + f" --warmup {args.warmup} --steps {args.steps} --master {args.master} --gradients {' '.join(args.gradients)}"
        + (f" --host-limit-gb {args.host_limit_gb:g}" if args.host_limit_gb else "")
        + (f" --baseline {args.baseline}" if args.baseline else "")
        + (f" --cap-gb {args.cap_gb:g} --cap-runs {' '.join(args.cap_runs)}" if args.cap_gb else "")
        + (" --cap-measure" if args.cap_measure else "") + "`",
        "",
    ]
    costs = next((r for r in records if r["name"] == "costs"), None)
    if costs and "kernels" in costs:
        lines += [(f"Gated-DeltaNet kernels: gated-delta rule `{costs['kernels']['delta_rule']}`, short convolution "
                  f"`{costs['kernels']['conv']}`; layer types {costs['layer_types']}."), ""]
    if costs:
        c = costs["costs"]
        table = CostTable.from_dict(c)
        layer_text = "; ".join(
            (f"{kind} layer " if len(table.type_costs()) > 1 else "layer ")
            + f"forward {lc.forward_ms:.1f} ms, backward {lc.backward_ms:.1f} ms, recompute {lc.recompute_ms:.1f} ms, "
            f"saved {lc.saved_bytes / 1e9:.2f} GB, input {lc.input_bytes / 1e9:.2f} GB"
            for kind, lc in table.type_costs().items()
        )
        lines += [
            (f"Profiled at batch {c['batch_size']} x seq {c['seq_len']}: {layer_text}; head+loss "
            f"{c['head_ms']:.1f} ms; H2D {c['h2d_gbps']:.1f}, D2H {c['d2h_gbps']:.1f}, both {c['bidir_gbps']:.1f} "
            f"GB/s; compute slowdown under copies {c['copy_slowdown']:.3f}"
            + ("" if "copy_slowdown" not in c.get("notes", {}) else " (" + ", ".join(
                f"{k} {v:.3f}" for k, v in c["notes"]["copy_slowdown"].items()) + ")")
            + "; CPU optimizer "
            f"{c['optimizer_ns_per_param']:.3f} ns/param"
            + (f"; embedding + head step on the GPU {c['const_update_ms']:.1f} ms, "
               f"{c['const_update_bytes'] / 1e9:.2f} GB" if c.get("const_update_ms") is not None else "")
            + f"; NVMe write {c['nvme_write_gbps']:.2f} / read {c['nvme_read_gbps']:.2f} GB/s."),
            "",
        ]
    # a mixture of experts' 6NT counts its active parameters (``tflops_active``; 6NT by all of
    # them, ``tflops_6nt``, stays in the records)
    moe = any("tflops_active" in r for r in records)
    lines += [
        (f"| run | tokens/s | {'TFLOPS 6 N_active T' if moe else 'TFLOPS 6NT'} | TFLOPS model | step s (predicted) | error | GPU compute s (pred.) | "
         "exposed H2D s (pred.) | exposed D2H s (pred.) | GPU idle other s (pred.) | optimizer wait s | "
         "peak GPU alloc GB (pred.) | host acts GB (pred.) | host RSS GB |"),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        if "oom" in r:
            lines.append(f"| {r['name']} | out of memory: {r['oom']} |" + " |" * 12)
        if "not_started" in r:
            lines.append(f"| {r['name']} | not started: {r['not_started']} |" + " |" * 12)
        if "error" in r:
            lines.append(f"| {r['name']} | failed: {r['error'].splitlines()[0][:300].replace('|', '/')} |" + " |" * 12)
        if "tokens_per_s" not in r:
            continue
        lines.append(
            f"| {r['name']} | {r['tokens_per_s']:.0f} | {r.get('tflops_active', r['tflops_6nt']):.1f} | {r['tflops_model']:.1f} | "
            f"{r['step_time_s']:.2f} ({r['predicted_step_time_s']:.2f}) | {100 * r['prediction_error']:+.1f}% | "
            f"{r.get('gpu_compute_s', NAN):.2f} ({r['predicted_gpu_compute_s']:.2f}) | {r.get('exposed_h2d_s', NAN):.3f} "
            f"({r['predicted_exposed_h2d_s']:.3f}) | {r.get('exposed_d2h_s', NAN):.3f} ({r['predicted_exposed_d2h_s']:.3f}) | "
            f"{r.get('gpu_idle_other_s', NAN):.2f} ({r['predicted_gpu_idle_other_s']:.2f}) | {r['optimizer_wait_s']:.2f} | "
            f"{r.get('peak_gpu_alloc_gb', NAN):.1f} ({r['predicted_peak_gpu_gb']:.1f}) | {r.get('act_host_gb', 0):.1f} "
            f"({r['predicted_act_host_gb']:.1f}) | {r['host_rss_gb']:.1f} |"
        )
    recalibrated = [r for r in records if "recalibration" in r]
    if recalibrated:
        lines += ["", ("Recalibrated before the measured steps (`--recalibrate`, as the trainer's "
                       "`plan.recalibrate_after`): the CPU update's rate in the first steps against the table's, and "
                       "the plan then measured:"), ""]
        for r in recalibrated:
            said = []
            for i, c in enumerate(r["recalibration"].get("rounds", [r["recalibration"]]), 1):
                if "measured_ns_per_param" not in c:
                    said.append(f"round {i}: {c.get('skipped', 'not recalibrated')}")
                    continue
                planned = c.get("planned_ns_per_param", c["measured_ns_per_param"])
                what = ("within the tolerance, the plan kept" if "predicted_resolved_s" not in c else
                        f"the plan predicted at {c['predicted_current_s']:.3f} s on it, re-solved at "
                        f"{c['predicted_resolved_s']:.3f} s: " + ("switched" if c["changed"] else "kept"))
                said.append(f"round {i}: {c['measured_ns_per_param']:.3f} ns/param measured (updates 2-"
                            f"{c['calibration_steps'] - 1}, as the trainer) against "
                            f"{c.get('table_ns_per_param', c.get('profiled_ns_per_param')):.3f}"
                            + (f", planned for {planned:.3f}" if planned != c["measured_ns_per_param"] else "")
                            + f"; {what}" + (f"; {c['stopped']}" if "stopped" in c else ""))
            if "out_of_memory_in" in r["recalibration"]:
                said.append(f"out of memory in {r['recalibration']['out_of_memory_in']}")
            lines.append(f"- {r['name']}: " + "; ".join(said) + f" (last plan: device layers "
                         f"{r['plan']['device_layers']}, device steps {r['plan']['device_steps']})")
    typed = [r for r in records if len(r.get("per_layer_type", {})) > 1]
    if typed:
        lines += ["", ("Per layer type (predicted: the cost table at the run's batch; measured: one layer of the type, "
                  "fwd + bwd alone at that batch):"), "",
                  ("| run | type | layers | decisions | fwd+bwd ms predicted (measured) | recompute ms | "
                  "predicted GPU compute in the step s |"), "|---|---|---|---|---|---|---|"]
        for r in typed:
            for kind, t in r["per_layer_type"].items():
                decisions = ", ".join(f"{n} {label}" for label, n in t["decisions"].items())
                measured = t["measured_fwd_bwd_ms"]
                lines.append(
                    f"| {r['name']} | {kind} | {t['layers']} | {decisions} | {t['predicted_fwd_bwd_ms']:.1f} "
                    f"({measured:.1f}) | {t['predicted_recompute_ms']:.1f} | {t['predicted_compute_s']:.2f} |"
                )
    for r in records:
        if "host_budget_gb" in r:
            hb = r["host_budget_gb"]
            parts = ", ".join(f"{k} {hb[k]:.1f}" for k in ("weights", "masters", "gradients", "optimizer",
                                                             "activations", "staging"))
            if r.get("stage_memory_gb"):
                worst = sorted(r["stage_memory_gb"], key=lambda t: t[1] - t[2], reverse=True)[:5]
                lines.append(f"\n{r['name']}: stages whose measured peak GPU allocation exceeds the prediction most "
                             "(GB, measured / predicted): "
                             + ", ".join(f"{name} {gb:.1f} / {pred:.1f}" for name, gb, pred in worst))
            lines.append(f"\n{r['name']}: host budget (GB) {parts}; total {hb['total']:.1f} of {hb['limit']:.1f} "
                         f"(machine {hb['machine']:.1f}, {'fits' if hb['fits'] else 'OVER'}); measured host RSS "
                         f"{r['host_rss_gb']:.1f} GB." + (f" tokens/s {r['tokens_per_s_vs_baseline']:.3f}x "
                         f"{r['baseline']}." if "baseline" in r else ""))
    for r in records:
        if "tokens_per_s" in r and "h2d_act_busy_s" in r:
            act_gb = r.get("act_host_gb", 0)
            lines.append(
                f"\n{r['name']}: saved activations on the copy streams: H2D {r['h2d_act_busy_s']:.2f} s busy, D2H "
                f"{r['d2h_act_busy_s']:.2f} s busy for {act_gb:.1f} GB each way"
                + (f" ({act_gb / r['h2d_act_busy_s']:.1f} / {act_gb / r['d2h_act_busy_s']:.1f} GB/s)"
                   if r["h2d_act_busy_s"] > 0 and r["d2h_act_busy_s"] > 0 else "")
                + f"; host time in their GPU allocations {r.get('act_fetch_alloc_s', NAN):.3f} s; allocator per "
                f"step: {r.get('cuda_num_alloc_retries', NAN):.0f} retries, {r.get('cuda_num_sync_all_streams', NAN):.0f} "
                f"device syncs, {r.get('cuda_num_device_alloc', NAN):.0f} / {r.get('cuda_num_device_free', NAN):.0f} "
                f"device allocations / frees; least host memory available {r.get('host_available_min_gb') or NAN:.1f} "
                f"of {r.get('host_total_gb', NAN):.1f} GB.")
    for r in records:
        if "oom" in r and r.get("stage_memory_gb"):
            last = ", ".join(f"{name} {gb:.1f} / {pred:.1f}" for name, gb, pred in r["stage_memory_gb"][-4:])
            lines.append(f"\n{r['name']}: out of GPU memory in the stage after {r['oom_after_stage']}; the stages "
                         f"before it (GB, measured / predicted): {last}.")
    caps = [r for r in records if "measured_max_batch" in r]
    if caps:
        lines += ["", f"Largest batch with the GPU capped at {caps[0]['cap_gb']:g} GiB "
                  "(`torch.cuda.set_per_process_memory_fraction`), seq " + str(args.seq) + ":", "",
                  "| policy | predicted | measured (one fwd+bwd runs) | tries (no plan: the MILP finds none in the cap) |", "|---|---|---|---|"]
        for r in caps:
            tries = ", ".join(f"b{t['batch_size']} " + ("ok" if t["fits"] else "no plan" if t.get("why", "").startswith("no plan")
                                                       else "OOM") for t in r["tries"])
            lines.append(f"| {r['policy']} | {r['predicted_max_batch']} | {r['measured_max_batch']}"
                         f"{' (search capped)' if r['capped_search'] else ''} | {tries} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

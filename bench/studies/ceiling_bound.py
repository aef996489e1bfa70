"""What a step's distance from compute-only is made of, by the planner's own model: the solved
plan's predicted step on a profiled cost table, then again with one resource at a time made free.

No GPU: it reads a committed `CostTable` (``lazytrain profile`` / ``bench/plan_bench.py`` wrote
it on the device), solves the MILP as the trainer would (`solve_plan`, the CPU update overlapped
with the next forward) and simulates the plan, for each scenario:

- ``as profiled``: the table as measured (``bench/plan_bench.py`` quotes this prediction);
- ``free CPU update``: ``optimizer_ns_per_param = 0`` (the update costs nothing, wherever it
  runs);
- ``CPU update x F``: the update F times faster (``--speedups``);
- ``free transfers``: host links 1000x faster (weights, gradients and host-tier activations);
- ``free CPU update and transfers``: both: what is left is recompute, forced by the card's memory;
- ``no memory limit``: card and host as large as the plan wants (no recompute is forced): the
  streamed step's floor with this table's layer and head times;
- ``free CPU update, card + N GB``: what N GB fewer saved bytes (or a larger card) would buy
  once the update is off the critical path (``--extra-gb``);
- ``CPU update F x slower``: the update as a step's copies slow it (``--slowdowns``; on the H200
  the 7B steps of 12-01..12-04 updated at 0.224-0.336 ns/param against profiles of 0.253-0.275,
  and the update is memory-bound there, `bench/optim_bench.py --threads`);
- ``embedding + head updated on the GPU``: the plan's ``const_update="device"`` (their update
  on the card, timed by the profiler: ``const_update_ms``, ``const_update_bytes``), alone and
  with each slowdown; every other row keeps them on the host, so this row shows what moving
  them buys. A table profiled before 2026-12-04 has no such time: the row then estimates it,
  their update taken off the CPU (``const_params`` no longer on the CPU's timeline, no GPU time)
  and their master remainders and states held on the card (``--device-update-bytes``: bytes per
  parameter taken from the card); not counted there: their gradients held on the card until
  the update (2 B per parameter, 1.09 GB for the 7B head) and the update's temporaries.
- ``embedding, head and first layers on the GPU (auto k)``: with ``const_update_ms`` only, the
  device plan with the planner choosing how many of the first decoder layers are resident and
  stepped on the card too (`Plan.device_layers`; each number tried in the record's notes).
- ``..., OPTION recompute MS ms``: that row with every layer's sub-layer recompute OPTION timed at
  MS ms (``--recompute-ms OPTION=MS``), its bytes as profiled: what a faster recompute would buy
  before it is profiled (e.g. ``mlp=27.6``, twice the 7B table's ``mlp_up``, for the lean MLP's
  ``mlp`` that recomputes the gate and up projections instead of checkpointing the block); and,
  on a table with ``const_update_ms`` (auto k), again with each ``--slowdowns`` factor (the
  update's rate inside a step, which the trainer's recalibration re-solves for).

Compute-only (the issue-19 denominator) is taken from the table as each layer's forward +
backward plus the head and the embedding (``bench/plan_bench.py`` measures it with the weights
resident instead: at 7B b64 4.34 + 0.50 s against this table's 4.29 + 0.50).

    python -m bench.studies.ceiling_bound bench/results/costs_qwen2.5-7b_h200_2026-12-03_s1024_b64_fused.json

JSON records and a Markdown report go to ``--out`` as ``ceiling_bound_<table stem>``.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from bench.common import write_results
from lazytrain.plan.costs import CostTable
from lazytrain.plan.milp import PlanInfeasible, solve_plan
from lazytrain.plan.plan import Plan
from lazytrain.plan.simulate import simulate

FAST = 1000.0
"""How much faster a resource made "free" runs (infinite would divide by zero in the model)."""
LARGE = 10**15
"""Bytes of a memory made unlimited."""


def compute_only_s(costs: CostTable) -> float:
    """Each layer's forward + backward at the table's shape, plus the head and the embedding."""
    layers = sum(layer.forward_ms + layer.backward_ms for layer in costs.layers)
    return (layers + costs.head_ms + costs.embed_forward_ms + costs.embed_backward_ms) * 1e-3


RESIDENT_LAYERS = "embedding, head and first layers on the GPU (auto k)"
SLOWDOWNS = [1.33]
"""``--slowdowns``' default."""

DEVICE_UPDATE_BYTES = 4.0625
"""Card bytes per parameter whose update runs on the GPU: the split master's 16-bit remainder (the
bf16 weight is resident anyway) and the 8-bit m and sqrt(v) with their block absmax."""


def scenarios(costs: CostTable, speedups: list[float], extra_gb: list[float], slowdowns: list[float] = (),
              device_update_bytes: float = DEVICE_UPDATE_BYTES) -> list[tuple[str, CostTable, str]]:
    """(name, cost table, where the embedding and head are stepped: `Plan.const_update`) per row."""
    fast_links = {"h2d_gbps": costs.h2d_gbps * FAST, "d2h_gbps": costs.d2h_gbps * FAST,
                  "bidir_gbps": costs.bidir_gbps * FAST}
    out = [("as profiled", costs), ("free CPU update", dataclasses.replace(costs, optimizer_ns_per_param=0.0))]
    out += [(f"CPU update x {f:g}", dataclasses.replace(costs, optimizer_ns_per_param=costs.optimizer_ns_per_param / f))
            for f in speedups]
    out += [("free transfers", dataclasses.replace(costs, **fast_links)),
            ("free CPU update and transfers", dataclasses.replace(costs, optimizer_ns_per_param=0.0, **fast_links)),
            ("no memory limit", dataclasses.replace(costs, gpu_bytes=LARGE, host_bytes=LARGE))]
    out += [(f"free CPU update, card + {gb:g} GB",
             dataclasses.replace(costs, optimizer_ns_per_param=0.0, gpu_bytes=costs.gpu_bytes + int(gb * 1e9)))
            for gb in extra_gb]
    ns = costs.optimizer_ns_per_param
    out += [(f"CPU update {f:g} x slower", dataclasses.replace(costs, optimizer_ns_per_param=ns * f)) for f in slowdowns]
    out = [(name, table, "host") for name, table in out]
    if costs.const_update_ms is not None:
        on_gpu, const_update = {}, "device"
    else:  # estimated (see the module docstring)
        on_gpu = {"const_params": 0, "head_params": None,
                  "gpu_bytes": costs.gpu_bytes - int(costs.const_params * device_update_bytes)}
        const_update = "host"
    out += [("embedding + head updated on the GPU", dataclasses.replace(costs, **on_gpu), const_update)]
    out += [(f"embedding + head updated on the GPU, CPU update {f:g} x slower",
             dataclasses.replace(costs, optimizer_ns_per_param=ns * f, **on_gpu), const_update) for f in slowdowns]
    return out


def with_recompute_ms(costs: CostTable, option: str, ms: float) -> CostTable:
    """``costs`` with every layer's recompute ``option`` taking ``ms`` (its bytes as profiled)."""
    return dataclasses.replace(costs, layers=[dataclasses.replace(layer, recompute_options={
        **layer.recompute_options, option: dataclasses.replace(layer.recompute_options[option], recompute_ms=ms)})
        for layer in costs.layers])


def row(name: str, costs: CostTable, table: str, time_limit: float, profiled_plan: Plan | None = None,
        const_update: str = "host", device_layers: int | None = 0) -> dict:
    """The scenario's solved plan (the embedding and head stepped where ``const_update`` says,
    with ``device_layers`` resident layers: `solve_plan`'s), simulated; with ``profiled_plan`` (the
    as-profiled row's plan) also that plan's step under this scenario's costs, not re-solved
    (timing only: on a smaller card it may not fit)."""
    floor = compute_only_s(costs)
    record = {"name": name, "table": table, "batch_size": costs.batch_size, "seq_len": costs.seq_len,
              "device": costs.device, "optimizer_ns_per_param": costs.optimizer_ns_per_param,
              "head_params": costs.head_params, "const_update": const_update,
              "compute_only_s": floor}
    try:
        plan = solve_plan(costs, optimizer_overlap=True, head_chunk_tokens=costs.head_chunk_tokens or 4096,
                          time_limit_s=time_limit, const_update=const_update, device_layers=device_layers)
    except PlanInfeasible as err:
        return {**record, "status": f"no plan: {err}"}
    sim = simulate(plan, costs, optimizer_overlap=True)
    modes: dict[str, int] = {}
    for lp in plan.layers:
        mode = f"{lp.mode} {lp.tier}" + (f" (recompute {lp.recompute})" if lp.recompute != "none" else "")
        modes[mode] = modes.get(mode, 0) + 1
    metrics = sim.metrics()
    if profiled_plan is not None:
        record["profiled_plan_step_s"] = simulate(profiled_plan, costs, optimizer_overlap=True).step_time_s
    return {**record, "status": "ok", **metrics, "modes": modes, "plan": plan.to_dict(),
            "recompute_s": metrics["predicted_gpu_compute_s"] - floor,
            "step_over_compute_only": metrics["predicted_step_time_s"] / floor,
            "milp_status": plan.notes["milp"]["status"], "device_layers": plan.device_layers,
            "device_layers_tried": plan.notes.get("device_layers")}


def markdown(records: list[dict], table: str, options: str = "") -> str:
    head = records[0]
    lines = [f"# Where the step's distance from compute-only goes: {Path(table).stem}", "",
             (f"The planner's model (MILP + simulator) on `{table}` (batch {head['batch_size']} x seq "
             f"{head['seq_len']}, {head['device']}), each row one resource made free or changed "
             f"(`python -m bench.studies.ceiling_bound {table}{options}`). Compute-only from the table: "
             f"{head['compute_only_s']:.3f} s."), "",
             ("| scenario | predicted step s | / compute-only | GPU compute s | of it recompute and extra s | "
             "exposed H2D + D2H s | CPU wait + other idle s | the profiled plan s | layer modes |"),
             "|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        if r["status"] != "ok":
            lines.append(f"| {r['name']} | {r['status']} | | | | | | | |")
            continue
        modes = ", ".join(f"{k} {v}" for k, v in sorted(r["modes"].items()))
        lines.append(f"| {r['name']} | {r['predicted_step_time_s']:.3f} | {r['step_over_compute_only']:.3f}x | "
                     f"{r['predicted_gpu_compute_s']:.3f} | {r['recompute_s']:.3f} | "
                     f"{r['predicted_exposed_h2d_s']:.3f} + {r['predicted_exposed_d2h_s']:.3f} | "
                     f"{r['predicted_gpu_idle_other_s']:.3f} | {r.get('profiled_plan_step_s', float('nan')):.3f} | "
                     f"{modes} |")
    lines += ["", ("Predictions, not measurements: `bench/plan_bench.py` measures the as-profiled plan (its "
              "records quote this table's prediction next to the measured step). \"of it recompute and extra\": "
              "GPU compute less compute-only (recompute, and compute slowed by copies in flight). \"the profiled "
              "plan\": the as-profiled row's plan under the scenario's costs, not re-solved (what a run of that "
              "plan would take if only the resource changed; timing only).")]
    resident = [r for r in records if r["name"] == RESIDENT_LAYERS and r["status"] == "ok"]
    if resident:
        tried = ", ".join(f"{k}: {v:.3f} s" if v is not None else f"{k}: no plan"
                          for k, v in resident[0]["device_layers_tried"].items())
        lines.append(f"\n\"{RESIDENT_LAYERS}\": the planner kept layers 0..{resident[0]['device_layers'] - 1} "
                     f"resident (device_layers={resident[0]['device_layers']}; predicted step by number: {tried}).")
    for r in records:
        if " recompute " in r["name"] and " ms" in r["name"] and r["status"] == "ok":
            k = r["device_layers"]
            lines.append(f"\n\"{r['name']}\": an estimate, not profiled: every layer's recompute option timed at that "
                         f"(`--recompute-ms`), its bytes as profiled; "
                         + (f"layers 0..{k - 1} resident." if k else "no layer resident."))
    if any(r["const_update"] == "device" for r in records):
        lines.append("\n\"embedding + head updated on the GPU\": the plan's const_update=device with the table's "
                     "const_update_ms and const_update_bytes; every other row steps them on the host.")
    else:
        lines.append("\n\"embedding + head updated on the GPU\": estimated (the table has no const_update_ms): "
                     "their update off the CPU at no GPU time, their states taken from the card.")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("table", help="a cost table JSON (CostTable.save)")
    parser.add_argument("--speedups", type=float, nargs="*", default=[1.5, 2.0])
    parser.add_argument("--extra-gb", type=float, nargs="*", default=[15.0, 30.0, 60.0],
                        help="GPU memory added to the card with a free CPU update: what fewer saved bytes would buy")
    parser.add_argument("--slowdowns", type=float, nargs="*", default=SLOWDOWNS,
                        help="the CPU update this many times slower than profiled (as in a step)")
    parser.add_argument("--device-update-bytes", type=float, default=DEVICE_UPDATE_BYTES,
                        help="card bytes per parameter of a group updated on the GPU, for a table without "
                             "const_update_ms (with it, the profiled const_update_bytes are used)")
    parser.add_argument("--head-params", type=int, default=None,
                        help="the last group's parameters, for a table written before the cost table had "
                             "head_params (its update then runs after the layers', as the executor runs it)")
    parser.add_argument("--recompute-ms", nargs="*", default=[], metavar="OPTION=MS",
                        help="rows with every layer's recompute OPTION (mlp, attention, mlp_up) timed at MS ms")
    parser.add_argument("--time-limit", type=float, default=30.0, help="the MILP's time limit per scenario (s)")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    costs = CostTable.load(args.table)
    retimed = []
    for item in args.recompute_ms:
        option, _, ms = item.partition("=")
        if not all(option in layer.recompute_options for layer in costs.layers):
            parser.error(f"--recompute-ms {item}: not every layer of the table has the recompute option {option!r}")
        try:
            retimed.append((option, float(ms)))
        except ValueError:
            parser.error(f"--recompute-ms {item}: MS must be a number of milliseconds")
    if args.head_params is not None:
        if not 0 <= args.head_params <= costs.const_params:
            parser.error(f"--head-params {args.head_params} is outside 0..{costs.const_params} (the table's "
                         "const_params)")
        costs = dataclasses.replace(costs, head_params=args.head_params)
    named = scenarios(costs, args.speedups, args.extra_gb, args.slowdowns, args.device_update_bytes)
    name, table, const_update = named[0]
    first = row(name, table, args.table, args.time_limit, const_update=const_update)
    profiled = None
    if first["status"] == "ok":
        profiled = Plan.from_dict(first["plan"])
        first["profiled_plan_step_s"] = first["predicted_step_time_s"]
    records = [first] + [row(name, table, args.table, args.time_limit, profiled, const_update)
                         for name, table, const_update in named[1:]]
    if costs.const_update_ms is not None:
        records.append(row(RESIDENT_LAYERS, costs, args.table, args.time_limit, profiled, "device", None))
    for option, ms in retimed:
        table = with_recompute_ms(costs, option, ms)
        if costs.const_update_ms is not None:
            records.append(row(f"{RESIDENT_LAYERS}, {option} recompute {ms:g} ms", table, args.table,
                               args.time_limit, profiled, "device", None))
            ns = table.optimizer_ns_per_param
            records += [row(f"{RESIDENT_LAYERS}, {option} recompute {ms:g} ms, CPU update {f:g} x slower",
                            dataclasses.replace(table, optimizer_ns_per_param=ns * f), args.table, args.time_limit,
                            profiled, "device", None) for f in args.slowdowns]
        else:
            records.append(row(f"as profiled, {option} recompute {ms:g} ms", table, args.table, args.time_limit,
                               profiled))
    for r in records:
        r.pop("plan", None)  # the layer modes say enough; whole plans would bloat the record file
        if r["status"] == "ok":
            print(f"{r['name']:32s} step {r['predicted_step_time_s']:.3f} s  {r['step_over_compute_only']:.3f}x  "
                  f"compute {r['predicted_gpu_compute_s']:.3f}  idle {r['predicted_gpu_idle_other_s']:.3f}", flush=True)
        else:
            print(f"{r['name']:32s} {r['status']}", flush=True)
    stem = f"ceiling_bound_{Path(args.table).stem}" + ("" if args.head_params is None else "_head-last")
    options = "" if args.head_params is None else f" --head-params {args.head_params}"
    if args.recompute_ms:
        stem += "_recompute-" + "-".join(item.replace("=", "") for item in args.recompute_ms)
        options += " --recompute-ms " + " ".join(args.recompute_ms)
    if args.slowdowns != SLOWDOWNS:
        options += " --slowdowns " + " ".join(f"{f:g}" for f in args.slowdowns)
    path = write_results(records, stem, markdown(records, args.table, options), args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

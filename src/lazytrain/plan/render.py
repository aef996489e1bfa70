"""A plan and its simulated step, for people: a terminal table and a PNG."""

from __future__ import annotations

from pathlib import Path

from lazytrain.plan.costs import CostTable
from lazytrain.plan.plan import Plan
from lazytrain.plan.simulate import BOUND_RESOURCES, STREAMS, SimResult

GiB = 2**30
MiB = 2**20
COLORS = {
    ("keep", "gpu"): "#1b7837",
    ("keep", "host"): "#7fbf7b",
    ("keep", "nvme"): "#d9f0d3",
    ("checkpoint", "gpu"): "#2166ac",
    ("checkpoint", "host"): "#67a9cf",
    ("checkpoint", "nvme"): "#d1e5f0",
    ("drop", "gpu"): "#b2182b",
}
TYPE_COLORS = ("#bdbdbd", "#525252", "#969696", "#252525")
"""Layer-type strip of a mixed stack, by order of first appearance."""
STREAM_COLORS = {
    "compute": "#4d4d4d",
    "h2d": "#2166ac",
    "d2h": "#b2182b",
    "nvme": "#e08214",
    "cpu": "#1b7837",
    # streamed GPU optimizer steps (`Plan.device_steps`): their states' copies and the steps
    "h2d_opt": "#92c5de",
    "d2h_opt": "#f4a582",
    "gpu_opt": "#999999",
}
"""A colour for each of `simulate.STREAMS` (a plan with streamed GPU steps drew none for
their streams until 2026-12-07: ``lazytrain plan`` stopped with a KeyError)."""


def _decision(plan: Plan, i: int) -> tuple[str, str]:
    lp = plan.layers[i]
    return (lp.mode, "gpu" if lp.mode == "drop" else lp.tier)


def _layer_bytes(plan: Plan, costs: CostTable, i: int) -> int:
    lp, lc = plan.layers[i], costs.layers[i]
    if lp.mode == "keep":
        return lc.kept(lp.recompute).saved_bytes
    return lc.input_bytes if lp.mode == "checkpoint" else 0


def _mixed(costs: CostTable | None) -> bool:
    return costs is not None and len(set(costs.layer_types)) > 1


def format_plan_table(plan: Plan, sim: SimResult, costs: CostTable | None = None) -> str:
    """Per-layer decisions (runs of equal layers on one row), predicted time, memory by tier.

    With ``costs``, each row also shows the bytes one layer keeps until backward; for a stack
    of several layer types, each row its type, and a table of each type's costs and decisions.
    """
    mixed = _mixed(costs)
    tokens = plan.batch_size * plan.seq_len
    lines = [
        (
            f"plan {plan.policy!r}: batch {plan.batch_size} x seq {plan.seq_len} "
            f"({tokens} tokens), {plan.num_layers} layers, weight prefetch {plan.weight_prefetch}, "
            f"embedding + head stepped on the {plan.const_update}"
            + (f" with layers 0..{plan.device_layers - 1} (resident)" if plan.device_layers else "")
            + (
                f"; layers {plan.device_layers}..{plan.device_layers + plan.device_steps - 1} stepped on the GPU "
                "(states streamed)"
                if plan.device_steps
                else ""
            )
            + (f"; host offloads over up to {plan.offload_window} stages" if plan.offload_window > 1 else "")
        ),
        f"step {sim.step_time_s:.4f} s simulated"
        + (
            f", {plan.predicted_step_time_s:.4f} s by the planner"
            if plan.predicted_step_time_s is not None
            else ""
        )
        + f"; {sim.tokens_per_s:,.0f} tokens/s",
        "",
        f"{'layers':>9}  {'mode':<10}  {'tier':<4}  {'prefetch':>8}  {'recompute':<9}"
        + (f"  {'kept/layer':>10}" if costs else "")
        + (f"  {'type':<16}" if mixed else ""),
    ]
    rows: list[tuple[int, int, tuple]] = []
    for i, lp in enumerate(plan.layers):
        key = (
            lp.mode,
            "-" if lp.mode == "drop" else lp.tier,
            lp.prefetch,
            "-" if lp.recompute == "none" else lp.recompute,
            _layer_bytes(plan, costs, i) if costs else None,
            costs.layer_types[i] if mixed else None,
        )
        if rows and rows[-1][2] == key and rows[-1][1] == i - 1:
            rows[-1] = (rows[-1][0], i, key)
        else:
            rows.append((i, i, key))
    for first, last, (mode, tier, prefetch, recompute, nbytes, kind) in rows:
        span = f"{first}" if first == last else f"{first}-{last}"
        line = f"{span:>9}  {mode:<10}  {tier:<4}  {prefetch:>8}  {recompute:<9}"
        if costs:
            line += f"  {nbytes / MiB:>6.0f} MiB"
        if mixed:
            line += f"  {kind:<16}"
        lines.append(line)
    if mixed:
        header = (
            f"{'layer type':<16}  {'layers':>6}  {'fwd ms':>7}  {'bwd ms':>7}  {'recomp ms':>9}  "
            f"{'saved MiB':>9}  {'weights MiB':>11}  decisions"
        )
        lines += ["", header]
        for kind, lc in costs.type_costs().items():
            members = [i for i, t in enumerate(costs.layer_types) if t == kind]
            tally: dict[str, int] = {}
            for i in members:
                mode, tier = _decision(plan, i)
                label = mode if mode == "drop" else f"{mode}/{tier}"
                if plan.layers[i].recompute != "none":
                    label += f" recomputing {plan.layers[i].recompute}"
                tally[label] = tally.get(label, 0) + 1
            decisions = ", ".join(f"{n} {label}" for label, n in tally.items())
            lines.append(
                f"{kind:<16}  {len(members):>6}  {lc.forward_ms:>7.2f}  {lc.backward_ms:>7.2f}  "
                f"{lc.recompute_ms:>9.2f}  {lc.saved_bytes / MiB:>9.0f}  {lc.weight_bytes / MiB:>11.0f}  "
                f"{decisions}"
            )
    lines += ["", *format_time_breakdown(sim).splitlines()]
    lines += ["", f"{'stream':<8}  {'busy s':>8}  {'on critical path s':>18}"]
    for s in STREAMS:
        lines.append(f"{s:<8}  {sim.busy_s[s]:>8.4f}  {sim.exposed_s.get(s, 0.0):>18.4f}")
    if sim.exposed_s.get("idle", 0.0) > 0:
        lines.append(f"{'idle':<8}  {'':>8}  {sim.exposed_s['idle']:>18.4f}")

    def tier(name: str, peak: int, cap: int) -> str:
        flag = "  OVER" if peak > cap else ""
        return f"{name:<5} peak {peak / GiB:8.2f} GiB of {cap / GiB:8.2f} GiB{flag}"

    lines += [
        "",
        tier("GPU", sim.peak_gpu_bytes, sim.gpu_capacity_bytes) + f"  (at {sim.peak_gpu_stage})",
        tier("host", sim.peak_host_bytes, sim.host_capacity_bytes)
        + ("  (activations)" if set(sim.peak_host_components) <= {"activations"} else "  (activations, gradients)"),
        tier("NVMe", sim.peak_nvme_bytes, sim.nvme_capacity_bytes),
    ]
    lines += [f"! {v}" for v in sim.violations]
    return "\n".join(lines)


TIME_PARTS = {"compute": "compute", "h2d": "exposed H2D", "d2h": "exposed D2H", "cpu_update": "exposed CPU update",
              "nvme": "exposed NVMe", "other": "other waits"}
"""The rows of `format_time_breakdown`'s first line (`SimResult.time_breakdown`)."""


def format_time_breakdown(sim: SimResult) -> str:
    """Where the step's time goes (`SimResult.time_breakdown`), each resource's work in the step
    (`SimResult.resource_busy_s`) and the one that binds it (`SimResult.bound`)."""
    step = sim.step_time_s or 1.0
    parts = sim.time_breakdown()
    spent = ", ".join(f"{TIME_PARTS[k]} {v:.3f} s ({100 * v / step:.0f}%)" for k, v in parts.items()
                      if v > 0 or k == "compute")
    busy = sim.resource_busy_s()
    work = ", ".join(f"{BOUND_RESOURCES[k]} {v:.3f} s" for k, v in sorted(busy.items(), key=lambda kv: -kv[1])
                     if v > 0)
    return (f"where the time goes: step {sim.step_time_s:.3f} s = {spent}\n"
            f"work in the step: {work}; bound by {BOUND_RESOURCES[sim.bound]}")


def format_batch_sweep(tried: list[dict], best_batch: int | None) -> str:
    """One row per batch a sweep tried (`search.SearchResult.tried`): its predicted step,
    tokens/s, where the time goes and what binds it; then the fastest, ``best_batch``."""
    header = (f"{'batch':>6}  {'step s':>8}  {'tokens/s':>9}  {'compute':>8}  {'H2D':>6}  {'D2H':>6}  "
              f"{'CPU upd':>7}  bound by")
    lines = ["(seconds of each step: its compute, and its waits on H2D, D2H and the CPU update)", header]
    for t in tried:
        if not t["feasible"]:
            lines.append(f"{t['batch_size']:>6}  " + (
                "no plan found within the solver's time limit (one may exist)" if t.get("time_limit")
                else "no plan fits the GPU (and the host room beside the model state)"))
            continue
        lines.append(f"{t['batch_size']:>6}  {t['step_time_s']:>8.3f}  {t['tokens_per_s']:>9,.0f}  "
                     f"{t['compute_s']:>8.3f}  {t['h2d_s']:>6.3f}  {t['d2h_s']:>6.3f}  {t['cpu_update_s']:>7.3f}  "
                     f"{BOUND_RESOURCES[t['bound']]}")
    best = next((t for t in tried if t["feasible"] and t["batch_size"] == best_batch), None)
    if best is not None:
        lines.append(f"fastest: batch {best_batch}, {best['tokens_per_s']:,.0f} tokens/s, bound by "
                     f"{BOUND_RESOURCES[best['bound']]}")
    return "\n".join(lines)


COMPONENT_ROWS = (
    ("weights", "weights", "weights"),
    ("masters", None, "masters"),
    ("gradients", "gradients", "gradients"),
    ("optimizer states", None, "optimizer"),
    ("resident groups", "resident", None),
    ("GPU optimizer step", "optimizer step", None),
    ("activations", "activations", "activations"),
    ("staging", None, "staging"),
)
"""The rows of `format_memory_components`: (label, the simulator's GPU component, the host
budget's component)."""


def format_memory_components(sim: SimResult, host: dict[str, int] | None = None) -> str:
    """GiB on the GPU (at the plan's peak stage), the host and NVMe by component: the model
    state's host parts from ``host`` (`memory.budget.HostBudget.components`, which count the
    plan's host-tier activations and gradients), the GPU's and NVMe's from the simulator. The
    GPU's "resident groups" are the embedding, the final norm and head and the allocator's
    reserve (with the device update also their masters and states, and the resident layers')."""
    gpu = sim.peak_gpu_components
    lines = [f"{'memory (GiB)':<20}  {'GPU':>8}  {'host':>8}  {'NVMe':>8}   (GPU at its peak, {sim.peak_gpu_stage})"]

    def cell(value: float | None) -> str:
        return f"{value / GiB:8.2f}" if value else f"{'-':>8}"

    for label, on_gpu, on_host in COMPONENT_ROWS:
        nvme = sim.peak_nvme_bytes if label == "activations" else None
        row = (gpu.get(on_gpu) if on_gpu else None, (host or {}).get(on_host) if on_host else None, nvme)
        if any(row):
            lines.append(f"{label:<20}  {cell(row[0])}  {cell(row[1])}  {cell(row[2])}")
    host_total = sum((host or {}).values())
    lines.append(f"{'total':<20}  {cell(sim.peak_gpu_bytes)}  {cell(host_total)}  {cell(sim.peak_nvme_bytes)}")
    return "\n".join(lines)


def render_plan_png(plan: Plan, sim: SimResult, path: str | Path, costs: CostTable | None = None) -> None:
    """Per-layer decision strip (with each layer's type above it for a mixed stack, given
    ``costs``), GPU memory by stage and a stream timeline, as a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as e:
        raise ImportError(
            "render_plan_png needs matplotlib: pip install matplotlib "
            "(or print format_plan_table instead)"
        ) from e

    fig, (ax_plan, ax_mem, ax_time) = plt.subplots(
        3, 1, figsize=(14, 7), gridspec_kw={"height_ratios": [1, 2, 3]}, constrained_layout=True
    )
    mixed = _mixed(costs)
    height = 0.75 if mixed else 1.0
    for i in range(plan.num_layers):
        # a kept layer recomputing a block in its backward is hatched
        hatch = "//" if plan.layers[i].recompute != "none" else None
        ax_plan.add_patch(plt.Rectangle((i, 0), 1, height, facecolor=COLORS[_decision(plan, i)], hatch=hatch))
    type_handles = []
    if mixed:
        kinds = list(costs.type_costs())
        shade = {kind: TYPE_COLORS[k % len(TYPE_COLORS)] for k, kind in enumerate(kinds)}
        for i, kind in enumerate(costs.layer_types):
            ax_plan.add_patch(plt.Rectangle((i, 0.8), 1, 0.2, color=shade[kind]))
        type_handles = [Patch(color=shade[kind], label=f"type: {kind}") for kind in kinds]
    ax_plan.set_xlim(0, plan.num_layers)
    ax_plan.set_ylim(0, 1)
    ax_plan.set_yticks([])
    ax_plan.set_xlabel("layer")
    used = sorted({_decision(plan, i) for i in range(plan.num_layers)}, key=list(COLORS).index)
    ax_plan.legend(
        handles=[
            Patch(color=COLORS[d], label=f"{d[0]}" + ("" if d[0] == "drop" else f"/{d[1]}"))
            for d in used
        ] + type_handles,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.6),
        ncol=len(used) + len(type_handles),
        fontsize=8,
    )
    ax_plan.set_title(
        f"plan {plan.policy!r}: batch {plan.batch_size} x seq {plan.seq_len}, "
        f"step {sim.step_time_s:.3f} s, {sim.tokens_per_s:,.0f} tokens/s"
    )

    gib = [b / GiB for b in sim.gpu_bytes_by_stage]
    ax_mem.step(range(len(gib)), gib, where="mid", color="#4d4d4d")
    ax_mem.axhline(
        sim.gpu_capacity_bytes / GiB, color="#b2182b", linestyle="--", label="GPU capacity"
    )
    ax_mem.set_ylabel("GPU GiB")
    ax_mem.set_xlabel("stage (embed, forward, head, backward, embed bwd)")
    ax_mem.legend(loc="lower right", fontsize=8)

    lanes = {s: k for k, s in enumerate(STREAMS)}
    for stream, start, end, _ in sim.timeline:
        ax_time.broken_barh(
            [(start, end - start)], (lanes[stream] - 0.4, 0.8), color=STREAM_COLORS[stream]
        )
    ax_time.set_yticks(range(len(STREAMS)), STREAMS)
    ax_time.invert_yaxis()
    ax_time.set_xlim(0, sim.step_time_s)
    ax_time.set_xlabel("seconds")
    fig.savefig(path, dpi=110)
    plt.close(fig)

"""Packed against padded batches on a MetaMathQA-like length mix: non-padding tokens/s.

One process, one model in host memory, one plan at ``--batch x --seq`` (issue 19, packing):

    python -m bench.packing_bench --model qwen2.5-7b --batch 16 --seq 1024 --out bench/results

1. The built-in data with ``data.builtin_length_mix=metamathqa`` (``--samples`` problems padded
   with filler to a MetaMathQA-like spread of lengths, median ~350 tokens), tokenized as
   ``lazytrain train`` does.
2. ``padded``: the trainer's batches without packing, length-grouped (``BatchConfig.
   group_by_length``: sorted by length within windows of 64 batches, each batch padded to its
   longest sample, rounded up to 8 on a GPU). ``packed``: ``data.packing=true``, rows of exactly
   ``--seq`` tokens with attention masked per sample.
3. For each batching, the plan ``lazytrain train`` would run with it (``--policy auto``:
   solved on a GPU, which profiles first, with the attention those batches take: padded rows,
   padded on the right, run unmasked like full ones; packed rows run a block-diagonal mask) at
   ``--batch x --seq``; ``--warmup`` then ``--steps`` steps of each batching through the
   executor with the CPU optimizer overlapped (`bench.common.timed_steps`). A solved plan whose
   step runs out of GPU memory is re-solved with less memory for the planner and run again, as
   ``lazytrain train`` does (``oom_replans``, ``oom_tries`` in the record; on the H200 at 7B,
   batch 64, 2026-12-03, both batchings ran out of memory without it, profiled unmasked and run
   masked then); the next batching's planner keeps the memory the last one ran with.
   tokens/s counts real (non-padding) tokens: the measured steps' tokens over their time.

JSON records (DESIGN.md section 6, plus ``batching``, ``fill_ratio``, ``samples_per_s``) and a
Markdown report to ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from bench.common import (
    bench_session,
    device_tag,
    oom_record,
    run_header,
    timed_steps,
    today,
    write_results,
)
from bench.plan_bench import tries
from lazytrain.data.pipeline import resolve_template, training_batches
from lazytrain.plan.costs import CostTable
from lazytrain.plan.milp import PlanInfeasible
from lazytrain.plan.plan import Plan
from lazytrain.plan.policies import policy_plan
from lazytrain.plan.simulate import simulate
from lazytrain.runtime.device import oom_need_bytes

BATCHINGS = ("padded", "packed")
NAN = float("nan")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-7b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--optimizer", choices=["fp32", "hybrid8bit"], default="hybrid8bit")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--samples", type=int, default=20000, help="built-in training problems")
    parser.add_argument("--policy", default="auto", help="plan.policy (auto: solved on a GPU)")
    parser.add_argument("--head-chunk", type=int, default=4096)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--tag", default="")
    parser.add_argument("--batchings", nargs="+", choices=BATCHINGS, default=list(BATCHINGS),
                        help="which batchings to run (one per process keeps a device call short)")
    parser.add_argument("--report", default=None, metavar="STUDY_JSON",
                        help="run nothing: compare the batchings in a study file (the per-batching records "
                             "merged by python -m bench.merge_results) and write its Markdown report")
    args = parser.parse_args(argv)
    if args.report:
        path = Path(args.report)
        records = json.loads(path.read_text())
        # the report describes what the records ran, not this command's defaults
        head = records[0]
        args.model, args.batch, args.seq = head["model"], head["batch_size"], head["seq_len"]
        args.samples, args.optimizer = head.get("samples", args.samples), head.get("optimizer", args.optimizer)
        args.steps = len(head.get("step_times_s", [])) or args.steps
        compare(records)
        print(write_results(records, path.name.removesuffix(".json"), markdown(records, args), str(path.parent)))
        return

    t0 = time.perf_counter()
    session = bench_session(args.model, optimizer=args.optimizer, device=args.device, batch=args.batch,
                            seq=args.seq, head_chunk=args.head_chunk,
                            overrides=("data.builtin_length_mix=metamathqa", f"data.builtin_train_size={args.samples}",
                                       f"plan.policy={args.policy}"))
    device, store, config = session.device, session.store, session.config
    host = store.bytes(session.optimizer.state_bytes())
    print(f"model {args.model}: {store.num_params / 1e9:.2f}B params, built in {time.perf_counter() - t0:.0f} s",
          flush=True)
    options = session.policy_options()
    # a process running some of the batchings names them: two such runs never overwrite each other
    part = "" if set(args.batchings) == set(BATCHINGS) else "_" + "_".join(args.batchings)
    stem = f"packing_{args.model}_{device_tag(device)}_{today()}_s{args.seq}_b{args.batch}{part}{args.tag}"
    template = resolve_template(config.data)
    records: list[dict] = []
    gpu_bytes = None  # the planner's GPU memory after an out-of-memory re-solve, kept for the next batching
    for batching in args.batchings:
        name = f"{args.model}_{batching}_b{args.batch}_s{args.seq}"
        data = dataclasses.replace(config.data, packing=batching == "packed")
        session.config.data = data  # the plan profiles the attention these batches take
        t0 = time.perf_counter()
        plan, costs = session.plan()
        if gpu_bytes is not None and costs is not None and gpu_bytes < costs.gpu_bytes:
            try:
                plan = policy_plan(plan.policy, dataclasses.replace(costs, gpu_bytes=gpu_bytes), options)
                costs = dataclasses.replace(costs, gpu_bytes=gpu_bytes)
            except PlanInfeasible:  # these batches need more than the last ones ran with
                print(f"{batching}: no plan within the {gpu_bytes / 1e9:.2f} GB the last batching ran with; "
                      f"planned with its own {costs.gpu_bytes / 1e9:.2f} GB", flush=True)
        predicted = simulate(plan, costs).metrics()["predicted_step_time_s"] if costs is not None \
            else plan.predicted_step_time_s
        print(f"{batching}: plan {plan.policy} at batch {plan.batch_size} x seq {plan.seq_len} in "
              f"{time.perf_counter() - t0:.0f} s", flush=True)
        common = run_header(device, model=args.model, optimizer=args.optimizer, overlap_optimizer=True, world_size=1,
                            runner="lazytrain", num_params=store.num_params, host_bytes_per_param=host.per_param(),
                            length_mix="metamathqa", samples=args.samples, predicted_step_time_s=predicted,
                            gpu_mem_cap_gb=None, attention=costs.attention if costs is not None else None)
        stream, report = training_batches(data, session.tokenizer, template, batch_size=args.batch, seed=0,
                                          pad_to_multiple_of=8 if device.type == "cuda" else 1)
        samples_per_step: list[int] = []

        def next_batch(step: int, stream=stream, samples_per_step=samples_per_step):
            batch = next(stream)
            samples_per_step.append(sum(len(row) for row in batch.indices) if batch.document_ids is not None
                                    else len(batch.indices))
            return batch

        ran: dict = {}
        failures: list[dict] = []

        def run_at(table: CostTable | None, plan: Plan, replans: int, name=name, batching=batching,
                   next_batch=next_batch, samples_per_step=samples_per_step, ran=ran, failures=failures,
                   common=common):
            """Time ``plan`` on this batching: None when it ran, else its out-of-memory record."""
            samples_per_step.clear()  # a failed try's batches are not the measured ones
            try:
                ran["record"] = timed_steps(session, plan, warmup=args.warmup, steps=args.steps,
                                            batches=next_batch)
            except torch.OutOfMemoryError as error:
                failed = {**oom_record(name, common, plan.policy, args.batch, args.seq, error),
                          "batching": batching, "seen_peak_gpu_gb": oom_need_bytes(error, device) / 1e9}
                if table is not None:  # a plan made from a cost table: what the planner had and predicted
                    failed.update(planner_gpu_budget_gb=table.gpu_bytes / 1e9,
                                  predicted_peak_gpu_gb=simulate(plan, table).peak_gpu_bytes / 1e9)
                failures.append(failed)
                print(f"{name}: out of memory: {failed['oom']}", flush=True)
                return failed
            ran.update(table=table, plan=plan, replans=replans)
            return None

        if costs is not None and plan.policy == "solved":
            # as `lazytrain train`: an out-of-memory step re-solves the plan with less GPU memory
            tries("solved", args.batch, costs, args.seq, lambda table: policy_plan("solved", table, options),
                  run_at, walk_down=False)
        else:
            run_at(costs, plan, 0)
        if "record" not in ran:
            records.append({**failures[-1], "oom_tries": failures[:-1]})
            continue
        if failures:  # the next batching's planner keeps the memory this one ran with
            gpu_bytes = ran["table"].gpu_bytes
        record = ran["record"]
        record.update(oom_replans=ran["replans"], oom_tries=failures,
                      planner_gpu_budget_gb=None if costs is None else ran["table"].gpu_bytes / 1e9)
        record.pop("predicted_step_time_s")
        record["samples_per_s"] = sum(samples_per_step[args.warmup:]) / sum(record["step_times_s"])
        records.append({"name": name, **common, **record, "batching": batching, "data": report.summary()})
        print(json.dumps(records[-1]), flush=True)
        write_results(records, stem, markdown(records, args), args.out)
    compare(records)
    path = write_results(records, stem, markdown(records, args), args.out)
    print(f"wrote {path}", flush=True)


def compare(records: list[dict]) -> None:
    """The packed record gains ``tokens_per_s_vs_padded`` where both batchings were measured."""
    measured = {r["batching"]: r for r in records if "tokens_per_s" in r}
    if len(measured) == 2:
        measured["packed"]["tokens_per_s_vs_padded"] = (measured["packed"]["tokens_per_s"]
                                                        / measured["padded"]["tokens_per_s"])


def markdown(records: list[dict], args) -> str:
    head = records[0]
    lines = [
        f"# Packed against padded batches: {args.model}, seq {args.seq}, batch {args.batch}",
        "",
        (f"{head['date']}, {head['device']}, torch {head['torch']}, optimizer {args.optimizer} (overlapped), "
         f"plan {head['policy']} per batching (profiled with the attention its batches take), "
         f"{args.warmup} warm-up + {args.steps} measured steps of each. Data: the built-in problems with the "
         f"MetaMathQA-like length mix, {args.samples} samples. padded = length-grouped batches padded to their "
         "longest sample (on the right: they run unmasked); packed = rows of exactly seq tokens, attention "
         "kept within each sample (packed_varlen: flash attention's variable-length kernel; packed: a "
         "block-diagonal mask). tokens/s counts "
         "real (non-padding) tokens, totals over the measured steps' time. Command: `python -m "
         f"bench.packing_bench --model {args.model} --device {args.device} --batch {args.batch} --seq {args.seq} "
         f"--samples {args.samples} --policy {args.policy} --warmup {args.warmup} --steps {args.steps}`"),
        "",
        ("| run | tokens/s (non-pad) | vs padded | fill ratio | samples/s | TFLOPS model | TFLOPS 6NT | "
         "step s (median) | predicted step s (full rows) | peak GPU alloc / reserved GB | host RSS GB |"),
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        if "oom" in r:
            lines.append(f"| {r['name']} | out of memory: {r['oom']} |" + " |" * 9)
            continue
        lines.append(
            f"| {r['name']} | {r['tokens_per_s']:.0f} | {r.get('tokens_per_s_vs_padded', 1.0):.2f}x | "
            f"{r['fill_ratio']:.3f} | {r['samples_per_s']:.1f} | {r['tflops_model']:.1f} | {r['tflops_6nt']:.1f} | "
            f"{r['step_time_s']:.2f} | {r.get('predicted_step_time_s') or NAN:.2f} | {r.get('peak_gpu_alloc_gb', NAN):.1f} / {r.get('peak_gpu_reserved_gb', NAN):.1f} "
            f"| {r['host_rss_gb']:.1f} |"
        )
    for r in records:
        if "host_buffers_gb_by_step" in r:  # padded lengths vary: the pinned buffers must not grow with them
            lines += ["", f"{r['name']}: attention {r.get('attention')}; the activation store's pinned host buffers "
                      "after each measured step: "
                      + ", ".join(f"{gb:.2f}" for gb in r["host_buffers_gb_by_step"]) + " GB."]
    for r in records:
        if r.get("oom_tries"):
            lines += ["", f"{r['name']}: the solved plan ran out of GPU memory {len(r['oom_tries'])} time(s) and was "
                      "re-solved with less memory for the planner, as `lazytrain train` does: "
                      + "; ".join(f"{t['planner_gpu_budget_gb']:.1f} GB given, {t['predicted_peak_gpu_gb']:.1f} "
                                  f"predicted, {t['seen_peak_gpu_gb']:.1f} needed" for t in r["oom_tries"])
                      + (f"; it ran with {r['planner_gpu_budget_gb']:.1f} GB." if r.get("planner_gpu_budget_gb")
                         else ".")]
    reports = sorted({r["report"] for r in records if "report" in r})
    if reports:
        lines += ["", "Merged from " + ", ".join(f"`{name}.json`" for name in reports) + " (one process per "
                  "batching, `--batchings`; `python -m bench.merge_results`, then `--report`)."]
    data = next((r["data"] for r in records if "data" in r), None)
    if data:
        lines += ["", f"Tokenized data: {data}."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

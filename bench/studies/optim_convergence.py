"""8-bit against fp32 AdamW states on the built-in default: final loss and held-out exact match.

Trains the built-in default (`lazytrain train` with no arguments) three times, everything else
equal: fp32 states, 8-bit states, and 8-bit states with the embedding's kept in fp32
(``optimizer.fp32_embedding_states``). Compares the mean loss of the last ``--tail`` steps and
the exact match on the built-in held-out split. Writes a JSON record and a Markdown report.

    python -m bench.studies.optim_convergence --steps 1000 --out bench/results
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
import time
from pathlib import Path

import torch

import lazytrain.optim.adamw as fp32_adamw
from bench.common import cpu_run_device, today
from lazytrain.config import load_config
from lazytrain.optim.hybrid8bit import Fp32State
from lazytrain.train.trainer import Trainer

RUNS = {
    "fp32": ["optimizer.kind=fp32"],
    # the same fp32 AdamW math through torch's single-tensor loop instead of its fused
    # kernel: results differ from "fp32" only by float rounding, so fp32 against
    # fp32_unfused shows how far two runs of one optimizer land apart (the null comparison)
    "fp32_unfused": ["optimizer.kind=fp32"],
    # the same fp32 AdamW math once more, through LazyTrain's own fused kernel (hybrid8bit with
    # every group's states kept fp32): another rounding, one pass over memory like "fp32" (the
    # single-tensor loop of fp32_unfused makes several, 2-3x fp32's time, which bounds the 0.5B
    # fine-tuning study on the H200)
    "fp32_kernel": ["optimizer.kind=hybrid8bit", "optimizer.state_rounding=nearest"],
    # sqrt(v) rounded to the nearest code (explicit: the default, auto, rounds stochastically when
    # fine-tuning loaded weights)
    "hybrid8bit": ["optimizer.kind=hybrid8bit", "optimizer.state_rounding=nearest"],
    # sqrt(v) rounded stochastically instead of to the nearest code
    "hybrid8bit_sr": ["optimizer.kind=hybrid8bit", "optimizer.state_rounding=stochastic"],
    "hybrid8bit_fp32_embedding": ["optimizer.kind=hybrid8bit", "optimizer.state_rounding=nearest",
                                  "optimizer.fp32_embedding_states=true"],
    # the streamed bf16 weight as the master, updated with stochastic rounding (not exact; bf16
    # compute only)
    "hybrid8bit_bf16master": ["optimizer.kind=hybrid8bit", "optimizer.state_rounding=nearest", "memory.master=bf16"],
    # 4-bit blockwise m and sqrt(v)
    "hybrid4bit": ["optimizer.kind=hybrid4bit", "optimizer.state_rounding=nearest"],
    # both: the flagship's host memory (weights 2 + states ~1.06 B/param)
    "hybrid4bit_bf16master": ["optimizer.kind=hybrid4bit", "optimizer.state_rounding=nearest", "memory.master=bf16"],
    # 4-bit m and sqrt(v) rounded stochastically (auto's choice for 4-bit states)
    "hybrid4bit_sr": ["optimizer.kind=hybrid4bit", "optimizer.state_rounding=stochastic"],
    "hybrid4bit_sr_bf16master": ["optimizer.kind=hybrid4bit", "optimizer.state_rounding=stochastic",
                                 "memory.master=bf16"],
}


@contextlib.contextmanager
def _unfused_fp32_adamw():
    fused_adam = fp32_adamw.adam

    def adam(params, grads, *args, fused, grad_scale, **kwargs):
        if grad_scale is not None:  # the fused kernel divides by it; the loop does not take it
            for g in grads:
                g.div_(grad_scale)
        return fused_adam(params, grads, *args, fused=False, foreach=False, grad_scale=None, **kwargs)

    fp32_adamw.adam = adam
    try:
        yield
    finally:
        fp32_adamw.adam = fused_adam


@contextlib.contextmanager
def _all_states_fp32():
    """hybrid8bit with fp32 states for every group (where the optimizer is built and where the
    host budget counts its bytes)."""
    from lazytrain.optim import factory
    from lazytrain.train import session

    chosen = factory.fp32_state_groups

    def every_group(config, num_groups):
        return tuple(range(num_groups))

    factory.fp32_state_groups = session.fp32_state_groups = every_group
    try:
        yield
    finally:
        factory.fp32_state_groups = session.fp32_state_groups = chosen


KIND_CONTEXT = {"fp32_unfused": _unfused_fp32_adamw, "fp32_kernel": _all_states_fp32}


def run(kind: str, steps: int, out_dir: Path, seed: int | None = None, overrides: tuple[str, ...] = (),
        also_eval: tuple[str, int] | None = None, eval_first: bool = False) -> dict:
    """Train ``kind``; its losses, held-out exact match and seconds (training and that
    evaluation). With ``also_eval`` (tier, seed): ``also_exact_match``, the trained model's exact
    match on that tier's held-out split drawn with that seed, and ``also_eval_seconds``. With
    ``eval_first``: ``first_exact_match``, the model's held-out exact match before training (not
    in ``seconds``)."""
    seeded = [] if seed is None else [f"training.seed={seed}"]
    config = load_config(None, [*RUNS[kind], f"training.steps={steps}", *seeded,
                                f"training.output_dir={out_dir}", "training.progress=false", *overrides])
    start = time.perf_counter()
    with KIND_CONTEXT.get(kind, contextlib.nullcontext)():
        trainer = Trainer(config)
        trainer.setup()
        if eval_first:
            first_start = time.perf_counter()
            first = trainer.evaluate()["eval_exact_match"]
            start += time.perf_counter() - first_start
        summary = trainer.train()
        seconds = time.perf_counter() - start
        if also_eval:
            also = trainer.evaluate(*also_eval)["eval_exact_match"]
            also_seconds = time.perf_counter() - start - seconds
    losses = [json.loads(line)["loss"] for line in (out_dir / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line]
    if kind == "fp32_kernel" and not all(isinstance(st, Fp32State) for st in trainer.optimizer.states):
        raise RuntimeError("fp32_kernel: some optimizer group did not keep fp32 states")
    return {"kind": kind, "losses": losses, "exact_match": summary["eval"]["eval_exact_match"],
            "no_answer": summary["eval"]["eval_no_answer"], "seconds": seconds,
            "optimizer_backend": getattr(trainer.optimizer, "backend", "torch-fused"),
            **({"also_exact_match": also, "also_eval_seconds": also_seconds} if also_eval else {}),
            **({"first_exact_match": first} if eval_first else {})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--tail", type=int, default=100, help="steps whose mean loss is compared")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--note", default="", help="a line for the report: what changed since the last run")
    args = parser.parse_args()
    date = today()
    with tempfile.TemporaryDirectory() as tmp:
        runs = {kind: run(kind, args.steps, Path(tmp) / kind)
                for kind in ("fp32", "hybrid8bit", "hybrid8bit_fp32_embedding")}
    tail = {k: sum(r["losses"][-args.tail:]) / len(r["losses"][-args.tail:]) for k, r in runs.items()}
    record = {
        "name": f"optim_convergence_builtin_{args.steps}",
        "date": date,
        "device": cpu_run_device(),
        "torch": torch.__version__,
        "model": "builtin:tiny",
        "steps": args.steps,
        "tail_steps": args.tail,
        "tail_loss_fp32": tail["fp32"],
        "tail_loss_8bit": tail["hybrid8bit"],
        "tail_loss_8bit_fp32_embedding": tail["hybrid8bit_fp32_embedding"],
        "tail_loss_ratio": tail["hybrid8bit"] / tail["fp32"],
        "exact_match_fp32": runs["fp32"]["exact_match"],
        "exact_match_8bit": runs["hybrid8bit"]["exact_match"],
        "exact_match_8bit_fp32_embedding": runs["hybrid8bit_fp32_embedding"]["exact_match"],
        "seconds_fp32": runs["fp32"]["seconds"],
        "seconds_8bit": runs["hybrid8bit"]["seconds"],
        "seconds_8bit_fp32_embedding": runs["hybrid8bit_fp32_embedding"]["seconds"],
        "optimizer_backend_8bit": runs["hybrid8bit"]["optimizer_backend"],
        "note": args.note,
        "loss_at": {str(s): [r["losses"][s - 1] for r in runs.values()]
                    for s in (1, 100, 200, 400, 600, 800, args.steps) if s <= args.steps},
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"optim_convergence_{date}"
    (out / f"{stem}.json").write_text(json.dumps([record], indent=1))
    lines = [
        f"# 8-bit vs fp32 AdamW states on the built-in default ({args.steps} steps)",
        "",
        (f"{date}, {record['device']}, torch {record['torch']}, 8-bit backend "
         f"{record['optimizer_backend_8bit']}. Command: `python -m bench.studies.optim_convergence --steps {args.steps}`"),
        "",
        *([args.note, ""] if args.note else []),
        "| | fp32 states | 8-bit states | 8-bit, embedding fp32 |",
        "| --- | --- | --- | --- |",
        "| mean loss, last {} steps | {:.5f} | {:.5f} | {:.5f} |".format(args.tail, *tail.values()),
        "| held-out exact match (200 problems) | {:.1%} | {:.1%} | {:.1%} |".format(
            *(r["exact_match"] for r in runs.values())),
        "| wall time s | {:.0f} | {:.0f} | {:.0f} |".format(*(r["seconds"] for r in runs.values())),
    ]
    lines += ["| loss at step {} | {:.4f} | {:.4f} | {:.4f} |".format(s, *losses)
              for s, losses in record["loss_at"].items()]
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

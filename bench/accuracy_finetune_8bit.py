"""8-bit optimizer states when fine-tuning: pretrain from scratch, then fine-tune at lr 1e-5.

Per seed: train a built-in shape from scratch on one built-in tier with fp32 states, then
fine-tune that model on another tier at a fine-tuning learning rate with each optimizer kind
(``bench/optim_convergence.py``'s kinds: ``fp32``; ``fp32_unfused``, the same fp32 AdamW math
with other float rounding, the null; ``hybrid8bit``). One record per (kind, seed) with the
fine-tuning loss curve and held-out exact match; the report gives 8-bit's and the null's tail
loss and exact match against fp32 with 90% intervals from resampling the seeds.

    python bench/accuracy_finetune_8bit.py --shape qwen2.5-0.5b --seeds 1 2 3     # the H200 study
    python bench/accuracy_finetune_8bit.py --shape tiny --pretrain-steps 5 --finetune-steps 5 --heldout 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from bench.common import RESULTS, run_header, today, write_results
from bench.optim_convergence import run
from bench.optim_convergence_seeds import interval, points, ratio
from lazytrain.runtime.device import resolve_device

KINDS = ("fp32", "fp32_unfused", "hybrid8bit")


def study(args: argparse.Namespace) -> list[dict]:
    device = resolve_device(args.device)
    common = [f"model.source=builtin:{args.shape}", f"training.device={args.device}",
              f"data.heldout_size={args.heldout}", f"training.batch_size={args.batch_size}"]
    records = []
    with tempfile.TemporaryDirectory(dir=args.scratch) as shared:
        for seed in args.seeds:
            records += finetune_seed(args, common, device, seed, Path(shared))
    return records


def finetune_seed(args: argparse.Namespace, common: list[str], device, seed: int, shared: Path) -> list[dict]:
    """Pretrain (once for all seeds with ``--shared-pretrain``), then fine-tune with each kind."""
    records = []
    with tempfile.TemporaryDirectory(dir=args.scratch) as tmp:
        pretrained = shared / "pretrained" if args.shared_pretrain else Path(tmp) / "pretrained"
        if args.shared_pretrain and (shared / "pretrained.json").exists():
            base = json.loads((shared / "pretrained.json").read_text())
        else:
            base = run("fp32", args.pretrain_steps, pretrained, args.seeds[0] if args.shared_pretrain else seed, (
                *common, f"data.builtin_tier={args.pretrain_tier}", f"optimizer.lr={args.pretrain_lr}"))
            if args.shared_pretrain:
                (shared / "pretrained.json").write_text(json.dumps({"exact_match": base["exact_match"]}))
        for kind in args.kinds:
            result = run(kind, args.finetune_steps, Path(tmp) / kind, seed, (
                *common, f"model.source={pretrained}", f"data.builtin_tier={args.finetune_tier}",
                f"optimizer.lr={args.finetune_lr}", "optimizer.weight_decay=0.0"))
            losses = result["losses"]
            records.append({
                "name": f"finetune_8bit_{args.shape}", **run_header(device), "model": f"builtin:{args.shape}",
                "runner": "lazytrain", "kind": kind, "seed": seed, "precision": "bf16" if device.type == "cuda"
                else "fp32", "optimizer": "adamw_hybrid8bit" if kind == "hybrid8bit" else "adamw_fp32",
                "pretrain_tier": args.pretrain_tier, "pretrain_steps": args.pretrain_steps,
                "pretrain_exact_match": base["exact_match"], "finetune_tier": args.finetune_tier,
                "finetune_steps": args.finetune_steps, "lr": args.finetune_lr, "batch_size": args.batch_size,
                "heldout": args.heldout, "exact_match": result["exact_match"], "no_answer": result["no_answer"],
                "tail_loss": statistics.fmean(losses[-args.tail:]), "loss_every_10_steps": losses[::10],
                "seconds": result["seconds"], "shared_pretrain": args.shared_pretrain,
            })
    return records


def report(records: list[dict], command: str) -> str:
    first = records[0]
    by_kind: dict[str, dict[int, dict]] = {}
    for r in records:
        by_kind.setdefault(r["kind"], {})[r["seed"]] = r
    lines = [f"# 8-bit states when fine-tuning ({first['date']})", "", f"`{command}`", "",
             (f"{first['device']}; torch {first['torch']}; {first['model']} pretrained {first['pretrain_steps']} "
             f"steps on {first['pretrain_tier']} (fp32 states; "
             f"{'once, every seed fine-tuned from it' if first.get('shared_pretrain') else 'once per seed'}), fine-tuned {first['finetune_steps']} steps on "
             f"{first['finetune_tier']} at lr {first['lr']}, batch {first['batch_size']}, {first['heldout']} "
             "held-out problems."), "",
             ("| kind | seeds | exact match mean | tail loss mean | tail loss / fp32 [90%] | exact match - fp32, "
             "points [90%] |"), "| --- | --- | --- | --- | --- | --- |"]
    fp32 = by_kind.get("fp32", {})
    for kind, runs in by_kind.items():
        seeds = sorted(runs)
        em = [runs[s]["exact_match"] for s in seeds]
        tail = [runs[s]["tail_loss"] for s in seeds]
        row = f"| {kind} | {len(seeds)} | {statistics.fmean(em):.4f} | {statistics.fmean(tail):.4g} |"
        paired = [s for s in seeds if s in fp32]
        if kind != "fp32" and paired:
            base_tail = [fp32[s]["tail_loss"] for s in paired]
            base_em = [fp32[s]["exact_match"] for s in paired]
            mine_tail = [runs[s]["tail_loss"] for s in paired]
            mine_em = [runs[s]["exact_match"] for s in paired]
            lo, hi = interval(mine_tail, base_tail, ratio)
            plo, phi = interval(mine_em, base_em, points)
            row += (f" {statistics.fmean(mine_tail) / statistics.fmean(base_tail):.3f} [{lo:.3f}, {hi:.3f}] |"
                    f" {100 * (statistics.fmean(mine_em) - statistics.fmean(base_em)):+.1f} [{plo:+.1f}, {phi:+.1f}] |")
        else:
            row += " - | - |"
        lines.append(row)
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen2.5-0.5b")
    parser.add_argument("--seeds", nargs="+", type=int, default=[1])
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--pretrain-tier", default="add2")
    parser.add_argument("--pretrain-steps", type=int, default=600)
    parser.add_argument("--shared-pretrain", action=argparse.BooleanOptionalAction, default=True,
                        help="pretrain once (with the first seed) and fine-tune every seed from it, as users "
                             "fine-tune one base model (--no-shared-pretrain: one pretraining per seed)")
    parser.add_argument("--pretrain-lr", type=float, default=3e-4)
    parser.add_argument("--finetune-tier", default="addsub")
    parser.add_argument("--finetune-steps", type=int, default=300)
    parser.add_argument("--finetune-lr", type=float, default=1e-5)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--heldout", type=int, default=200)
    parser.add_argument("--tail", type=int, default=50, help="last fine-tuning steps whose mean loss is compared")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--scratch", default=None, help="folder for the pretrained model (default: the temp dir)")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    records = study(args)
    command = (f"python bench/accuracy_finetune_8bit.py --shape {args.shape} --seeds {' '.join(map(str, args.seeds))} "
               f"--pretrain-steps {args.pretrain_steps} --finetune-steps {args.finetune_steps} --heldout {args.heldout} "
               f"--device {args.device}")
    text = report(records, command)
    write_results(records, f"finetune_8bit_{args.shape}_{today()}{args.tag}", text, args.out)
    print(text)


if __name__ == "__main__":
    main()

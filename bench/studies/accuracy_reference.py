"""Held-out exact match of the built-in default: LazyTrain's path against plain PyTorch.

The same model (the built-in shape, initialised from the same seed on the same device), data
(``lazytrain.data.pipeline``: built-in tokenizer, samples, batches), learning-rate schedule,
clipping and seed, trained by:

- ``lazytrain``: `lazytrain train` itself (``--dtype`` sets ``model.dtype``; auto is bf16 on a
  GPU, fp32 on the CPU); ``--set KEY=VALUE`` passes more config overrides;
- ``torch_fp32``: the HF model, torch AdamW and ``clip_grad_norm_``, all in fp32;
- ``torch_autocast_bf16``: the same with fp32 weights under ``torch.autocast(bfloat16)``;
- ``torch_bf16_master``: bf16 weights, gradients cast to fp32 masters, clipped and stepped there.

Each run is evaluated on the built-in held-out split with greedy generation in its own
precision (LazyTrain: its streamed generation over the bf16 or fp32 host weights). One record
per (kind, seed) goes to OUT/accuracy_reference[TAG].json and a Markdown report beside it:

    python -m bench.studies.accuracy_reference --kinds lazytrain torch_bf16_master --seeds 1 2 3
    python -m bench.studies.accuracy_reference --merge OUT/a.json OUT/b.json --tag _h200   # one report
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import transformers

from bench.common import RESULTS, run_header, today, write_results
from lazytrain.config import Config, TrainingConfig, load_config
from lazytrain.data.pipeline import (
    heldout_samples,
    load_tokenizer,
    resolve_template,
    training_batches,
)
from lazytrain.eval.evaluate import exact_match
from lazytrain.eval.generate import generate_resident
from lazytrain.memory.host_store import HostStore
from lazytrain.model.build import build_model, init_device_of
from lazytrain.runtime.device import resolve_device
from lazytrain.train.schedule import learning_rate
from lazytrain.train.trainer import Trainer

TORCH_KINDS = ("torch_fp32", "torch_autocast_bf16", "torch_bf16_master")
KINDS = ("lazytrain", *TORCH_KINDS)
PRECISION = {"torch_fp32": "fp32", "torch_autocast_bf16": "autocast_bf16_fp32_weights",
             "torch_bf16_master": "bf16_weights_fp32_master"}


def make_config(seed: int, steps: int, heldout: int, device: str, dtype: str, overrides: list[str],
                out_dir: Path) -> Config:
    return load_config(None, [f"training.seed={seed}", f"training.steps={steps}", f"data.heldout_size={heldout}",
                              f"training.device={device}", f"model.dtype={dtype}", "training.progress=false",
                              f"training.output_dir={out_dir}", *overrides])


def run_lazytrain(cfg: Config) -> dict:
    trainer = Trainer(cfg)
    trainer.setup()
    summary = trainer.train()
    lines = (Path(cfg.training.output_dir) / "metrics.jsonl").read_text().splitlines()
    losses = [r["loss"] for r in map(json.loads, lines) if "loss" in r]
    precision = "bf16_streamed_fp32_master" if trainer.dtype == torch.bfloat16 else "fp32"
    return {"precision": precision, "losses": losses, "exact_match": summary["eval"]["eval_exact_match"],
            "no_answer": summary["eval"]["eval_no_answer"], "skipped_steps": summary["skipped_steps"]}


def reference_model(cfg: Config, device: torch.device, tokenizer) -> transformers.PreTrainedModel:
    """The HF model with LazyTrain's random init of the same seed (drawn on ``device``, or on the
    CPU with ``model.init_device=cpu``)."""
    adapter, store = build_model(cfg.model.source, device, torch.float32, seed=cfg.training.seed,
                                 vocab_size=len(tokenizer), pin=False,
                                 init_device=init_device_of(cfg.model.init_device), store_factory=HostStore)
    state = {}
    for g, layout in enumerate(adapter.layouts):
        for p in layout.params:
            state[layout.hf_prefix + p.name] = store.masters[g][p.offset : p.offset + p.numel].view(p.shape)
    model = transformers.AutoModelForCausalLM.from_config(adapter.config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or any(name != "lm_head.weight" for name in missing):
        raise RuntimeError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    if adapter.tied:
        model.tie_weights()
    return model.to(device)


def run_torch(kind: str, cfg: Config) -> dict:
    """Plain PyTorch (`train_torch`), then exact match on the built-in held-out split."""
    trained = train_torch(kind, cfg)
    return {"precision": PRECISION[kind], "losses": trained.losses, "exact_match": trained.exact_match(),
            "no_answer": trained.no_answer, "skipped_steps": trained.skipped}


@dataclasses.dataclass
class TorchRun:
    """A model `train_torch` trained, with what evaluating and saving it needs."""

    kind: str
    cfg: Config
    model: transformers.PreTrainedModel
    tokenizer: object
    template: object
    losses: list[float]
    skipped: int
    no_answer: int = 0

    def exact_match(self) -> float:
        """Greedy exact match on the built-in held-out split, in the run's precision."""
        self.model.eval()
        tok = self.tokenizer
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

        def generate(prompts):
            with precision_context(self.kind, self.model.device):
                return generate_resident(self.model, prompts, 64, pad, tok.eos_token_id)

        report, _ = exact_match(heldout_samples(self.cfg.data, self.cfg.training.seed), tok, self.template, generate,
                                batch_size=100)
        self.no_answer = report["no_answer"]
        return report["accuracy"]

    def save(self, folder: Path, dtype: torch.dtype = torch.bfloat16) -> None:
        """An HF model folder LazyTrain loads as ``model.source``: weights in ``dtype`` (the model
        is cast in place), the tokenizer and the prompt template, as `lazytrain train` writes its
        model."""
        self.model.to(dtype).save_pretrained(folder)
        self.tokenizer.save_pretrained(folder)
        self.template.save(folder)


def precision_context(kind: str, device: torch.device):
    """bf16 autocast for ``torch_autocast_bf16``, nothing for the other kinds."""
    if kind == "torch_autocast_bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def train_torch(kind: str, cfg: Config) -> TorchRun:
    """Plain PyTorch: HF forward and loss, torch AdamW (decay on matrices only, as LazyTrain),
    ``clip_grad_norm_``, LazyTrain's learning-rate schedule."""
    device = resolve_device(cfg.training.device)
    torch.manual_seed(cfg.training.seed)
    tokenizer = load_tokenizer(cfg.model.source)
    template = resolve_template(cfg.data)
    batches, _ = training_batches(cfg.data, tokenizer, template, batch_size=cfg.training.batch_size,
                                  seed=cfg.training.seed, pad_to_multiple_of=8 if device.type == "cuda" else 1)
    model = reference_model(cfg, device, tokenizer)
    if kind == "torch_bf16_master":
        model.to(torch.bfloat16)
    params = list(model.parameters())
    # torch_bf16_master steps fp32 copies; the others step the (fp32) model parameters
    masters = [p.detach().float().clone() for p in params] if kind == "torch_bf16_master" else params
    oc, tc = cfg.optimizer, cfg.training
    optimizer = torch.optim.AdamW(
        [{"params": [m for m in masters if m.dim() >= 2], "weight_decay": oc.weight_decay},
         {"params": [m for m in masters if m.dim() < 2], "weight_decay": 0.0}],
        lr=oc.lr, betas=oc.betas, eps=oc.eps)
    losses, skipped = [], 0
    for step in range(tc.steps):
        batch = next(batches)
        with precision_context(kind, device):
            loss = model(input_ids=batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device),
                         labels=batch.labels.to(device)).loss
        loss.backward()
        if kind == "torch_bf16_master":
            for p, m in zip(params, masters):
                m.grad = p.grad.float()
                p.grad = None
        norm = torch.nn.utils.clip_grad_norm_(masters, tc.max_grad_norm) if tc.max_grad_norm > 0 \
            else torch.linalg.vector_norm(torch.stack([m.grad.norm() for m in masters]))
        losses.append(float(loss.detach()))
        if torch.isfinite(norm) and torch.isfinite(loss):
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step, tc.steps, oc.lr, oc.warmup_steps, oc.schedule, oc.min_lr_ratio)
            optimizer.step()
            if kind == "torch_bf16_master":
                with torch.no_grad():
                    for p, m in zip(params, masters):
                        p.copy_(m)
        else:
            skipped += 1
        optimizer.zero_grad(set_to_none=True)
    return TorchRun(kind=kind, cfg=cfg, model=model, tokenizer=tokenizer, template=template, losses=losses,
                    skipped=skipped)


def init_override(args: argparse.Namespace) -> list[str]:
    """``--init-device`` as a config override (every kind's)."""
    return [f"model.init_device={args.init_device}"] if args.init_device != "auto" else []


def run(kind: str, seed: int, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = make_config(seed, args.steps, args.heldout, args.device, args.dtype, [*args.set, *init_override(args)],
                          Path(tmp))
        device = resolve_device(cfg.training.device)
        start = time.perf_counter()
        result = run_lazytrain(cfg) if kind == "lazytrain" else run_torch(kind, cfg)
    losses = result.pop("losses")
    runner = "lazytrain" if kind == "lazytrain" else f"pytorch_{device.type.replace('cuda', 'gpu')}"
    tail = losses[-args.tail:]
    return {
        "name": f"accuracy_{kind}_{cfg.model.source.split(':')[-1]}_{cfg.data.builtin_tier}",
        **run_header(device), "model": cfg.model.source, "runner": runner, "kind": kind, "seed": seed,
        "optimizer": f"adamw_{cfg.optimizer.kind}" if kind == "lazytrain" else "torch_adamw",
        "steps": args.steps, "batch_size": cfg.training.batch_size,
        "seq_len": cfg.data.max_seq_len, "lr": cfg.optimizer.lr, "heldout": cfg.data.heldout_size,
        "overrides": (args.set if kind == "lazytrain" else []) + init_override(args), **result,
        "tail_loss": statistics.fmean(tail), "loss_every_10_steps": losses[::10],
        "seconds": time.perf_counter() - start,
    }


def report(records: list[dict], command: str) -> str:
    first = records[0]
    lines = [f"# Held-out exact match: LazyTrain against plain PyTorch ({first['date']})", "",
             f"`{command}`", "",
             (f"{first['device']}; torch {first['torch']}, transformers {first['transformers']}; "
             f"{first['model']}, batch {first['batch_size']}, lr {first['lr']}, "
             f"{first['heldout']} held-out problems."), "",
             "| kind | precision | steps | overrides | seeds | exact match mean | min | max | per seed | tail loss mean |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["kind"], r["precision"], r["steps"], " ".join(r["overrides"])), []).append(r)
    for (kind, precision, steps, overrides), rs in groups.items():
        rs = sorted(rs, key=lambda r: r["seed"])
        em = [r["exact_match"] for r in rs]
        per_seed = ", ".join(f"{r['seed']}: {r['exact_match']:.3f}" for r in rs)
        lines.append(f"| {kind} | {precision} | {steps} | {overrides or '-'} | {len(rs)} | {statistics.fmean(em):.4f} | "
                     f"{min(em):.3f} | {max(em):.3f} | {per_seed} | "
                     f"{statistics.fmean(r['tail_loss'] for r in rs):.4f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--steps", type=int, default=TrainingConfig().steps,
                        help="training.steps (default: the built-in default's)")
    parser.add_argument("--heldout", type=int, default=200)
    parser.add_argument("--tail", type=int, default=100, help="last steps whose mean loss is reported")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto", help="model.dtype of the lazytrain kind")
    parser.add_argument("--set", nargs="*", default=[], help="more config overrides for the lazytrain kind")
    parser.add_argument("--init-device", choices=["auto", "cpu"], default="auto",
                        help="where every kind's random init is drawn (model.init_device): cpu gives a seed the "
                             "same weights on a GPU as on the CPU")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--tag", default="")
    parser.add_argument("--merge", nargs="+", help="record files to report as one (no training)")
    args = parser.parse_args(argv)
    if args.merge:
        records = [r for f in args.merge for r in json.loads(Path(f).read_text())]
        command = f"python -m bench.studies.accuracy_reference --merge {' '.join(args.merge)}"
    else:
        records = [run(kind, seed, args) for kind in args.kinds for seed in args.seeds]
        command = "python -m bench.studies.accuracy_reference " + " ".join(
            [f"--kinds {' '.join(args.kinds)}", f"--seeds {' '.join(map(str, args.seeds))}", f"--steps {args.steps}",
             f"--heldout {args.heldout}", f"--device {args.device}", f"--dtype {args.dtype}"]
            + ([f"--set {' '.join(args.set)}"] if args.set else [])
            + ([f"--init-device {args.init_device}"] if args.init_device != "auto" else []))
    path = write_results(records, f"accuracy_reference_{today()}{args.tag}", report(records, command), args.out)
    print(path.read_text() if len(records) == 1 else report(records, command))


if __name__ == "__main__":
    main()

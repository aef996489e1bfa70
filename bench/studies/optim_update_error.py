"""How far 8-bit AdamW states move the weights from fp32 states, along one fp32 training run.

Final loss and exact match of separate 8-bit and fp32 runs are chaotic: two runs part ways
after a few hundred steps and each ends wherever its own trajectory leads. This measures the
optimizer's error directly instead. The built-in default trains with fp32 AdamW; at every
group step, each quantization *scheme* keeps its own moments, fed the very same clipped
gradient, and computes the update it would have made from the same weights. Per scheme:

* step error: sqrt(sum |u_q - u_fp32|^2 / sum |u_fp32|^2) over all steps and 8-bit groups;
* drift: |sum_t (u_q - u_fp32)| / |sum_t u_fp32|, how far the weights would have moved off
  the fp32 ones had only the quantized updates been applied (a biased error adds up here, an
  unbiased one averages out);
* the same per group (embedding, layers, head) in the JSON record.

    python -m bench.studies.optim_update_error --steps 1000 --seed 3
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

import lazytrain.train.session as session_module
from bench.common import cpu_run_device, today
from lazytrain.config import load_config
from lazytrain.optim.adamw import FusedAdamW
from lazytrain.optim.hybrid8bit import MIN_8BIT_NUMEL
from lazytrain.optim.quant import create_dynamic_map
from lazytrain.train.trainer import Trainer


def _code(x: torch.Tensor, qmap: torch.Tensor, rounding: str, gen: torch.Generator) -> torch.Tensor:
    """Index of a code of each x: the nearest one, one of the two neighbours with probability
    by distance ("stochastic"), or the nearest one not farther from zero ("floor")."""
    if rounding == "nearest":
        return torch.bucketize(x, (qmap[1:] + qmap[:-1]) / 2)
    lo = (torch.bucketize(x, qmap, right=True) - 1).clamp(0, qmap.numel() - 2)
    a, b = qmap[lo], qmap[lo + 1]
    if rounding == "floor":  # toward zero
        return torch.where((x >= b) | ((x < 0) & (x > a)), lo + 1, lo)
    p_up = ((x - a) / (b - a)).clamp(0, 1)
    if rounding == "stochastic-reciprocal":  # E[1 / code value] = 1 / x
        p_up = torch.where(x > 0, p_up * b / x.clamp(min=1e-30), torch.zeros_like(x))
    return lo + (torch.rand(x.shape, generator=gen) < p_up).long()


def geometric_map(signed: bool, decades: float) -> torch.Tensor:
    """127 (signed) or 255 (unsigned) positive codes evenly spaced in log from 10**-decades to 1, and 0."""
    count = 127 if signed else 255
    pos = torch.logspace(-decades, 0, count, dtype=torch.float64).float()
    codes = [pos, torch.zeros(1)] + ([-pos] if signed else [])
    qmap = torch.cat(codes).sort().values
    return torch.cat([qmap, torch.ones(256 - qmap.numel())]) if qmap.numel() < 256 else qmap


@dataclass
class Scheme:
    """Blockwise quantization of m (signed map) and sqrt(v) (unsigned map)."""

    m_map: torch.Tensor | None
    v_map: torch.Tensor | None
    block: int = 256
    m_round: str = "nearest"
    v_round: str = "nearest"
    v_nonzero: bool = False
    """Positive sqrt(v) below the smallest nonzero code takes that code, not 0."""
    _gen: torch.Generator = field(default_factory=lambda: torch.Generator().manual_seed(0))

    def roundtrip(self, x: torch.Tensor, qmap: torch.Tensor | None, rounding: str) -> torch.Tensor:
        if qmap is None:
            return x
        n = x.numel()
        pad = -n % self.block
        blocks = torch.nn.functional.pad(x, (0, pad)).view(-1, self.block)
        absmax = blocks.abs().amax(dim=1, keepdim=True)
        scale = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
        codes = _code(blocks / scale, qmap, rounding, self._gen)
        return (qmap[codes] * absmax).reshape(-1)[:n]


DYN_M, DYN_V = create_dynamic_map(True), create_dynamic_map(False)

SCHEMES: dict[str, Callable[[], Scheme]] = {
    "fp32": lambda: Scheme(None, None),  # the shadow's own fp32 math: error 0 up to rounding
    "block256": lambda: Scheme(DYN_M, DYN_V, block=256),  # bitsandbytes' blocks
    "block256-m-only": lambda: Scheme(DYN_M, None, block=256),
    "block256-v-only": lambda: Scheme(None, DYN_V, block=256),
    "block128": lambda: Scheme(DYN_M, DYN_V, block=128),  # lazytrain's (quant.BLOCK)
    "block128-m-only": lambda: Scheme(DYN_M, None, block=128),
    "block128-v-only": lambda: Scheme(None, DYN_V, block=128),
    "block64": lambda: Scheme(DYN_M, DYN_V, block=64),
    "block32": lambda: Scheme(DYN_M, DYN_V, block=32),
    "block128-stochastic": lambda: Scheme(DYN_M, DYN_V, block=128, m_round="stochastic", v_round="stochastic"),
    "block128-v-floor": lambda: Scheme(DYN_M, DYN_V, block=128, v_round="floor"),
    "block128-geometric": lambda: Scheme(geometric_map(True, 5), geometric_map(False, 6), block=128),
    "block128-v-geo4": lambda: Scheme(DYN_M, geometric_map(False, 4), block=128, v_nonzero=True),
    "block128-v-geo5": lambda: Scheme(DYN_M, geometric_map(False, 5), block=128, v_nonzero=True),
    "block128-v-geo3": lambda: Scheme(DYN_M, geometric_map(False, 3), block=128, v_nonzero=True),
    "block128-v-stochastic": lambda: Scheme(DYN_M, DYN_V, block=128, v_round="stochastic"),
    "block128-v-stochastic-reciprocal": lambda: Scheme(DYN_M, DYN_V, block=128, v_round="stochastic-reciprocal"),
}
"""Name -> quantization of m and sqrt(v): bitsandbytes' dynamic maps (DYN_M, DYN_V) with
nearest rounding unless named otherwise; "-m-only" / "-v-only" quantize one moment and keep
the other fp32; "geometric" maps space their codes evenly in log over 5 (m) and 6 (sqrt(v))
decades."""


@dataclass
class Tally:
    err2: float = 0.0
    ref2: float = 0.0
    drift: torch.Tensor | None = None
    moved: torch.Tensor | None = None

    def add(self, u_q: torch.Tensor, u_ref: torch.Tensor) -> None:
        d = (u_q - u_ref).double()
        self.err2 += float(d.square().sum())
        self.ref2 += float(u_ref.double().square().sum())
        self.drift = d if self.drift is None else self.drift + d
        self.moved = u_ref.double() if self.moved is None else self.moved + u_ref.double()

    def result(self) -> dict:
        return {"step_error": math.sqrt(self.err2 / max(self.ref2, 1e-300)),
                "drift": float(self.drift.norm() / self.moved.norm().clamp(min=1e-300))}


class ShadowAdamW(FusedAdamW):
    """fp32 AdamW that also computes, per scheme, the update quantized states would make."""

    def __init__(self, masters, decay_numel, config, schemes: dict[str, Scheme]):
        super().__init__(masters, decay_numel, config)
        self.schemes = schemes
        self.moments = {name: [(torch.zeros_like(m), torch.zeros_like(m)) for m in masters] for name in schemes}
        self.tallies = {name: {} for name in schemes}

    def step_group(self, group, grad, clip_coef, lr, weight_out):
        master = self.masters[group]
        before = master.clone()
        super().step_group(group, grad, clip_coef, lr, weight_out)
        if master.numel() < MIN_8BIT_NUMEL:
            return
        u_ref = master - before
        beta1, beta2 = self.config.betas
        t = self.steps[group]
        g = grad.reshape(-1).float() * clip_coef
        decay = torch.ones_like(master)
        decay[: self.decay_numel[group]] = 1 - lr * self.config.weight_decay
        for name, scheme in self.schemes.items():
            m, v = self.moments[name][group]
            m = beta1 * m + (1 - beta1) * g
            v = beta2 * v + (1 - beta2) * g * g
            denom = v.sqrt() / math.sqrt(1 - beta2**t) + self.config.eps
            u_q = before * (decay - 1) - lr / (1 - beta1**t) * m / denom
            self.tallies[name].setdefault(group, Tally()).add(u_q, u_ref)
            root = scheme.roundtrip(v.sqrt(), scheme.v_map, scheme.v_round)
            if scheme.v_nonzero:
                smallest = scheme.v_map[scheme.v_map > 0].min()
                absmax = torch.nn.functional.pad(v.sqrt(), (0, -v.numel() % scheme.block)).view(-1, scheme.block)
                floor = (smallest * absmax.amax(dim=1, keepdim=True)).expand_as(absmax).reshape(-1)[: v.numel()]
                root = torch.where((v > 0) & (root < floor), floor, root)
            self.moments[name][group] = (scheme.roundtrip(m, scheme.m_map, scheme.m_round), root * root)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=list(SCHEMES))
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--tag", default="", help="suffix of the result files' names")
    args = parser.parse_args()
    schemes = {name: SCHEMES[name]() for name in args.schemes}
    holder: dict[str, ShadowAdamW] = {}

    def make(config, masters, decay_numel):
        holder["opt"] = ShadowAdamW(masters, decay_numel, config, schemes)
        return holder["opt"]

    # the session builds the run's optimizer through this name: the shadow optimizer takes its place
    session_module.make_optimizer = make
    with tempfile.TemporaryDirectory() as tmp:
        config = load_config(None, ["optimizer.kind=fp32", f"training.steps={args.steps}",
                                    f"training.seed={args.seed}", f"training.output_dir={tmp}",
                                    "training.progress=false", "training.eval_every=0",
                                    "plan.overlap_optimizer=false"])
        trainer = Trainer(config)
        trainer.setup()
        summary = trainer.train()
    opt = holder["opt"]
    results = {}
    for name, per_group in opt.tallies.items():
        total = Tally()
        for tally in per_group.values():
            total.err2 += tally.err2
            total.ref2 += tally.ref2
        d2 = sum(float(t.drift.square().sum()) for t in per_group.values())
        r2 = sum(float(t.moved.square().sum()) for t in per_group.values())
        results[name] = {"step_error": math.sqrt(total.err2 / total.ref2), "drift": math.sqrt(d2 / r2),
                         "groups": {str(g): t.result() for g, t in sorted(per_group.items())}}
    date = today()
    record = {"name": f"optim_update_error_{args.steps}", "date": date,
              "device": cpu_run_device(),
              "torch": torch.__version__, "model": "builtin:tiny", "steps": args.steps, "seed": args.seed,
              "fp32_exact_match": summary["eval"]["eval_exact_match"], "results": results}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"optim_update_error_{date}{args.tag}"
    (out / f"{stem}.json").write_text(json.dumps([record], indent=1))
    n_groups = len(next(iter(results.values()))["groups"])
    lines = [f"# 8-bit state schemes against fp32 AdamW along one fp32 run ({args.steps} steps, seed {args.seed})",
             "", (f"{date}, {record['device']}, torch {record['torch']}. Command: `python -m bench.studies.optim_update_error "
             f"--steps {args.steps} --seed {args.seed} --schemes {' '.join(args.schemes)}`"), "",
             "| scheme | step error | drift | drift, embedding (group 0) | drift, worst group |",
             "| --- | --- | --- | --- | --- |"]
    for name, r in results.items():
        worst = max(r["groups"].items(), key=lambda kv: kv[1]["drift"])
        lines.append(f"| {name} | {r['step_error']:.4f} | {r['drift']:.4f} | {r['groups'].get('0', {}).get('drift', float('nan')):.4f} "
                     f"| {worst[1]['drift']:.4f} (group {worst[0]} of {n_groups}) |")
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())

"""What 4-bit states should hold for Adam's second moment: v (torchao, lpmm) or sqrt(v) (LazyTrain's 8-bit).

Two measurements, both with the 4-bit maps of ``optim/hybrid4bit.py`` (signed dynamic map for
m, linear map without zero for the second moment, blocks of 128 unless said otherwise):

1. float64 simulation: AdamW on a synthetic gradient stream (per-block scales over 2 decades,
   a log-normal spread of ``sigma`` inside each block, a persistent direction plus noise, a
   seventh of the gradients shrinking 100x half-way), with the states quantized after each step
   as 4-bit states hold them, against unquantized float64 AdamW: the weights' distance after
   ``--sim-steps`` steps relative to their displacement, the mean relative error of the updates,
   and the largest single update in learning rates.
2. a short run: the built-in default (`lazytrain train`) for ``--steps`` steps with fp32 states,
   4-bit states holding sqrt(v), and 4-bit states holding v (both 4-bit runs on the torch path,
   so that they differ in that alone): the mean loss of the last ``--tail`` steps.

    python -m bench.studies.optim_4bit_second_moment --steps 150 --out bench/results
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import tempfile
from pathlib import Path

import torch

from bench.common import cpu_run_device, today, write_results
from lazytrain.optim import hybrid4bit
from lazytrain.optim.hybrid4bit import dynamic_map4, linear_map4
from lazytrain.optim.hybrid8bit import _adam_update, _master_chunk, _write_chunk


def _quantized(x: torch.Tensor, qmap: torch.Tensor, block: int, uniforms: torch.Tensor | None) -> torch.Tensor:
    """float64 ``x`` through blockwise codes of ``qmap`` (nearest, or stochastic with ``uniforms``)."""
    blocks = x.view(-1, block)
    absmax = blocks.abs().amax(1, keepdim=True)
    normalized = torch.where(absmax > 0, blocks / absmax, 0 * blocks)
    codes = torch.bucketize(normalized, (qmap[1:] + qmap[:-1]) / 2)  # the nearest code
    if uniforms is not None:
        qc = qmap[codes]
        other = torch.where(normalized >= qc, codes + 1, codes - 1).clamp(0, qmap.numel() - 1)
        lo, hi = torch.minimum(qc, qmap[other]), torch.maximum(qc, qmap[other])
        up = (uniforms.view_as(normalized) < (normalized - lo) / (hi - lo)) & (hi > lo)
        codes = torch.minimum(codes, other) + up.long()
    return (qmap[codes] * absmax).view(-1)


def simulate(store: str, stochastic: bool, block: int, sigma: float, steps: int, numel: int = 128 * 256,
             lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> dict:
    """One float64 simulation (see the module docstring); ``store``: ``v`` or ``sqrt``."""
    gen = torch.Generator().manual_seed(0)
    signed, linear = dynamic_map4().double(), linear_map4().double()
    per_block = 10 ** (-2 * torch.rand(numel // block, 1, generator=gen, dtype=torch.float64))
    scale = (per_block * torch.exp(sigma * torch.randn(numel // block, block, generator=gen, dtype=torch.float64))).view(-1)
    drift = torch.randn(numel, generator=gen, dtype=torch.float64) * 0.3
    m, v = torch.zeros(numel, dtype=torch.float64), torch.zeros(numel, dtype=torch.float64)
    mq, vq = m.clone(), v.clone()
    weight, weight_q = m.clone(), m.clone()
    errors, largest = [], 0.0
    for t in range(1, steps + 1):
        shrink = torch.where(torch.arange(numel) % 7 == 0, 0.01 if t > steps // 2 else 1.0, 1.0)
        g = (drift + torch.randn(numel, generator=gen, dtype=torch.float64)) * scale * shrink
        update = []
        for first, second in ((m, v), (mq, vq)):
            first.mul_(betas[0]).add_((1 - betas[0]) * g)
            second.mul_(betas[1]).add_((1 - betas[1]) * g * g)
            denom = second.sqrt() / math.sqrt(1 - betas[1] ** t) + eps
            update.append(lr / (1 - betas[0] ** t) * first / denom)
        weight -= update[0]
        weight_q -= update[1]
        errors.append(float((update[1] - update[0]).norm() / update[0].norm()))
        largest = max(largest, float(update[1].abs().max()) / lr)
        mq.copy_(_quantized(mq, signed, block, None))
        uniforms = torch.rand(numel, generator=gen, dtype=torch.float64) if stochastic else None
        if store == "v":
            vq.copy_(_quantized(vq, linear, block, uniforms))
        else:
            vq.copy_(_quantized(vq.sqrt(), linear, block, uniforms) ** 2)
    return {"store": store, "stochastic": stochastic, "block": block, "sigma": sigma, "steps": steps,
            "weight_error": float((weight_q - weight).norm() / weight.norm()),
            "update_error": sum(errors) / len(errors), "largest_update_lr": largest}


def _torch_step_storing_v(grad, master, state, weight_out, s, rounding=None):
    """`hybrid4bit.torch_step_4bit` with the second-moment codes holding v itself (torchao's and
    lpmm's choice), nearest codes, in one piece."""
    mt, vt = hybrid4bit.maps_on(grad.device)
    n = master.numel()
    chunk = _master_chunk(master, 0, n)
    m = hybrid4bit.dequantize4(state.m_codes, state.m_absmax, mt, n)
    v = hybrid4bit.dequantize4(state.v_codes, state.v_absmax, vt, n)
    m, v = _adam_update(chunk, grad, m, v, s, s.decay_numel)
    for name, x, table in (("m", m, mt), ("v", v, vt)):
        codes, absmax = hybrid4bit.quantize4(x, table)
        getattr(state, f"{name}_codes").copy_(codes)
        getattr(state, f"{name}_absmax").copy_(absmax)
    _write_chunk(master, chunk, weight_out, 0, n)


_STEP = hybrid4bit.torch_step_4bit


@contextlib.contextmanager
def _storing(store: str):
    """4-bit runs on the torch path, the second moment's codes holding ``store``."""
    previous = os.environ.get("LAZYTRAIN_OPTIM_KERNEL")
    os.environ["LAZYTRAIN_OPTIM_KERNEL"] = "torch"
    if store == "v":
        hybrid4bit.torch_step_4bit = _torch_step_storing_v
    try:
        yield
    finally:
        hybrid4bit.torch_step_4bit = _STEP
        if previous is None:
            os.environ.pop("LAZYTRAIN_OPTIM_KERNEL")
        else:
            os.environ["LAZYTRAIN_OPTIM_KERNEL"] = previous


def short_runs(steps: int, tail: int) -> dict:
    from bench.studies.optim_convergence import RUNS, run

    RUNS["hybrid4bit"] = ["optimizer.kind=hybrid4bit", "optimizer.state_rounding=nearest"]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        results["fp32"] = run("fp32", steps, Path(tmp) / "fp32")
        for store in ("sqrt", "v"):
            with _storing(store):
                results[f"4bit_{store}"] = run("hybrid4bit", steps, Path(tmp) / store)
    return {name: {"tail_loss": sum(r["losses"][-tail:]) / tail, "final_loss": r["losses"][-1],
                   "exact_match": r["exact_match"], "seconds": r["seconds"]} for name, r in results.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150, help="steps of each short run (0: none)")
    parser.add_argument("--tail", type=int, default=30)
    parser.add_argument("--sim-steps", type=int, default=400, help="steps of each simulation (0: none)")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    cases = [(store, False, 128, sigma) for sigma in (0.5, 1.0) for store in ("v", "sqrt")]
    cases += [("sqrt", True, 128, sigma) for sigma in (0.5, 1.0)] + [(store, False, 256, 0.5) for store in ("v", "sqrt")]
    sims = [simulate(*case, args.sim_steps) for case in cases] if args.sim_steps else []
    runs = short_runs(args.steps, args.tail) if args.steps else {}
    record = {"name": "optim_4bit_second_moment", "date": today(), "device": cpu_run_device(),
              "torch": torch.__version__, "model": "builtin:tiny", "steps": args.steps, "tail_steps": args.tail,
              "simulations": sims, "short_runs": runs}
    lines = [f"# 4-bit states: v or sqrt(v) for the second moment ({record['date']}, {record['device']})", "",
             (f"Command: `python -m bench.studies.optim_4bit_second_moment --steps {args.steps} --tail {args.tail} "
              f"--sim-steps {args.sim_steps}`"), ""]
    if sims:
        lines += [(f"float64 simulation, {args.sim_steps} steps (module docstring): weights' distance from float64 "
                   "AdamW relative to their displacement; mean relative update error; largest update in lr."), "",
                  "| sigma | holds | rounding | block | weight error | update error | largest update / lr |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {s['sigma']} | {s['store']} | {'stochastic' if s['stochastic'] else 'nearest'} | {s['block']} | "
              f"{s['weight_error']:.3f} | {s['update_error']:.3f} | {s['largest_update_lr']:.2f} |" for s in sims]
    if runs:
        lines += ["", f"Built-in default, {args.steps} steps, mean loss of the last {args.tail}:", "",
                  "| states | tail loss | final loss | seconds |", "| --- | --- | --- | --- |"]
        lines += [f"| {name} | {r['tail_loss']:.4f} | {r['final_loss']:.4f} | {r['seconds']:.0f} |"
                  for name, r in runs.items()]
    parts = "_".join(part for part, ran in (("sim", sims), ("runs", runs)) if ran)
    write_results([record], f"optim_4bit_second_moment_{record['date']}_{parts}", "\n".join(lines) + "\n", args.out)
    print("\n".join(lines))


if __name__ == "__main__":
    main()

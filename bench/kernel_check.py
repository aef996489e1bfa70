"""The chunked gated-delta rule's kernels against an fp32 reference, at a real model's shape.

Gated-DeltaNet layers run the chunked gated-delta rule through fla-core's kernels on CUDA
(``lazytrain.model.kernels``) or transformers' torch reference. This checks what each costs
and how far each lands from the torch reference computed in fp32, for the output and the
gradients of q, k, v, g and beta, on inputs drawn as the layer draws them (``g`` = -exp(A) *
softplus(a + dt), ``beta`` = sigmoid(b), l2-normalised q/k inside the kernel):

- ``torch_bf16``: the torch reference in bf16 (the null: what bf16 alone costs);
- ``fla_bf16``: fla-core's kernel in bf16, if fla is importable and passes LazyTrain's start-up
  probe on this device (its backend, e.g. TileLang on Hopper, is fla's choice and recorded).

The check passes when every fla error is at most ``--slack`` times the null's. Writes
OUT/kernel_check_<shape>_<device>_<date>.json and a Markdown report.

    python -m bench.kernel_check --shape tiny-hybrid --batch 1 --seq 128    # CPU: the null only
    python -m bench.kernel_check --shape qwen3.5-9b --batch 4 --seq 1024    # H200
"""

from __future__ import annotations

import argparse
import importlib.metadata
import inspect
import sys

import torch
import torch.nn.functional as F

from bench.common import RESULTS, device_tag, run_header, today, write_results
from lazytrain.model.kernels import select_linear_attention_kernels
from lazytrain.model.shapes import SHAPES
from lazytrain.runtime.device import resolve_device, time_ms

NAMES = ("out", "dq", "dk", "dv", "dg", "dbeta")


def inputs(shape: dict, batch: int, seq: int, device: torch.device, seed: int) -> dict[str, torch.Tensor]:
    """fp32 leaves shaped as the layer passes them to the kernel (key heads repeated to value heads)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    hv, dk, dv = shape["linear_num_value_heads"], shape["linear_key_head_dim"], shape["linear_value_head_dim"]
    rnd = lambda *s: torch.randn(*s, generator=gen)
    a, dt = rnd(batch, seq, hv), rnd(hv) * 0.5
    return {
        "q": rnd(batch, seq, hv, dk), "k": rnd(batch, seq, hv, dk), "v": rnd(batch, seq, hv, dv),
        "g": (-torch.rand(hv, generator=gen).mul(8).add(1).log().exp() * F.softplus(a + dt)),
        "beta": rnd(batch, seq, hv).sigmoid(),
        "grad": rnd(batch, seq, hv, dv),
    }


def run(fn, x: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device, repeats: int):
    """Output, the five input gradients (fp32) and the median fwd+bwd milliseconds."""
    leaves = {k: x[k].to(device, torch.float32 if k == "g" else dtype, copy=True).requires_grad_() for k in ("q", "k", "v", "g", "beta")}
    grad = x["grad"].to(device, dtype)

    def once():
        for t in leaves.values():
            t.grad = None
        out = fn(leaves["q"], leaves["k"], leaves["v"], g=leaves["g"], beta=leaves["beta"],
                 use_qk_l2norm_in_kernel=True)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(grad)
        return out

    out = once()
    ms = time_ms(device, once, repeats=repeats) if repeats else None
    return [out.detach().float()] + [leaves[k].grad.float() for k in ("q", "k", "v", "g", "beta")], ms


def errors(got: list[torch.Tensor], ref: list[torch.Tensor]) -> dict[str, dict[str, float]]:
    out = {}
    for name, a, b in zip(NAMES, got, ref):
        diff = (a - b).float()
        out[name] = {"rel_fro": (diff.norm() / b.norm().clamp_min(1e-30)).item(),
                     "max_abs_over_max_ref": (diff.abs().max() / b.abs().max().clamp_min(1e-30)).item()}
    return out


def main(argv: list[str] | None = None) -> int:
    """The exit status: 1 when fla's errors fail the check, else 0."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--shape", default="qwen3.5-9b", help="a built-in hybrid shape")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=5, help="timed fwd+bwd repeats (0: no timing)")
    parser.add_argument("--slack", type=float, default=2.0, help="fla's error may be this many times the null's")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    if args.shape not in SHAPES or "linear_num_value_heads" not in SHAPES[args.shape]:
        hybrid = [k for k, v in SHAPES.items() if "linear_num_value_heads" in v]
        sys.exit(f"--shape {args.shape!r} is not a built-in hybrid shape; choose one of {', '.join(hybrid)}")
    device = resolve_device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False
    shape = SHAPES[args.shape]
    x = inputs(shape, args.batch, args.seq, device, args.seed)

    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    select_linear_attention_kernels(device, "torch")
    reference = inspect.unwrap(hf.torch_chunk_gated_delta_rule)
    ref, ref_ms = run(reference, x, torch.float32, device, args.repeats)
    rows = {"torch_fp32": {"ms_fwd_bwd": ref_ms}}
    got, ms = run(reference, x, torch.bfloat16, device, args.repeats)
    rows["torch_bf16"] = {"ms_fwd_bwd": ms, "errors": errors(got, ref)}
    choice = select_linear_attention_kernels(device, "auto")
    fla_note = "fla not used on this device (CPU, not importable, or failed its start-up probe)"
    if choice.delta_rule == "fla":
        got, ms = run(hf.torch_chunk_gated_delta_rule, x, torch.bfloat16, device, args.repeats)
        rows["fla_bf16"] = {"ms_fwd_bwd": ms, "errors": errors(got, ref)}
        versions = {d: _version(d) for d in ("fla-core", "triton", "tilelang")}
        fla_note = "fla-core " + ", ".join(f"{k} {v}" for k, v in versions.items())
    null = rows["torch_bf16"]["errors"]
    passed = None
    if "fla_bf16" in rows:
        passed = all(rows["fla_bf16"]["errors"][n][m] <= args.slack * max(null[n][m], 1e-6)
                     for n in NAMES for m in ("rel_fro", "max_abs_over_max_ref"))
    record = {
        "name": "kernel_check", "date": today(), **run_header(device), "shape": args.shape,
        "batch_size": args.batch, "seq_len": args.seq, "seed": args.seed, "slack": args.slack,
        "kernels": fla_note, "rows": rows, "passed": passed,
    }
    lines = [f"# Chunked gated-delta rule: kernels against fp32 ({args.shape}, {record['device']}, {today()})", "",
             (f"Input {args.batch} x {args.seq} tokens, {shape['linear_num_value_heads']} value heads, "
              f"k/v head dim {shape['linear_key_head_dim']}/{shape['linear_value_head_dim']}, seed {args.seed}. "
              f"Errors against the torch reference in fp32: relative Frobenius norm / max abs error over "
              f"max abs reference. {fla_note}."), "",
             "| kernel | fwd+bwd ms | " + " | ".join(NAMES) + " |", "|---" * (2 + len(NAMES)) + "|"]
    for kind, row in rows.items():
        ms = f"{row['ms_fwd_bwd']:.2f}" if row["ms_fwd_bwd"] is not None else "-"
        errs = [f"{row['errors'][n]['rel_fro']:.1e} / {row['errors'][n]['max_abs_over_max_ref']:.1e}"
                if "errors" in row else "-" for n in NAMES]
        lines.append(f"| {kind} | {ms} | " + " | ".join(errs) + " |")
    lines += ["", f"fla within {args.slack}x the bf16 torch reference's error: "
              + ("not run" if passed is None else str(passed))]
    stem = f"kernel_check_{args.shape}_{device_tag(record['device'])}_{today()}"
    write_results([record], stem, "\n".join(lines) + "\n", args.out)
    print("\n".join(lines))
    return 1 if passed is False else 0


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "-"


if __name__ == "__main__":
    sys.exit(main())

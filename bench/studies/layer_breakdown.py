"""Where one decoder layer's forward and backward spend their GPU time (issue 19, the faster
layer): the matmuls, attention, and everything else (norms, SwiGLU, rotary, casts, copies),
from the kernels torch's profiler records, for the layer as the executor runs it (the adapter's
template with its lean ops, or HF's own modules with ``--lean off``).

One layer of a built-in shape with random weights on the device, as the profiler times it
(`runtime/profiler.py`): forward under autograd, then backward to the input and the weights.
The matmul rate is the layer's matmul FLOPs (2 x its parameters x tokens forward, twice that
backward, no attention) over the matmul kernels' time. Example::

    python -m bench.studies.layer_breakdown --model qwen2.5-7b --batch 64 --seq 1024 --out bench/results
"""

from __future__ import annotations

import argparse
import collections

import torch
from torch.profiler import ProfilerActivity, profile

from bench.common import device_tag, run_header, today, write_results
from lazytrain.model.adapter import ModelAdapter
from lazytrain.model.build import model_config
from lazytrain.model.flops import moe_shape
from lazytrain.runtime.device import time_ms

CATEGORIES = (
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "matmul", "aten::mm", "aten::addmm", "aten::bmm")),
)
"""Kernel (or on the CPU, operator) names by category, matched in order; the rest is "other".
Attention first: cuDNN's attention kernels (``cudnn_generated_fort_native_sdpa_sm90_flash_...``)
also match the matmul patterns; the first H200 run (2026-12-03) counted them as matmuls."""
VARIANTS = {"lean-compiled": (True, "compiled"), "lean-eager": (True, "eager"), "hf": (False, "eager")}
"""What a row runs: the lean ops with fused (compiled) or eager elementwise parts, or HF's modules."""


def category(name: str) -> str:
    lowered = name.lower()
    return next((cat for cat, keys in CATEGORIES if any(k in lowered for k in keys)), "other")


def layer_step(adapter: ModelAdapter, batch: int, seq: int, device: torch.device):
    """A function running layer 0's forward and backward once, on random weights and input."""
    dtype = adapter.dtype
    layout = adapter.layouts[1]
    slot = torch.empty(layout.numel, device=device, dtype=dtype)
    g = torch.Generator(device=device).manual_seed(0)
    for param in layout.params:
        slot[param.offset:param.offset + param.numel] = adapter.init_value(layout, param, g, device).flatten()
    position_ids = torch.arange(seq, device=device).unsqueeze(0).expand(batch, -1)
    rope = adapter.rotary_embeddings(position_ids, dtype)
    masks = adapter.layer_masks(None)
    x = torch.randn(batch, seq, adapter.hidden_size, device=device, dtype=dtype)
    grad = torch.randn_like(x)

    def step() -> None:
        leaves = layout.leaves(slot)
        x_in = x.detach().requires_grad_()
        with torch.enable_grad():
            out = adapter.layer_forward(0, leaves, x_in, rope, masks)
        torch.autograd.grad(out, [x_in, *leaves.values()], grad)

    return step, layout.numel


def breakdown(variant: str, args, device: torch.device) -> dict:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    lean, fused_ops = VARIANTS[variant]
    adapter = ModelAdapter(model_config(f"builtin:{args.model}", vocab_size=32000), device, dtype, lean_ops=lean,
                           fused_ops=fused_ops)
    step, params = layer_step(adapter, args.batch, args.seq, device)
    fwd_bwd_ms = time_ms(device, step, args.repeats)
    activity = ProfilerActivity.CUDA if device.type == "cuda" else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    by_name: dict[str, float] = collections.defaultdict(float)
    for event in prof.key_averages():
        if device.type == "cuda":  # the kernels themselves (an operator's device time is its kernels')
            if event.device_type != torch.autograd.DeviceType.CUDA:
                continue
            us = getattr(event, "self_device_time_total", 0) or event.device_time_total
        else:  # on the CPU, the operators' own time
            if not event.key.startswith("aten::"):
                continue
            us = event.self_cpu_time_total
        if us > 0:
            by_name[event.key] += us / 1e3
    by_category: dict[str, float] = collections.defaultdict(float)
    for name, ms in by_name.items():
        by_category[category(name)] += ms
    tokens = args.batch * args.seq
    moe = moe_shape(adapter.config)
    active = params - (moe.inactive_params if moe and moe.moe_layers[0] else 0)  # an MoE layer's routed experts
    matmul_flops = 6 * active * tokens  # forward 2, backward 4 per active parameter and token
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[: args.top]
    return {"name": f"{args.model}_b{args.batch}_s{args.seq}_{variant}", **run_header(device),
            "model": args.model, "batch_size": args.batch, "seq_len": args.seq, "lean_ops": lean,
            "fused_ops": adapter.pointwise.kind,
            "layer_params": params, "fwd_bwd_ms": fwd_bwd_ms, "kernel_ms": dict(by_category),
            "kernel_total_ms": sum(by_category.values()),
            "matmul_tflops": matmul_flops / (by_category["matmul"] * 1e9) if by_category["matmul"] else None,
            "layer_tflops": matmul_flops / (fwd_bwd_ms * 1e9), "top_kernels_ms": top}


def markdown(records: list[dict], args) -> str:
    lines = [f"# One decoder layer's forward + backward, by kernel: {args.model} ({today()}, {records[0]['device']})",
             "",
             (f"torch {records[0]['torch']}, transformers {records[0]['transformers']}; batch {args.batch} x seq "
              f"{args.seq}, layer 0 with random weights, median of {args.repeats} for the step, one profiled step "
              f"for the kernels. Command: `python -m bench.studies.layer_breakdown --model {args.model} --batch {args.batch} "
              f"--seq {args.seq}`"),
             "",
             "| layer | fwd+bwd ms | matmul ms | attention ms | other ms | matmul TFLOPS (own time) | layer TFLOPS |",
             "|---|---|---|---|---|---|---|"]
    for r in records:
        k = r["kernel_ms"]
        rate = f"{r['matmul_tflops']:.0f}" if r["matmul_tflops"] else "-"
        label = f"lean ops, {r['fused_ops']} elementwise" if r["lean_ops"] else "HF modules"
        lines.append(f"| {label} | {r['fwd_bwd_ms']:.1f} | "
                     f"{k.get('matmul', 0):.1f} | {k.get('attention', 0):.1f} | {k.get('other', 0):.1f} | {rate} | "
                     f"{r['layer_tflops']:.0f} |")
    for r in records:
        lines += ["", f"{r['name']}, the {len(r['top_kernels_ms'])} longest kernels (ms, one step):", ""]
        lines += [f"- {ms:.2f} {category(name)}: `{name[:110]}`" for name, ms in r["top_kernels_ms"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-7b")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    records = [breakdown(variant, args, device) for variant in args.variants]
    for r in records:
        print({k: v for k, v in r.items() if k != "top_kernels_ms"}, flush=True)
    print(write_results(records, f"layer_breakdown_{args.model}_{device_tag(device)}_{today()}_s{args.seq}_b{args.batch}",
                        markdown(records, args), args.out))


if __name__ == "__main__":
    main()

"""Bytes a decoder layer saves for its backward, per token, with and without the lean ops.

The planner's main limit on one GPU is how many layers' saved tensors fit (a Qwen2.5-7B layer
saved 14.77 GB at 64 x 1024 tokens on the H200, so only a few are kept and the rest are
recomputed). This measures, for one layer of each type of a built-in shape, what autograd saves
(`runtime.profiler.saved_tensor_bytes`, the profiler's own count: distinct storages, the weight
slot and rotary tables excluded) with HF's modules and with `model/lean.py`'s, at a short
sequence on any device. Saved bytes are linear in tokens (sdpa saves a per-row logsumexp, not
the scores), so bytes per token carry over to the H200 shape; times are not measured.

    python -m bench.studies.saved_bytes --shapes qwen2.5-7b qwen3.5-9b --seq 512
"""

from __future__ import annotations

import argparse

import torch

from bench.common import RESULTS, device_tag, run_header, today, write_results
from lazytrain.model import sublayer
from lazytrain.model.adapter import ModelAdapter
from lazytrain.model.build import model_config
from lazytrain.runtime.device import resolve_device
from lazytrain.runtime.profiler import saved_tensor_bytes


def layer_saved_bytes(adapter: ModelAdapter, layer: int, batch: int, seq: int, device: torch.device,
                      recompute: str = "none") -> int:
    layout = adapter.layouts[layer + 1]
    gen = torch.Generator(device=device).manual_seed(layer)
    slot = torch.empty(layout.numel, dtype=adapter.dtype, device=device).normal_(0, 0.02, generator=gen)
    rope = adapter.rotary_embeddings(torch.arange(seq, device=device).expand(batch, -1), adapter.dtype)
    x = torch.randn(batch, seq, adapter.hidden_size, device=device, dtype=adapter.dtype, generator=gen)
    leaves = layout.leaves(slot)
    x_in = x.detach().requires_grad_()
    _, saved = saved_tensor_bytes(lambda: adapter.layer_forward(layer, leaves, x_in, rope, adapter.layer_masks(None),
                                                                recompute=recompute), (slot, *rope))
    return saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["qwen2.5-7b"])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    device, dtype = resolve_device(args.device), {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    tokens = args.batch * args.seq
    records, rows = [], []
    for shape in args.shapes:
        config = model_config(f"builtin:{shape}", vocab_size=1000)  # the vocab does not enter a layer
        per_kind: dict[str, dict[str, float]] = {}
        for lean in (False, True):
            adapter = ModelAdapter(config, device, dtype, lean_ops=lean)
            for kind in adapter.layer_type_names():
                layer = adapter.layer_types.index(kind)
                saved = layer_saved_bytes(adapter, layer, args.batch, args.seq, device)
                per_kind.setdefault(kind, {})["lean" if lean else "hf"] = saved / tokens
                print(f"{shape} {kind} lean={lean}: {saved / tokens / 1e3:.1f} KB/token", flush=True)
                if lean and "mlp_up" in sublayer.options(adapter.templates[kind]):
                    up = layer_saved_bytes(adapter, layer, args.batch, args.seq, device, recompute="mlp_up")
                    per_kind[kind]["mlp_up"] = up / tokens
                    print(f"{shape} {kind} lean, up projection recomputed: {up / tokens / 1e3:.1f} KB/token", flush=True)
        for kind, v in per_kind.items():
            record = {"name": f"saved_bytes_{shape}_{kind}", **run_header(device), "model": shape, "layer_type": kind,
                      "seq_len": args.seq, "batch_size": args.batch, "dtype": args.dtype,
                      "hidden_size": config.get_text_config().hidden_size,
                      "saved_bytes_per_token_hf": v["hf"], "saved_bytes_per_token_lean": v["lean"],
                      "lean_over_hf": v["lean"] / v["hf"], "saved_bytes_per_token_lean_mlp_up": v.get("mlp_up")}
            records.append(record)
            up = f"{v['mlp_up'] / 1e3:.1f} | {v['mlp_up'] * 65536 / 1e9:.2f}" if "mlp_up" in v else "- | -"
            rows.append(f"| {shape} | {kind} | {v['hf'] / 1e3:.1f} | {v['lean'] / 1e3:.1f} | {v['lean'] / v['hf']:.3f} | "
                        f"{v['hf'] * 65536 / 1e9:.2f} | {v['lean'] * 65536 / 1e9:.2f} | {up} |")
    header = (f"{records[0]['device']}, torch {records[0]['torch']}, transformers {records[0]['transformers']}; "
              f"{args.dtype}, batch {args.batch} x seq {args.seq}, random weights and input. The count is the "
              "profiler's (`saved_tensor_bytes`): distinct storages autograd saves, the layer input included, "
              "weights and rotary tables not; a lean norm's output counts as its input (the executor stores that "
              "and recomputes the output in backward). \"+ up recomputed\": the layer kept with "
              "`recompute=mlp_up`. Command: `python -m bench.studies.saved_bytes --shapes "
              f"{' '.join(args.shapes)} --batch {args.batch} --seq {args.seq} --dtype {args.dtype}`")
    columns = ("| shape | layer type | HF KB/token | lean KB/token | lean / HF | HF GB at 64 x 1024 | lean GB at 64 x 1024 "
               "| lean + up recomputed KB/token | GB at 64 x 1024 |")
    lines = [f"# Saved bytes per token of one decoder layer, HF modules against the lean ops ({today()})", "",
             header, "", columns, "|---|---|---|---|---|---|---|---|---|", *rows]
    stem = f"saved_bytes_{device_tag(device)}_{today()}{args.tag}"
    write_results(records, stem, "\n".join(lines) + "\n", args.out)
    print("\n".join(lines))


if __name__ == "__main__":
    main()

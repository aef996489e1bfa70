"""Packed rows' attention alone: the block-diagonal mask through sdpa against flash attention's
variable-length kernel (`lazytrain.model.packed_attention`), and unpacked causal rows (sdpa's
flash kernel, the profile of full rows) as the reference (issue 19, packing).

Qwen2.5-7B's attention shape by default (28 query heads, 4 key/value heads, head dim 128), bf16,
rows of documents of ``--doc`` tokens as the profiler packs them; forward + backward of the
attention op alone, the median of ``--repeats`` after a warm-up, and the bytes autograd saves.
Needs CUDA (the varlen kernel is flash attention's). Example::

    python -m bench.studies.packed_attention_bench --shapes 1024x64 32768x2 --out bench/results
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from bench.common import device_tag, run_header, today, write_results
from lazytrain.model.adapter import attention_mask_4d, packed_segments
from lazytrain.model.packed_attention import torch_varlen_kernel, varlen_attention
from lazytrain.runtime.profiler import PACKED_DOCUMENT_TOKENS


def timed(fn, repeats: int) -> tuple[float, int]:
    """(median ms of fn's forward + backward, bytes its graph saves)."""
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    fn()
    times = []
    for r in range(repeats):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        if r == 0:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                fn()
        else:
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), sum(saved)


def measure(seq: int, batch: int, args, device: torch.device) -> list[dict]:
    """The three kernels' records at ``seq`` x ``batch``."""
    records = []
    kernel = torch_varlen_kernel()
    g = torch.Generator(device=device).manual_seed(0)

    def tensor(heads):
        return torch.randn(batch, heads, seq, args.head_dim, device=device, dtype=torch.bfloat16,
                           generator=g).requires_grad_()

    q, k, v = tensor(args.heads), tensor(args.kv_heads), tensor(args.kv_heads)
    grad = torch.randn(batch, seq, args.heads, args.head_dim, device=device, dtype=torch.bfloat16)
    documents = max(1, round(seq / args.doc))
    document_ids = (torch.arange(seq) // -(-seq // documents) + 1).expand(batch, -1).contiguous()
    cu = packed_segments(document_ids)["cu_seq_lens_q"]
    cu_dev, longest = cu.to(torch.int32).to(device), int(cu.diff().max())
    mask = attention_mask_4d(torch.ones(batch, seq, dtype=torch.bool, device=device), None,
                             document_ids.to(device))

    def sdpa(**kw):
        out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)
        out.transpose(1, 2).backward(grad)

    def varlen():
        varlen_attention(kernel, q, k, v, cu_dev, longest, None).backward(grad)

    runs = {"mask (sdpa, block-diagonal)": lambda: sdpa(attn_mask=mask),
            "varlen (flash)": varlen,
            "causal rows, unpacked (sdpa flash)": lambda: sdpa(is_causal=True)}
    # the same outputs: varlen against the mask path
    with torch.no_grad():
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).transpose(1, 2)
        b = varlen_attention(kernel, q, k, v, cu_dev, longest, None)
        error = float((a.float() - b.float()).norm() / a.float().norm())
    for name, fn in runs.items():
        record = {"name": f"{name} {seq}x{batch}", **run_header(device), "kind": name, "seq_len": seq,
                  "batch_size": batch, "documents_per_row": documents, "heads": args.heads,
                  "kv_heads": args.kv_heads, "head_dim": args.head_dim,
                  "mask_bytes": mask.numel() if name.startswith("mask") else 0, "varlen_vs_mask_rel_error": error}
        try:
            record["fwd_bwd_ms"], record["saved_bytes"] = timed(fn, args.repeats)
        except torch.OutOfMemoryError as oom:
            record["oom"] = str(oom).splitlines()[0]
        q.grad = k.grad = v.grad = None
        records.append(record)
        print(records[-1], flush=True)
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["1024x64", "32768x2"], help="SEQxBATCH")
    parser.add_argument("--heads", type=int, default=28)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--doc", type=int, default=PACKED_DOCUMENT_TOKENS, help="tokens per document")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    device = torch.device("cuda")
    records = []
    for shape in args.shapes:
        seq, batch = (int(x) for x in shape.split("x"))
        records += measure(seq, batch, args, device)
        torch.cuda.empty_cache()
    lines = [f"# Packed rows' attention: mask against varlen ({today()}, {records[0]['device']})", "",
             (f"torch {torch.__version__}; attention alone, bf16, {args.heads} query / {args.kv_heads} key-value "
              f"heads of {args.head_dim}; rows of documents of ~{args.doc} tokens; forward + backward, median of "
              f"{args.repeats}. Command: `python -m bench.studies.packed_attention_bench --shapes {' '.join(args.shapes)}`"),
             "",
             "| seq x batch | kernel | fwd+bwd ms | saved GB | mask GB | varlen vs mask output (rel.) |",
             "|---|---|---|---|---|---|"]
    for r in records:
        ran = (f"{r['fwd_bwd_ms']:.1f} | {r['saved_bytes'] / 1e9:.2f}" if "oom" not in r
               else f"out of memory: {r['oom'][:80]} | -")
        lines.append(f"| {r['seq_len']} x {r['batch_size']} | {r['kind']} | {ran} | {r['mask_bytes'] / 1e9:.2f} | "
                     f"{r['varlen_vs_mask_rel_error']:.1e} |")
    stem = f"packed_attention_{device_tag(device)}_{today()}"
    print(write_results(records, stem, "\n".join(lines) + "\n", args.out))


if __name__ == "__main__":
    main()

"""Where 4-bit states lose fit: the first moment or the second, and what helps the first.

The fine-tuning study's CPU proxy (``bench/results/finetune_8bit_tiny_2026-12-06_cpu_bf16_proxy_s1-5.md``)
put 4-bit states' final loss at 1.097x the exact run's (8-bit: 1.0016x). Here the same
fine-tunes (``bench.studies.accuracy_finetune_8bit``, run in this process, kind ``hybrid4bit`` on
the torch path) run with the 4-bit step (`hybrid4bit.torch_step_4bit`) replaced by a variant
that differs in one thing:

* ``m_fp32``: m kept in fp32 beside its codes (the step reads the fp32 copy; the codes are still
  written): only the second moment is 4-bit;
* ``v_fp32``: sqrt(v) kept in fp32 the same way: only m is 4-bit;
* ``m_stochastic``: m's codes rounded stochastically (an independent draw per element and step)
  instead of to the nearest code;
* ``m_symmetric``: m's map without its zero code and with -1 (the signed dynamic map has +1 but
  no -1, so a block whose largest |m| is negative stores it at -0.8875 of its absmax).

Each row is one seed's mean loss of the last ``--tail`` steps against the fp32 run of that seed
in ``--reference`` (the proxy's records, same base model and settings), beside the unmodified
4-bit run's ratio from the same file. A diagnostic, not a product path: nothing here is used by
LazyTrain.

    python -m bench.studies.optim_4bit_first_moment --reference bench/results/finetune_8bit_tiny_2026-12-06_cpu_bf16_proxy_s1-5.json \\
        --variants m_fp32 v_fp32 m_stochastic m_symmetric --seeds 1 2 --pretrained DIR
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
from pathlib import Path

import torch

from bench.common import cpu_run_device, today, write_results

VARIANTS = ("m_fp32", "v_fp32", "m_stochastic", "m_symmetric")


def symmetric_map() -> torch.Tensor:
    """The signed dynamic 4-bit map without 0 and with -1: 16 codes, symmetric."""
    from lazytrain.optim import hybrid4bit as h4

    values = [x for x in h4.dynamic_map4().tolist() if x != 0.0] + [-1.0]
    return torch.tensor(sorted(values), dtype=torch.float32)


def patched_step(variant: str):
    """`hybrid4bit.torch_step_4bit` with ``variant``'s one change (CPU, nearest sqrt(v) codes)."""
    from lazytrain.optim import hybrid4bit as h4
    from lazytrain.optim.master import master_chunk, store_master_chunk
    from lazytrain.optim.quant import rounding_uniforms

    shadow: dict[tuple[int, int], torch.Tensor] = {}
    calls = [0]
    m_table = None
    if variant == "m_symmetric":
        qmap = symmetric_map()
        mid = ((qmap[:-1].double() + qmap[1:].double()) / 2).float()
        m_table = h4.Map4(qmap, torch.cat([mid, torch.tensor([math.inf])]))

    def step(grad, master, state, weight_out, s, rounding=None, master_rounding=None):
        calls[0] += 1
        mt, vt = h4.maps_on(grad.device)
        mt = m_table or mt
        n = master.numel()
        for lo in range(0, n, h4.TORCH_CHUNK):
            hi = min(n, lo + h4.TORCH_CHUNK)
            chunk = master_chunk(master, lo, hi)
            blocks, nbytes = slice(lo // h4.BLOCK, h4.num_blocks(hi)), slice(lo // 2, -(-hi // 2))
            m = h4.dequantize4(state.m_codes[nbytes], state.m_absmax[blocks], mt, hi - lo)
            root = h4.dequantize4(state.v_codes[nbytes], state.v_absmax[blocks], vt, hi - lo)
            key = (id(state), lo)
            if key in shadow:
                if variant == "m_fp32":
                    m = shadow[key].clone()
                elif variant == "v_fp32":
                    root = shadow[key].clone()
            decay_numel = min(max(s.decay_numel - lo, 0), hi - lo)
            m, v = h4._adam_update(chunk, grad[lo:hi], m, root * root, s, decay_numel)
            if variant == "m_fp32":
                shadow[key] = m.clone()
            elif variant == "v_fp32":
                shadow[key] = v.sqrt()
            u = None
            if variant == "m_stochastic":  # a draw per element and step
                u = rounding_uniforms(7919 + calls[0], (id(state) % 1000003) * 2**24 + lo, hi - lo)
            for codes, absmax, x, table, draw in (("m_codes", "m_absmax", m, mt, u),
                                                  ("v_codes", "v_absmax", v.sqrt(), vt, None)):
                new_codes, new_absmax = h4.quantize4(x, table, uniforms=draw)
                getattr(state, codes)[nbytes].copy_(new_codes)
                getattr(state, absmax)[blocks].copy_(new_absmax)
            store_master_chunk(master, chunk, weight_out, lo, hi, master_rounding)

    return step


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reference", required=True, help="the proxy study's merged records (fp32 and hybrid4bit runs)")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--pretrained", required=True, help="the proxy's shared pretraining folder (made if absent)")
    parser.add_argument("--pretrain-lr", type=float, default=0.002, help="the proxy's (its records do not say it)")
    parser.add_argument("--dtype", default="bf16", help="model.dtype of the proxy's runs (its records do not say it)")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args(argv)
    os.environ["LAZYTRAIN_OPTIM_KERNEL"] = "torch"  # the variants replace the torch path's step
    from bench.studies import accuracy_finetune_8bit
    from lazytrain.optim import hybrid4bit as h4

    reference = json.loads(Path(args.reference).read_text())
    base = next(r for r in reference if r.get("kind") == "fp32")
    ref = {(r["kind"], r["seed"]): r["tail_loss"] for r in reference if "tail_loss" in r}
    study = ["--shape", base["model"].split(":")[-1], "--dtype", args.dtype, "--pretrain-tier", base["pretrain_tier"],
             "--pretrain-steps", str(base["pretrain_steps"]), "--pretrain-lr", str(args.pretrain_lr), "--pretrain-seed", str(base["pretrain_seed"]),
             "--finetune-tier", base["finetune_tier"], "--finetune-steps", str(base["finetune_steps"]),
             "--finetune-lr", str(base["lr"]), "--batch-size", str(base["batch_size"]), "--heldout", str(base["heldout"]),
             "--device", "cpu", "--kinds", "hybrid4bit", "--pretrained", args.pretrained]
    original, rows = h4.torch_step_4bit, []
    for variant in args.variants:
        h4.torch_step_4bit = patched_step(variant)
        try:
            with tempfile.TemporaryDirectory() as tmp:
                accuracy_finetune_8bit.main([*study, "--seeds", *map(str, args.seeds), "--out", tmp])
                (records,) = [json.loads(p.read_text()) for p in Path(tmp).glob("*.json")]
        finally:
            h4.torch_step_4bit = original
        for r in records:
            if "tail_loss" not in r:
                continue
            s = r["seed"]
            rows.append({"name": f"hybrid4bit_{variant}_s{s}", "date": today(), "device": cpu_run_device(),
                         "torch": torch.__version__, "variant": variant, "seed": s, "tail_loss": r["tail_loss"],
                         "over_fp32": r["tail_loss"] / ref[("fp32", s)],
                         "hybrid4bit_over_fp32": ref[("hybrid4bit", s)] / ref[("fp32", s)],
                         "hybrid8bit_over_fp32": ref[("hybrid8bit", s)] / ref[("fp32", s)],
                         "exact_match": r["exact_match"], "reference": args.reference})
    lines = [f"# 4-bit states: which moment loses the fit ({today()})", "",
             (f"`python -m bench.studies.optim_4bit_first_moment --reference {args.reference} --variants "
             f"{' '.join(args.variants)} --seeds {' '.join(map(str, args.seeds))} --pretrained DIR`"), "",
             (f"{cpu_run_device()}; torch {torch.__version__}; the fine-tunes of `{args.reference}` (kind hybrid4bit, "
             "torch path) with one change each (see the script's docstring). Tail loss: the mean of the last 50 "
             "fine-tuning steps, over the same seed's fp32 run in the reference."), "",
             "| variant | seed | tail loss | / fp32 | unmodified 4-bit / fp32 | 8-bit / fp32 |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['variant']} | {r['seed']} | {r['tail_loss']:.5f} | {r['over_fp32']:.4f} | "
              f"{r['hybrid4bit_over_fp32']:.4f} | {r['hybrid8bit_over_fp32']:.4f} |" for r in rows]
    write_results(rows, f"optim_4bit_first_moment_tiny_{today()}_cpu", "\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()

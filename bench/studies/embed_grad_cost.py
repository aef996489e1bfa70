"""What summing the embedding gradient in fp32 costs a step, at a real model's shape.

The executor sums the embedding's gradient in fp32 (``ModelAdapter.embed_backward``) and
rounds it once to the model dtype; before issue 20's fix, bf16 autograd of ``F.embedding``
summed it in bf16. This times both on random token ids at one batch shape, with only the
embedding weight ``[vocab, hidden]`` (bf16) on the device, never the model:

- ``autograd_bf16``: ``torch.autograd.grad`` of the embedding output (the forward untimed);
- ``fp32_sum``: ``adapter.embed_backward(ids, grad, zeros)`` into a bf16 gradient, as the executor does.

It reports both (median of ``--repeats`` after ``--warmup``; CUDA events on a GPU), their
difference as a fraction of the measured step time of that model at that batch shape on the
same device (the newest committed ``bench/results/plan_<model>_*.json`` record of the solved
plan, uncapped; ``--step-record`` names another file), the peak GPU bytes each allocates above what was
allocated before it, and how far the two gradients land apart. Issue 20's budget for the fix
is 2% of the 7B step. Writes OUT/embed_grad_cost_<model>_<device>_<date>.json and a report:

    python -m bench.studies.embed_grad_cost                                    # qwen2.5-7b, b64 x s1024
    python -m bench.studies.embed_grad_cost --model tiny --batch 2 --seq 64   # the CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.common import RESULTS, ROOT, device_tag, run_header, today, write_results
from lazytrain.data.pipeline import load_tokenizer
from lazytrain.model.adapter import ModelAdapter
from lazytrain.model.build import model_config
from lazytrain.runtime.device import device_name, resolve_device


def measure(device: torch.device, setup: Callable[[], object], op: Callable[[object], torch.Tensor],
            warmup: int, repeats: int) -> tuple[float, int | None]:
    """Median ms of ``op(setup())`` (``setup`` untimed) and, on CUDA, the most bytes it
    allocated above what was allocated before it (its result included)."""
    cuda = device.type == "cuda"
    times, extra = [], None
    for r in range(warmup + repeats):
        state = setup()
        if cuda:
            torch.cuda.synchronize(device)
            before = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            result = op(state)
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
            extra = max(extra or 0, torch.cuda.max_memory_allocated(device) - before)
        else:
            t0 = time.perf_counter()
            result = op(state)
            ms = (time.perf_counter() - t0) * 1e3
        del result, state
        if r >= warmup:
            times.append(ms)
    return statistics.median(times), extra


def step_time_reference(model: str, batch: int, seq: int, device: str,
                        path: Path | None = None) -> tuple[Path, dict] | None:
    """The measured step time this cost is compared with: the solved plan of ``model`` at
    ``(batch, seq)`` on this ``device`` (its name), uncapped, on one GPU, in ``path`` or the
    newest committed record file that has one; of several there, the fastest (the smallest
    step makes the largest fraction)."""
    files = [path] if path else sorted(RESULTS.glob(f"plan_{model}_*.json"))
    found = []
    for file in files:
        for r in json.loads(file.read_text()):
            if (r.get("policy") == "solved" and r.get("batch_size") == batch and r.get("seq_len") == seq
                    and r.get("device") == device and r.get("step_time_s") and not r.get("gpu_mem_cap_gb") and r.get("world_size", 1) == 1):
                found.append((r["date"], -r["step_time_s"], file, r))
    if not found:
        return None
    _, _, file, record = max(found, key=lambda f: (f[0], f[1]))
    return file, record


def shown(path: Path) -> str:
    """``path`` from the repository root when it lies in it."""
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def run(args: argparse.Namespace) -> dict:
    device = resolve_device(args.device)
    source = f"builtin:{args.model}"
    # the adapter builds its layer templates on the meta device: no model weights are allocated
    adapter = ModelAdapter(model_config(source, vocab_size=len(load_tokenizer(source))), device, torch.bfloat16)
    shape = torch.Size((adapter.vocab_size, adapter.hidden_size))
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    weight = (torch.randn(shape, generator=gen) * 0.02).to(device, torch.bfloat16)
    ids = torch.randint(0, adapter.vocab_size, (args.batch, args.seq), generator=gen).to(device)
    grad = torch.randn(args.batch, args.seq, adapter.hidden_size, generator=gen).to(device, torch.bfloat16)

    def forward() -> tuple[torch.Tensor, torch.Tensor]:
        leaf = weight.detach().requires_grad_()
        with torch.enable_grad():
            return leaf, adapter.embed(leaf, ids)

    def autograd_bf16(state) -> torch.Tensor:
        leaf, out = state
        return torch.autograd.grad(out, [leaf], grad)[0]

    def fp32_sum(_) -> torch.Tensor:
        return adapter.embed_backward(ids, grad, torch.zeros(shape, dtype=torch.bfloat16, device=device))

    autograd_ms, autograd_bytes = measure(device, forward, autograd_bf16, args.warmup, args.repeats)
    fp32_ms, fp32_bytes = measure(device, lambda: None, fp32_sum, args.warmup, args.repeats)
    old, new = autograd_bf16(forward()).float(), fp32_sum(None).float()
    exact = adapter.embed_backward(ids, grad, torch.zeros(shape, dtype=torch.float32, device=device))
    reference = step_time_reference(args.model, args.batch, args.seq, device_name(device),
                                    Path(args.step_record) if args.step_record else None)
    step_s = reference[1]["step_time_s"] if reference else None
    return {
        "name": f"embed_grad_cost_{args.model}", **run_header(device), "model": args.model, "runner": "lazytrain",
        "world_size": 1, "batch_size": args.batch, "seq_len": args.seq, "vocab_size": adapter.vocab_size,
        "hidden_size": adapter.hidden_size, "unique_ids": int(ids.unique().numel()), "seed": args.seed,
        "warmup": args.warmup, "repeats": args.repeats,
        "autograd_bf16_ms": autograd_ms, "fp32_sum_ms": fp32_ms, "difference_ms": fp32_ms - autograd_ms,
        "autograd_bf16_peak_extra_gb": None if autograd_bytes is None else autograd_bytes / 1e9,
        "fp32_sum_peak_extra_gb": None if fp32_bytes is None else fp32_bytes / 1e9,
        # both against the fp32 sum before rounding: what bf16 summation loses, and the one rounding
        "autograd_bf16_rel_error": float((old - exact).norm() / exact.norm()),
        "fp32_sum_rel_error": float((new - exact).norm() / exact.norm()),
        "reference_record": shown(reference[0]) if reference else None,
        "reference_name": reference[1]["name"] if reference else None,
        "reference_device": reference[1]["device"] if reference else None,
        "reference_step_time_s": step_s,
        "fraction_of_step": (fp32_ms - autograd_ms) / 1e3 / step_s if step_s else None,
    }


def report(r: dict, command: str) -> str:
    def gb(v):
        return "-" if v is None else f"{v:.2f}"

    lines = [f"# Embedding gradient in fp32: its cost at {r['model']} ({r['date']})", "", f"`{command}`", "",
             (f"{r['device']}; torch {r['torch']}; ids uniform over the vocabulary ({r['vocab_size']} x "
              f"{r['hidden_size']} bf16 weight), batch {r['batch_size']} x seq {r['seq_len']} "
              f"({r['unique_ids']} distinct ids); median of {r['repeats']} after {r['warmup']} warm-up."), "",
             "| embedding backward | ms | peak extra GPU GB | error vs fp32 sum (rel. Frobenius) |",
             "| --- | --- | --- | --- |",
             (f"| bf16 autograd (before the fix) | {r['autograd_bf16_ms']:.3f} | "
              f"{gb(r['autograd_bf16_peak_extra_gb'])} | {r['autograd_bf16_rel_error']:.2e} |"),
             (f"| fp32 sum, rounded once (`embed_backward`) | {r['fp32_sum_ms']:.3f} | "
              f"{gb(r['fp32_sum_peak_extra_gb'])} | {r['fp32_sum_rel_error']:.2e} |"), ""]
    if r["reference_step_time_s"]:
        lines.append(f"Difference {r['difference_ms']:+.3f} ms = {100 * r['fraction_of_step']:+.4f}% of the "
                     f"measured step, {r['reference_step_time_s']:.3f} s ({r['reference_name']}, "
                     f"{r['reference_device']}, `{r['reference_record']}`); issue 20's budget: 2%.")
    else:
        lines.append(f"Difference {r['difference_ms']:+.3f} ms; no measured step of {r['model']} at this "
                     "batch shape on this device to compare it with.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-7b", help="a built-in shape (lazytrain.model.shapes)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--step-record", default=None, help="record file with the step time to compare with")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--tag", default="")
    args = parser.parse_args(argv)
    record = run(args)
    command = (f"python -m bench.studies.embed_grad_cost --model {args.model} --batch {args.batch} --seq {args.seq} "
               f"--device {args.device} --warmup {args.warmup} --repeats {args.repeats}")
    text = report(record, command)
    write_results([record], f"embed_grad_cost_{args.model}_{device_tag(record['device'])}_{today()}{args.tag}",
                  text, args.out)
    print(text)


if __name__ == "__main__":
    main()

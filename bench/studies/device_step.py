"""The GPU optimizer step by piece size: the calling thread's time, the GPU's, and the step's.

    python -m bench.studies.device_step --model qwen2.5-7b --chunks 21 22 23 24 25 26 27 --out bench/results

`device_step_8bit`, the compiled 8-bit AdamW step that `plan.const_update=device`,
`plan.device_layers` and `plan.device_steps` run on the GPU (``--bits 4``: `device_step_4bit`,
its 4-bit twin, both moments rounded stochastically as ``optimizer.state_rounding=auto`` does;
``--eager``: the piece run eagerly, the step's fallback where compiling fails), on scratch groups
the size of the model's decoder layer and of its head (split master, bf16 gradient), in pieces of
2**c elements for each ``--chunks`` c. Per group and size, the median over ``--repeats`` calls
after two warm-up calls (the first compiles):

- ``host_ms``: the calling thread's time in the call, the GPU held back by a sleep kernel queued
  first so that no launch waits for the GPU;
- ``gpu_ms``: the GPU's time from the first piece to the last, every piece queued before the GPU
  reaches them (behind the same sleep): the step's own work. Valid where the sleep outlasted
  the queueing (``queued_behind_sleep``);
- ``step_ms``: CUDA events around the call on an idle GPU, what the profiler's
  ``const_update_ms`` times and what the update's ``start`` costs a step: about the larger of
  the two;
- ``work_gb``: the allocator's peak above what it held before the call
  (`CostTable.device_step_work_bytes`).

Every size after the first runs the kernels compiled for any size (torch's automatic dynamic
shapes), as the steps of a run do once a group's tail has shown a second size. On the CPU
(``--device cpu``, for tests) the three times are the call's wall time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from bench.common import device_tag, run_header, today, write_results
from lazytrain.model.adapter import ModelAdapter, load_hf_config
from lazytrain.model.shapes import SHAPES
from lazytrain.optim import hybrid4bit, hybrid8bit
from lazytrain.optim.base import AdamWConfig
from lazytrain.optim.hybrid8bit import (
    COMPILED_CHUNK,
    PIECE_ALIGN,
    Hybrid8bitAdamW,
    StepScalars,
    device_step_8bit,
)
from lazytrain.optim.split import SplitMaster

OPT = AdamWConfig(lr=1e-5, betas=(0.9, 0.95), weight_decay=0.0)
SLEEP_CYCLES = 600_000_000
"""The sleep kernel queued ahead of the pieces (~0.3 s at the H200's ~2 GHz): longer than the
queueing of the smallest pieces of a 7B's head (260 pieces of 2**21 at ~0.25 ms each); a record
says whether it was (``queued_behind_sleep``)."""


def group_sizes(model: str) -> dict[str, int]:
    """Elements of the built-in shape's decoder layer group and of its final norm + head group."""
    adapter = ModelAdapter(load_hf_config(SHAPES[model]), torch.device("cpu"), torch.bfloat16)
    return {"layer": adapter.layouts[1].numel, "head": adapter.final_layout.numel}


def scratch_group(numel: int, device: torch.device, bits: int = 8) -> tuple[SplitMaster, Hybrid8bitAdamW, torch.Tensor]:
    """A split master with ``bits``-bit states (moved to ``device`` as `to_device` does), and a
    bf16 gradient there."""
    master = SplitMaster.of(torch.randn(numel) * 0.02)
    optimizer = (Hybrid8bitAdamW if bits == 8 else hybrid4bit.Hybrid4bitAdamW)([master], [numel], OPT, kernel="torch")
    if device.type == "cuda":
        optimizer.to_device(0, master.weight.to(device))
        master = optimizer.masters[0]
    grad = (torch.randn(numel, device=device) * 1e-3).bfloat16()
    return master, optimizer, grad


def measure(group: tuple[SplitMaster, Hybrid8bitAdamW, torch.Tensor], chunk: int, repeats: int,
            device: torch.device) -> dict:
    """One `scratch_group` at one piece size: the record's timing fields (module docstring)."""
    master, optimizer, grad = group
    numel = master.numel()
    state = optimizer.states[0]
    scalars = StepScalars.of(OPT, 2, 1e-5, 0.5, numel)

    def call() -> None:
        if isinstance(state, hybrid4bit.Quantized4bitState):
            hybrid4bit.device_step_4bit(grad, master, state, None, scalars, (1, 0), None, (2, 0), chunk=chunk)
        else:
            device_step_8bit(grad, master, state, None, scalars, None, chunk=chunk)

    cuda = device.type == "cuda"
    for _ in range(2):
        call()
    if cuda:
        torch.cuda.synchronize(device)
    host, gpu, step, sleep, behind = [], [], [], [], True
    for _ in range(repeats):
        if not cuda:
            t0 = time.perf_counter()
            call()
            ms = (time.perf_counter() - t0) * 1e3
            for times in (host, gpu, step):
                times.append(ms)
            continue
        slept, first, last = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        slept_from = torch.cuda.Event(enable_timing=True)
        slept_from.record()
        torch.cuda._sleep(SLEEP_CYCLES)
        slept.record()
        t0 = time.perf_counter()
        first.record()
        call()
        last.record()
        host_ms = (time.perf_counter() - t0) * 1e3
        behind = behind and not slept.query()  # the sleep still ran when the last piece was queued
        last.synchronize()
        host.append(host_ms)
        gpu.append(first.elapsed_time(last))
        sleep.append(slept_from.elapsed_time(slept))
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        call()
        end.record()
        end.synchronize()
        step.append(begin.elapsed_time(end))
    work = 0
    if cuda:
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        call()
        torch.cuda.synchronize(device)
        work = torch.cuda.max_memory_allocated(device) - base
    pieces = -(-numel // chunk)
    return {"numel": numel, "chunk": chunk, "chunk_log2": chunk.bit_length() - 1, "pieces": pieces,
            "host_ms": statistics.median(host), "gpu_ms": statistics.median(gpu), "step_ms": statistics.median(step),
            "host_ms_per_piece": statistics.median(host) / pieces, "gpu_ps_per_element": statistics.median(gpu) * 1e9 / numel,
            "sleep_ms": statistics.median(sleep) if sleep else None, "queued_behind_sleep": behind if cuda else None,
            "work_gb": work / 1e9, "repeats": repeats}


def report(records: list[dict], command: str) -> str:
    head = records[0]
    piece = COMPILED_CHUNK.bit_length() - 1
    step = ("`device_step_4bit` (4-bit states, stochastic codes" if head.get("bits") == 4
            else "`device_step_8bit` (8-bit states")
    about = (f"Model shape {head['model']}; torch {head['torch']}. {step}, split master, bf16 gradient; "
             f"{'the piece run eagerly' if head.get('eager') else 'compiled'}) on a scratch group the size of a decoder layer and of the head; medians of "
             f"{head['repeats']} calls after two warm-ups. host: the calling thread's time in the call (the GPU "
             "held back by a sleep queued first); GPU: the pieces' own time, all queued before the GPU reached "
             "them; step: events around the call on an idle GPU (what `const_update_ms` times and the update's "
             f"start costs); work: the allocator's peak above what it held. The default piece is 2^{piece}.")
    lines = [f"# The GPU optimizer step by piece size ({head['date']}, {head['device']})", "", f"`{command}`", "",
             about, "",
             ("| group | elements | piece | pieces | host ms | GPU ms | step ms | host ms / piece | GPU ps / element | "
             "work GB | queued behind the sleep |"),
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        lines.append(f"| {r['group']} | {r['numel']:,} | 2^{r['chunk_log2']} | {r['pieces']} | {r['host_ms']:.2f} | "
                     f"{r['gpu_ms']:.2f} | {r['step_ms']:.2f} | {r['host_ms_per_piece']:.3f} | "
                     f"{r['gpu_ps_per_element']:.2f} | {r['work_gb']:.3f} | {r['queued_behind_sleep']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-7b", choices=sorted(SHAPES))
    parser.add_argument("--groups", nargs="+", default=["layer", "head"], choices=["layer", "head"])
    parser.add_argument("--chunks", nargs="+", type=int, default=[21, 22, 23, 24, 25, 26, 27],
                        help="piece sizes as powers of two (at least 9: hybrid8bit.PIECE_ALIGN)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--bits", type=int, choices=[8, 4], default=8, help="the states' bits")
    parser.add_argument("--eager", action="store_true", help="run the piece eagerly (the fallback), not compiled")
    parser.add_argument("--tag", default="")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("device_step: no CUDA device here; pass --device cpu for a (slow, eager or CPU-compiled) try")
    if min(args.chunks) < PIECE_ALIGN.bit_length() - 1:
        raise SystemExit(f"device_step: --chunks must be at least {PIECE_ALIGN.bit_length() - 1} (a piece holds a "
                         f"multiple of {PIECE_ALIGN} elements: hybrid8bit.PIECE_ALIGN), got {min(args.chunks)}")
    sizes = group_sizes(args.model)
    header = run_header(device, model=args.model, runner="lazytrain", world_size=1, bits=args.bits, eager=args.eager)
    piece = hybrid4bit.PIECE_4BIT if args.bits == 4 else hybrid8bit.PIECE_8BIT
    before = piece.fn
    if args.eager:
        piece.fn = piece.eager
    try:
        records = measure_groups(args, sizes, header, piece, device)
    finally:  # (a caller in this process keeps its own choice)
        piece.fn = before
    command = "python -m bench.studies.device_step " + " ".join(argv if argv is not None else sys.argv[1:])
    stem = f"device_step_{args.model}{'_4bit' if args.bits == 4 else ''}_{device_tag(device)}_{today()}{args.tag}"
    write_results(records, stem, report(records, command), args.out)
    return records


def measure_groups(args, sizes: dict[str, int], header: dict, piece, device: torch.device) -> list[dict]:
    """`measure` of each ``--groups`` group at each ``--chunks`` size: the records."""
    records = []
    for name in args.groups:
        group = scratch_group(sizes[name], device, args.bits)
        for c in args.chunks:
            row = measure(group, 1 << c, args.repeats, device)
            records.append({"name": f"device_step_{args.model}_{name}_2^{c}", **header, "group": name, **row,
                            "ran_eagerly": piece.eagerly})
            print({k: records[-1][k] for k in ("group", "chunk_log2", "host_ms", "gpu_ms", "step_ms", "work_gb")},
                  flush=True)
        del group
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return records


if __name__ == "__main__":
    main()

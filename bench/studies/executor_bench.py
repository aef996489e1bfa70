"""Executor throughput on a random-init model of a real shape, per plan policy and batch.

One process, one model in host memory, every policy run through the same executor:

    python -m bench.studies.executor_bench --model qwen2.5-7b --seq 1024 \
        --runs megatrain:32 megatrain:64 keep_all:max --out bench/results

``POLICY:BATCH`` runs that plan at that batch; ``keep_all:max`` tries batches from
``--max-batch`` down and reports every out-of-memory with the bytes asked for. Per run:
tokens/s, TFLOPS by both formulas of DESIGN.md section 6, peak GPU memory, host RSS, and a
breakdown from CUDA-event spans (GPU compute, exposed H2D, exposed D2H, other idle, of which
the CPU optimizer wait), next to the compute-only time of the same layers with weights
resident. ``--check-grads`` first compares bf16 gradients of a tiny model on the GPU with
fp32 HF autograd. Writes JSON records and a Markdown report to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from bench.common import (
    bench_session,
    device_tag,
    oom_record,
    run_header,
    timed_steps,
    today,
    write_results,
)
from lazytrain.plan.policies import PolicyOptions, baseline_plan


def check_grads_bf16(device: torch.device) -> dict:
    """bf16 streamed gradients of a tiny Qwen2 against fp32 HF autograd, on the GPU."""
    import tempfile

    import transformers

    from lazytrain.memory.host_store import HostStore
    from lazytrain.model.adapter import ModelAdapter, load_hf_config
    from lazytrain.model.loading import load_safetensors

    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(hidden_size=256, intermediate_size=768, num_hidden_layers=6,
                                   num_attention_heads=8, num_key_value_heads=2, vocab_size=1000)
    cfg.architectures = ["Qwen2ForCausalLM"]
    ref = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").float()
    with torch.no_grad():
        # the fp32 reference runs on the bf16-rounded weights upcast, so the check measures
        # the arithmetic, not the rounding of the weights themselves
        for p in ref.parameters():
            p.copy_(p.bfloat16().float())
    with tempfile.TemporaryDirectory() as d:
        ref.save_pretrained(d)
        adapter = ModelAdapter(load_hf_config(d), device, torch.bfloat16)
        store = HostStore(adapter.layouts, torch.bfloat16, pin=True)
        load_safetensors(adapter, store, d)
    ref = ref.to(device)
    ids = torch.randint(0, 1000, (4, 256))
    labels = ids.clone()
    labels[:, :64] = -100
    mask = torch.ones_like(ids)
    mask[1, 200:] = 0
    labels[1, 200:] = -100
    def hf_grads(model):
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids.to(device), attention_mask=mask.to(device), labels=labels.to(device),
                    position_ids=torch.arange(256, device=device).expand(4, -1))
        out.loss.backward()
        return out.loss.item(), {n: p.grad.reshape(-1).float().cpu() for n, p in model.named_parameters()}

    ref_loss, want = hf_grads(ref)
    # the noise floor: HF's own bf16 autograd against its fp32 autograd
    _, hf_bf16 = hf_grads(_bf16_copy(ref))

    def errors(got: dict) -> tuple[float, float]:
        names = list(want)
        diff = torch.cat([got[n] - want[n] for n in names]).norm()
        total = float(diff / torch.cat([want[n] for n in names]).norm())
        worst = max(float((got[n] - want[n]).norm() / want[n].norm().clamp_min(1e-30)) for n in names)
        return total, worst

    results = {"hf_bf16": dict(zip(("global", "worst_tensor"), errors(hf_bf16)))}
    for policy in ("megatrain", "keep_all"):
        plan = baseline_plan(policy, adapter.num_layers, 4, 256, PolicyOptions(megatrain_every=2,
                                                                              head_chunk_tokens=300))
        from lazytrain.runtime.executor import Executor

        stats = Executor(adapter, store, plan, device).forward_backward(ids, labels, mask)
        if device.type == "cuda":
            torch.cuda.synchronize()
        got = {}
        for g, layout in enumerate(adapter.layouts):
            for p in layout.params:
                got[layout.hf_prefix + p.name] = store.grads[g][p.offset : p.offset + p.numel].float()
        total, worst = errors(got)
        results[policy] = {"loss": stats.loss, "ref_loss": ref_loss, "global": total, "worst_tensor": worst}
    worst = max(results[p]["global"] for p in ("megatrain", "keep_all"))
    return {"max_relative_grad_error": worst, "passed": worst < 1e-2, "detail": results}


def _bf16_copy(model):
    import copy

    return copy.deepcopy(model).to(torch.bfloat16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-7b")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--runs", nargs="+", default=["megatrain:32", "megatrain:64", "keep_all:max"])
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--head-chunk", type=int, default=8192)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--optimizer", choices=["fp32", "hybrid8bit"], default="fp32")
    parser.add_argument("--serial-optimizer", action="store_true", help="no overlap with the next forward")
    parser.add_argument("--check-grads", action="store_true")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("executor_bench needs a CUDA device")
    device = torch.device("cuda")
    common = run_header(device, model=args.model, optimizer=args.optimizer,
                        overlap_optimizer=not args.serial_optimizer)
    records = []
    if args.check_grads:
        check = check_grads_bf16(device)
        print("bf16 gradient check:", json.dumps(check), flush=True)
        records.append({"name": "bf16_grad_check", **common, "model": "qwen2-tiny", **check})

    t0 = time.perf_counter()
    session = bench_session(args.model, optimizer=args.optimizer, seq=args.seq, head_chunk=args.head_chunk)
    store = session.store
    host = store.bytes(session.optimizer.state_bytes())
    print(f"model {args.model}: {store.num_params / 1e9:.2f}B params, built in "
          f"{time.perf_counter() - t0:.0f} s; host bytes/param {host.per_param()}, pinned "
          f"{host.pinned / 2**30:.1f} GiB", flush=True)
    common["num_params"] = store.num_params
    common["host_bytes_per_param"] = host.per_param()
    options = PolicyOptions(megatrain_every=args.every, head_chunk_tokens=args.head_chunk)

    for spec in args.runs:
        policy, batch_spec = spec.split(":")
        batches = range(args.max_batch, 0, -1) if batch_spec == "max" else [int(batch_spec)]
        for batch in batches:
            name = f"{args.model}_{policy}_b{batch}_s{args.seq}{args.tag}"
            plan = baseline_plan(policy, session.adapter.num_layers, batch, args.seq, options)
            try:
                record = timed_steps(session, plan, warmup=args.warmup, steps=args.steps,
                                     serial_optimizer=args.serial_optimizer)
            except torch.OutOfMemoryError as error:
                records.append(oom_record(name, common, policy, batch, args.seq, error))
                print(f"{name}: out of memory: {records[-1]['oom']}", flush=True)
                continue
            records.append({"name": name, **common, **record})
            print(json.dumps(records[-1]), flush=True)
            if batch_spec == "max":
                break

    stem = f"executor_{args.model}_{device_tag(device)}_{today()}{args.tag}"
    write_results(records, stem, markdown(records, args), args.out)
    print(markdown(records, args))


NAN = float("nan")  # a figure only a GPU run measures (stream trace, CUDA peaks)


def markdown(records: list[dict], args) -> str:
    head = next((r for r in records if "policy" in r), records[0])
    lines = [
        f"# Executor benchmark: {args.model}, seq {args.seq}",
        "",
        (f"{head['date']}, {head['device']}, torch {head['torch']}, optimizer {args.optimizer} "
        f"(overlapped: {not args.serial_optimizer}), {args.warmup} warm-up + {args.steps} measured "
        f"steps (median), random tokens, no padding. Command: `python -m bench.studies.executor_bench "
        f"--model {args.model} --seq {args.seq} --runs {' '.join(args.runs)}`"),
        "",
        ("| run | tokens/s | TFLOPS 6NT | TFLOPS model | step s | fwd+bwd s | GPU compute s | "
        "exposed H2D s | exposed D2H s | other idle s (optimizer wait) | CPU optimizer s | "
        "compute-only layers s | peak GPU alloc / reserved GB | host RSS GB |"),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        if "oom" in r:
            lines.append(f"| {r['name']} | out of memory: {r['oom']} |" + " |" * 12)
            continue
        if "tokens_per_s" not in r:
            continue
        lines.append(
            f"| {r['name']} | {r['tokens_per_s']:.0f} | {r['tflops_6nt']:.1f} | {r['tflops_model']:.1f} | "
            f"{r['step_time_s']:.2f} | {r.get('fwd_bwd_s', NAN):.2f} | {r.get('gpu_compute_s', NAN):.2f} | "
            f"{r.get('exposed_h2d_s', NAN):.3f} | {r.get('exposed_d2h_s', NAN):.3f} | {r.get('gpu_idle_other_s', NAN):.2f} "
            f"({r['optimizer_wait_s']:.2f}) | {r['cpu_optimizer_s']:.2f} | {r['compute_only_layers_s']:.2f} | "
            f"{r.get('peak_gpu_alloc_gb', NAN):.1f} / {r.get('peak_gpu_reserved_gb', NAN):.1f} | {r['host_rss_gb']:.1f} |"
        )
    check = next((r for r in records if r["name"] == "bf16_grad_check"), None)
    if check:
        d = check["detail"]
        lines += ["", ("bf16 gradient check (tiny Qwen2, 6 layers, on the GPU) against fp32 HF autograd, "
                  "relative L2 error of all gradients together (and of the worst single tensor): "
                  f"megatrain {d['megatrain']['global']:.2e} ({d['megatrain']['worst_tensor']:.2e}), "
                  f"keep_all {d['keep_all']['global']:.2e} ({d['keep_all']['worst_tensor']:.2e}); "
                  f"HF's own bf16 autograd {d['hf_bf16']['global']:.2e} ({d['hf_bf16']['worst_tensor']:.2e}). "
                  f"{'pass' if check['passed'] else 'FAIL'} (threshold 1e-2 on the global error)")]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

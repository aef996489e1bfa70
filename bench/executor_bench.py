"""Executor throughput on a random-init model of a real shape, per plan policy and batch.

One process, one model in host memory, every policy run through the same executor:

    python bench/executor_bench.py --model qwen2.5-7b --seq 1024 \
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
import datetime
import gc
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from lazytrain.model.build import build_model
from lazytrain.model.flops import flops_6nt, model_flops
from lazytrain.optim.adamw import FusedAdamW
from lazytrain.plan.plan import checkpoint_all_plan, keep_all_plan, megatrain_plan
from lazytrain.runtime.executor import Executor
from lazytrain.runtime.update import HostUpdater
from lazytrain.train.metrics import host_rss_bytes


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or "cpu"


def make_plan(policy: str, layers: int, batch: int, seq: int, every: int, chunk: int):
    if policy == "megatrain":
        return megatrain_plan(layers, batch, seq, every=every, head_chunk_tokens=chunk)
    if policy == "keep_all":
        return keep_all_plan(layers, batch, seq, head_chunk_tokens=chunk)
    if policy.startswith("checkpoint_"):
        return checkpoint_all_plan(layers, batch, seq, tier=policy.split("_", 1)[1], head_chunk_tokens=chunk)
    raise SystemExit(f"unknown policy {policy!r}")


def random_batch(batch: int, seq: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    return ids, ids.clone()


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
        plan = make_plan(policy, adapter.num_layers, 4, 256, 2, 300)
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


def compute_only_ms(executor: Executor, batch: int, seq: int, repeats: int = 5) -> dict:
    """fwd (under autograd) + bwd of one decoder layer of each type with weights resident;
    the whole stack's sum counts each layer at its type's time."""
    adapter = executor.adapter
    dev, dtype = executor.device, executor.dtype
    position_ids = torch.arange(seq, device=dev).unsqueeze(0).expand(batch, -1)
    rope = adapter.rotary_embeddings(position_ids, dtype)
    masks = adapter.layer_masks(None)
    x = torch.randn(batch, seq, adapter.hidden_size, device=dev, dtype=dtype)
    cuda = dev.type == "cuda"
    by_type = {}
    for kind in adapter.layer_type_names():
        layer = adapter.layer_types.index(kind)
        slot = executor.store.weights[layer + 1].to(dev)
        times = []
        for r in range(repeats + 2):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            leaves = executor._leaves(adapter.layouts[layer + 1], slot)
            x_in = x.detach().requires_grad_()
            t0 = time.perf_counter()
            if cuda:
                start.record()
            with torch.enable_grad():
                out = adapter.layer_forward(layer, leaves, x_in, rope, masks)
                torch.autograd.grad(out, [x_in, *leaves.values()], torch.ones_like(out))
            if cuda:
                end.record()
                end.synchronize()
            if r >= 2:
                times.append(start.elapsed_time(end) if cuda else (time.perf_counter() - t0) * 1e3)
            del out
        by_type[kind] = statistics.median(times)
        del slot
    del x
    if cuda:
        torch.cuda.empty_cache()
    return {
        "layer_fwd_bwd_ms": by_type[adapter.layer_types[0]],
        "layer_fwd_bwd_ms_by_type": by_type,
        "layers_fwd_bwd_ms": sum(by_type[kind] for kind in adapter.layer_types),
    }


def run_one(adapter, store, optimizer, policy, batch, seq, args, device, plan=None, nvme=None) -> dict:
    """Train ``args.warmup + args.steps`` steps of ``plan`` (default: ``policy``'s) on random tokens."""
    if plan is None:
        plan = make_plan(policy, adapter.num_layers, batch, seq, args.every, args.head_chunk)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    executor = Executor(adapter, store, plan, device, nvme=nvme)
    updater = HostUpdater(executor, optimizer, overlap=not args.serial_optimizer)
    executor.trace.enabled = True
    steps = []
    try:
        for step in range(args.warmup + args.steps):
            ids, labels = random_batch(batch, seq, adapter.vocab_size, seed=step)
            t0 = time.perf_counter()
            stats = executor.forward_backward(ids, labels)
            breakdown = executor.trace.summary()
            waited = updater.wait_seconds  # this step's forward waiting for the last update
            updater.start(min(1.0, 1.0 / (stats.grad_norm + 1e-6)), 1e-5)
            if args.serial_optimizer:
                updater.finish()
            end = time.perf_counter()  # when the next step would start
            if step >= args.warmup:
                steps.append((t0, stats, breakdown, waited))
        updater.finish()
    except BaseException:
        try:
            updater.finish()
        except RuntimeError:
            pass
        raise
    # step time: start of one measured step to the start of the next. A step's overlapped
    # CPU update runs in the next forward, so each step counts the previous step's exposed
    # update (the warm-up's for the first), as in steady state.
    starts = [s[0] for s in steps] + [end]
    step_times = [b - a for a, b in zip(starts, starts[1:])]
    step_time = statistics.median(step_times)
    tokens = batch * seq
    compute = compute_only_ms(executor, batch, seq)
    med = lambda key: statistics.median(s[2].get(key, 0.0) for s in steps) / 1e3
    record = {
        "policy": policy,
        "batch_size": batch,
        "seq_len": seq,
        "tokens_per_s": tokens / step_time,
        "tflops_6nt": flops_6nt(adapter, tokens) / step_time / 1e12,
        "tflops_model": model_flops(adapter, tokens, seq) / step_time / 1e12,
        "step_time_s": step_time,
        "step_times_s": step_times,
        "predicted_step_time_s": None,
        "peak_gpu_alloc_gb": torch.cuda.max_memory_allocated(device) / 1e9 if cuda else 0.0,
        "peak_gpu_reserved_gb": torch.cuda.max_memory_reserved(device) / 1e9 if cuda else 0.0,
        "host_rss_gb": host_rss_bytes() / 1e9,
        "gpu_mem_cap_gb": None,
        "loss": steps[-1][1].loss,
        "fwd_bwd_s": med("step_ms"),
        "gpu_compute_s": med("compute_ms"),
        "exposed_h2d_s": med("h2d_exposed_ms"),
        "exposed_d2h_s": med("d2h_exposed_ms"),
        "other_idle_s": med("other_idle_ms"),
        "h2d_busy_s": med("h2d_busy_ms"),
        "d2h_busy_s": med("d2h_busy_ms"),
        "optimizer_wait_s": statistics.median(s[3] for s in steps),
        "cpu_optimizer_s": updater.last_step_seconds,
        "h2d_weight_gb_per_step": steps[-1][1].h2d_weight_bytes / 1e9,
        "act_peak_gb": {tier: b / 1e9 for tier, b in steps[-1][1].peak_activation_bytes.items()},
        "compute_only_layers_s": compute["layers_fwd_bwd_ms"] / 1e3,
        "compute_only_layer_ms": compute["layer_fwd_bwd_ms"],
        "compute_only_layer_ms_by_type": compute["layer_fwd_bwd_ms_by_type"],
    }
    del executor, updater
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return record


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
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    common = {
        "date": date,
        "device": device_name(device),
        "torch": torch.__version__,
        "model": args.model,
        "optimizer": args.optimizer,
        "overlap_optimizer": not args.serial_optimizer,
        "cpu_threads": torch.get_num_threads(),
    }
    records = []
    if args.check_grads:
        check = check_grads_bf16(device)
        print("bf16 gradient check:", json.dumps(check), flush=True)
        records.append({"name": "bf16_grad_check", **common, "model": "qwen2-tiny", **check})

    t0 = time.perf_counter()
    adapter, store = build_model(f"builtin:{args.model}", device, torch.bfloat16, seed=0,
                                 optimizer_bytes_per_param=2.1 if args.optimizer == "hybrid8bit" else 8.0)
    decay = [layout.decay_numel for layout in adapter.layouts]
    if args.optimizer == "hybrid8bit":
        from lazytrain.optim.hybrid8bit import Hybrid8bitAdamW

        optimizer = Hybrid8bitAdamW(store.masters, decay, _opt_config())
    else:
        optimizer = FusedAdamW(store.masters, decay, _opt_config())
    host = store.bytes(optimizer.state_bytes())
    print(f"model {args.model}: {store.num_params / 1e9:.2f}B params, built in "
          f"{time.perf_counter() - t0:.0f} s; host bytes/param {host.per_param()}, pinned "
          f"{host.pinned / 2**30:.1f} GiB", flush=True)
    common["num_params"] = store.num_params
    common["host_bytes_per_param"] = host.per_param()

    for spec in args.runs:
        policy, batch_spec = spec.split(":")
        batches = range(args.max_batch, 0, -1) if batch_spec == "max" else [int(batch_spec)]
        for batch in batches:
            name = f"{args.model}_{policy}_b{batch}_s{args.seq}{args.tag}"
            message = None
            try:
                record = run_one(adapter, store, optimizer, policy, batch, args.seq, args, device)
            except torch.OutOfMemoryError as error:
                message = str(error).split("\n")[0]
            if message is not None:
                gc.collect()
                torch.cuda.empty_cache()
                print(f"{name}: out of memory: {message}", flush=True)
                records.append({"name": name, **common, "policy": policy, "batch_size": batch,
                                "seq_len": args.seq, "oom": message})
                continue
            records.append({"name": name, **common, **record})
            print(json.dumps(records[-1]), flush=True)
            if batch_spec == "max":
                break

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"executor_{args.model}_h200_{date}{args.tag}" if "H200" in common["device"] else f"executor_{args.model}_{date}{args.tag}"
    (out / f"{stem}.json").write_text(json.dumps(records, indent=1))
    (out / f"{stem}.md").write_text(markdown(records, args))
    print(markdown(records, args))


def _opt_config():
    from lazytrain.optim.base import AdamWConfig

    return AdamWConfig(lr=1e-5, weight_decay=0.0)


def markdown(records: list[dict], args) -> str:
    head = next((r for r in records if "policy" in r), records[0])
    lines = [
        f"# Executor benchmark: {args.model}, seq {args.seq}",
        "",
        f"{head['date']}, {head['device']}, torch {head['torch']}, optimizer {args.optimizer} "
        f"(overlapped: {not args.serial_optimizer}), {args.warmup} warm-up + {args.steps} measured "
        f"steps (median), random tokens, no padding. Command: `python bench/executor_bench.py "
        f"--model {args.model} --seq {args.seq} --runs {' '.join(args.runs)}`",
        "",
        "| run | tokens/s | TFLOPS 6NT | TFLOPS model | step s | fwd+bwd s | GPU compute s | "
        "exposed H2D s | exposed D2H s | other idle s (optimizer wait) | CPU optimizer s | "
        "compute-only layers s | peak GPU alloc / reserved GB | host RSS GB |",
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
            f"{r['step_time_s']:.2f} | {r['fwd_bwd_s']:.2f} | {r['gpu_compute_s']:.2f} | "
            f"{r['exposed_h2d_s']:.3f} | {r['exposed_d2h_s']:.3f} | {r['other_idle_s']:.2f} "
            f"({r['optimizer_wait_s']:.2f}) | {r['cpu_optimizer_s']:.2f} | {r['compute_only_layers_s']:.2f} | "
            f"{r['peak_gpu_alloc_gb']:.1f} / {r['peak_gpu_reserved_gb']:.1f} | {r['host_rss_gb']:.1f} |"
        )
    check = next((r for r in records if r["name"] == "bf16_grad_check"), None)
    if check:
        d = check["detail"]
        lines += ["", "bf16 gradient check (tiny Qwen2, 6 layers, on the GPU) against fp32 HF autograd, "
                  "relative L2 error of all gradients together (and of the worst single tensor): "
                  f"megatrain {d['megatrain']['global']:.2e} ({d['megatrain']['worst_tensor']:.2e}), "
                  f"keep_all {d['keep_all']['global']:.2e} ({d['keep_all']['worst_tensor']:.2e}); "
                  f"HF's own bf16 autograd {d['hf_bf16']['global']:.2e} ({d['hf_bf16']['worst_tensor']:.2e}). "
                  f"{'pass' if check['passed'] else 'FAIL'} (threshold 1e-2 on the global error)"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

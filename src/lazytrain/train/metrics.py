"""Per-step metrics: JSONL always, TensorBoard when it is installed."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from lazytrain.model.adapter import ModelAdapter
from lazytrain.model.flops import flops_6nt, model_flops, moe_flops
from lazytrain.runtime.executor import StepStats


def host_rss_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def gpu_memory(device: torch.device) -> dict[str, float]:
    if device.type != "cuda":
        return {}
    return {
        "peak_gpu_alloc_gb": torch.cuda.max_memory_allocated(device) / 1e9,
        "peak_gpu_reserved_gb": torch.cuda.max_memory_reserved(device) / 1e9,
    }


def step_metrics(adapter: ModelAdapter, stats: StepStats, trace: dict[str, float], step_time_s: float,
                 seq_len: int, device: torch.device) -> dict[str, float]:
    """One step's measured figures, under the names every record uses (trainer and benchmarks).

    ``trace`` is the executor's stream summary (empty off the GPU): GPU compute, the H2D and
    D2H time the compute stream waited on, and other GPU idle (the CPU optimizer or NVMe).
    Tokens are real (non-pad) tokens everywhere; ``pad_tokens`` and ``fill_ratio`` (real tokens
    over token slots) show what padding cost, and what packing saved. ``tflops_model`` is
    (6 N_active_nonembedding + token mixing) * tokens / step time (`model_flops`); a
    mixture-of-experts model's records add ``tflops_active``, 6 N_active * tokens / step time,
    beside ``tflops_6nt``, 6 N_all * tokens / step time (`moe_flops`).
    """
    tokens = stats.num_tokens
    record = {
        "step_time_s": step_time_s,
        "tokens_per_s": tokens / step_time_s,
        "pad_tokens": stats.num_slots - tokens,
        "fill_ratio": tokens / stats.num_slots,
        "tflops_model": model_flops(adapter, tokens, seq_len) / step_time_s / 1e12,
        "tflops_6nt": flops_6nt(adapter, tokens) / step_time_s / 1e12,
        **{f"tflops_{name}": flops / step_time_s / 1e12 for name, flops in moe_flops(adapter, tokens).items()},
        **{f"act_{tier}_gb": nbytes / 1e9 for tier, nbytes in stats.peak_activation_bytes.items()},
        "h2d_weight_gb": stats.h2d_weight_bytes / 1e9,
        "host_rss_gb": host_rss_bytes() / 1e9,
        **gpu_memory(device),
    }
    if trace:
        record.update({
            "fwd_bwd_s": trace["step_ms"] / 1e3,
            "gpu_compute_s": trace["compute_ms"] / 1e3,
            "exposed_h2d_s": trace["h2d_exposed_ms"] / 1e3,
            "exposed_d2h_s": trace["d2h_exposed_ms"] / 1e3,
            "gpu_idle_other_s": trace["other_idle_ms"] / 1e3,
            "h2d_busy_s": trace.get("h2d_busy_ms", 0.0) / 1e3,
            "d2h_busy_s": trace.get("d2h_busy_ms", 0.0) / 1e3,
            # the saved activations' share of the copy streams (the rest is weights and gradients)
            "h2d_act_busy_s": trace.get("h2d_act_busy_ms", 0.0) / 1e3,
            "d2h_act_busy_s": trace.get("d2h_act_busy_ms", 0.0) / 1e3,
        })
    return record


def truncate_metrics(path: Path, step: int) -> None:
    """Drop the records after ``step`` (a killed run's steps past its checkpoint), atomically."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) <= step:
                kept.append(line)
        except ValueError:  # a line cut short by the kill
            continue
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    tmp.replace(path)


class MetricsWriter:
    def __init__(self, out_dir: Path, append: bool = False, tensorboard: bool = True):
        out_dir.mkdir(parents=True, exist_ok=True)
        self.path = out_dir / "metrics.jsonl"
        self._file = self.path.open("a" if append else "w")
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(out_dir / "tensorboard"))
            except ImportError:
                self._tb = None

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None and "step" in record:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step":
                    self._tb.add_scalar(key, value, record["step"])

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()

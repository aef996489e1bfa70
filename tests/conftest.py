"""Tiny HF models of each supported family, saved as real HF folders."""

from __future__ import annotations

import os
import signal

# Bit-for-bit tests compare runs across processes (a killed CLI child against an in-process
# reference). MKL may pick fewer threads under load (MKL_DYNAMIC) and, on Intel CPUs, kernels
# whose summation order depends on them: one CI run's child differed from the in-process run by
# one ulp at step 1. Fixed here, before torch loads MKL; child processes inherit both.
os.environ.setdefault("MKL_DYNAMIC", "FALSE")
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

import pytest
import torch
import transformers
from hypothesis import settings

# CI runs the same examples every time (a failure found locally is kept by hypothesis'
# database; CI must not fail on a fresh draw it never saw before landing)
settings.register_profile("ci", derandomize=True, deadline=None)
if os.environ.get("CI"):
    settings.load_profile("ci")

# What a caller's shell may hold that LazyTrain acts on: its own switches (LAZYTRAIN_*) and a
# torchrun launch (RANK and WORLD_SIZE make a run data parallel). No test inherits them; a test
# that needs one sets it itself (monkeypatch.setenv, or a child process's env).
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                    "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(scope="session", autouse=True)
def clean_environment(tmp_path_factory):
    """The session without the caller's LazyTrain and torchrun variables, in an empty folder
    (session- and module-scoped fixtures run here, before any test's own folder)."""
    with pytest.MonkeyPatch.context() as patch:
        for name in list(os.environ):
            if name.startswith(("LAZYTRAIN_", "TORCHELASTIC_")) or name in LAUNCH_VARIABLES:
                patch.delenv(name)
        patch.chdir(tmp_path_factory.mktemp("cwd"))
        yield


# The modules whose tests load every build of the optimizer kernels (8- and 4-bit, native and
# each instruction set: `kernel.VARIANTS`). A fresh checkout compiles each build at first use,
# ~13 s of one core each, ~100 s in all, one after another in the test that first asks.
KERNEL_VARIANT_MODULES = ("test_bf16_master", "test_optim_hybrid4bit", "test_optim_hybrid8bit", "test_optim_quant",
                          "test_split_master")
# A child that builds them all ahead through `load_kernel` itself, with this session's source
# files, flags and build folders, so each test loads the same build it would have compiled.
# Niced, in this session (the scheduler's autogroup: a session of its own would get an equal
# share of the CPU whatever its nice value, and the tests' OpenMP threads then wait on each
# other at every op), it takes the time the tests leave idle. Stopped with SIGTERM, it exits
# through the builds' `finally` clauses (torch's build lock is released, as after a build).
_BUILD_KERNELS = """
import os, signal, sys
os.nice(19)
signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(1))
from lazytrain.optim import kernel
builds = [(name, None) for name in kernel.SOURCES]
builds += [(name, v) for name in kernel.SOURCES for v in kernel.VARIANTS if not kernel.missing_cpu_flags(v)]
for name, variant in builds:
    kernel.load_kernel(variant=variant, name=name)  # a failed build warns; the test that needs it fails as before
"""


@pytest.fixture(scope="session", autouse=True)
def kernels_built_ahead(request, clean_environment):
    """Starts the kernel builds in the background when the session runs a module of
    `KERNEL_VARIANT_MODULES`; a test that needs a build before it is done waits on its build
    lock (optim/kernel.py), as for any other process's build."""
    modules = {item.module.__name__ for item in request.session.items if getattr(item, "module", None)}
    if not modules & set(KERNEL_VARIANT_MODULES):
        yield
        return
    import subprocess
    import sys
    from pathlib import Path

    import lazytrain

    src = str(Path(lazytrain.__file__).resolve().parents[1])  # the checkout this session imports
    path = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)
    builder = subprocess.Popen([sys.executable, "-c", _BUILD_KERNELS], env={**os.environ, "PYTHONPATH": path},
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, process_group=0)
    yield
    if builder.poll() is None:  # a short session: its builds stop here (the finished ones stay cached)
        os.killpg(builder.pid, signal.SIGTERM)
    builder.wait()


@pytest.fixture(autouse=True)
def own_working_directory(tmp_path):
    """Each test runs in its own tmp folder: a relative path (the default training.output_dir
    runs/default) can neither find the checkout's earlier runs nor leave one there, and child
    processes start there too."""
    with pytest.MonkeyPatch.context() as patch:  # apart from the test's monkeypatch (which may undo)
        patch.chdir(tmp_path)
        yield

FAMILIES = {
    "qwen2": {"cls": transformers.Qwen2Config, "arch": "Qwen2ForCausalLM", "tied": False},
    "qwen2-tied": {"cls": transformers.Qwen2Config, "arch": "Qwen2ForCausalLM", "tied": True},
    "qwen3": {"cls": transformers.Qwen3Config, "arch": "Qwen3ForCausalLM", "tied": False, "head_dim": 16},
    "llama": {"cls": transformers.LlamaConfig, "arch": "LlamaForCausalLM", "tied": True},
    # Qwen3.5/3.6 hybrids: Gated-DeltaNet and gated attention layers. Untied, odd head counts
    # (3 query heads on 1 KV head; 3 value heads on 1 key head) and a 3:2 layer pattern; and
    # tied with the published 3:1 pattern
    "qwen3_5": {
        "cls": transformers.Qwen3_5TextConfig, "arch": "Qwen3_5ForCausalLM", "tied": False, "head_dim": 8,
        "pattern": ("linear_attention", "full_attention", "linear_attention", "linear_attention", "full_attention"),
        "extra": {"num_attention_heads": 3, "num_key_value_heads": 1, "linear_num_key_heads": 1,
                  "linear_num_value_heads": 3, "linear_key_head_dim": 8, "linear_value_head_dim": 8},
    },
    "qwen3_5-tied": {
        "cls": transformers.Qwen3_5TextConfig, "arch": "Qwen3_5ForCausalLM", "tied": True, "head_dim": 8,
        "pattern": ("linear_attention", "linear_attention", "linear_attention", "full_attention"),
        "extra": {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
                  "linear_value_head_dim": 4},
    },
    # mixture of experts: Qwen3-MoE (top-2 of 8, renormalised, with the router's load-balancing
    # loss at a coefficient that makes it count) and the Qwen3.5-MoE hybrid (top-4 of 8, a
    # sigmoid-gated shared expert, no load-balancing loss: HF's default)
    "qwen3_moe": {
        "cls": transformers.Qwen3MoeConfig, "arch": "Qwen3MoeForCausalLM", "tied": False, "head_dim": 16,
        "extra": {"moe_intermediate_size": 16, "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True,
                  "output_router_logits": True, "router_aux_loss_coef": 0.3},
    },
    "qwen3_5_moe": {
        "cls": transformers.Qwen3_5MoeTextConfig, "arch": "Qwen3_5MoeForCausalLM", "tied": True, "head_dim": 8,
        "pattern": ("linear_attention", "full_attention"),
        "extra": {"linear_num_key_heads": 1, "linear_num_value_heads": 2, "linear_key_head_dim": 8,
                  "linear_value_head_dim": 8, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 24,
                  "num_experts": 8, "num_experts_per_tok": 4},
    },
}
HYBRID_FAMILIES = ("qwen3_5", "qwen3_5-tied")
MOE_FAMILIES = ("qwen3_moe", "qwen3_5_moe")


def tiny_config(family: str, layers: int = 5, **overrides) -> transformers.PretrainedConfig:
    spec = FAMILIES[family]
    extra = {"head_dim": spec["head_dim"]} if "head_dim" in spec else {}
    if "pattern" in spec:
        pattern = spec["pattern"]
        extra["layer_types"] = [pattern[i % len(pattern)] for i in range(layers)]
        if "full_attention" not in extra["layer_types"]:
            extra["layer_types"][-1] = "full_attention"
    kwargs = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 101,
        "max_position_embeddings": 128,
        "tie_word_embeddings": spec["tied"],
        **extra,
    }
    kwargs.update(spec.get("extra", {}))
    kwargs.update(overrides)
    config = spec["cls"](**kwargs)
    config.architectures = [spec["arch"]]
    return config


def make_hf_model(family: str, seed: int = 0, layers: int = 5, **overrides):
    """A tiny HF model of ``family`` (``overrides``: config values), random weights, fp32."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        tiny_config(family, layers, **overrides), attn_implementation="sdpa"
    ).float()
    # HF initialises norms to 1 and biases to 0; random values make every gradient path count
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.normal_(1.0 if "norm" in name else 0.0, 0.1)
            elif name.endswith("mlp.gate.weight"):  # routers: clear top-k margins, not near-ties
                p.normal_(0.0, 1.0)
    return model


@pytest.fixture(params=list(FAMILIES))
def family(request) -> str:
    return request.param


@pytest.fixture
def hf_folder(tmp_path, family):
    model = make_hf_model(family)
    model.save_pretrained(tmp_path / "model")
    return model, tmp_path / "model"


def random_batch(batch: int, seq: int, vocab: int, padded: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    labels = ids.clone()
    labels[:, : seq // 3] = -100
    mask = torch.ones(batch, seq, dtype=torch.long)
    if padded:
        for row in range(batch):
            length = int(torch.randint(seq // 2, seq + 1, (1,), generator=g))
            mask[row, length:] = 0
            labels[row, length:] = -100
        mask[0, :] = 1  # one full-length row
    return ids, labels, mask

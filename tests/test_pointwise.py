"""model/pointwise.py: the lean ops' elementwise parts compiled into fused kernels give the eager
results (fp32: float rounding; bf16: within bf16 rounding of fp32), and the executor trains with
them as HF autograd does. On the CPU, torch.compile runs TorchInductor's C++ backend: the same
graphs as the Triton kernels on a GPU, other code generated."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import make_hf_model, random_batch

from lazytrain.config import ConfigError, load_config
from lazytrain.memory.host_store import HostStore
from lazytrain.model import pointwise
from lazytrain.model.adapter import ModelAdapter, load_hf_config
from lazytrain.model.loading import load_safetensors
from lazytrain.model.pointwise import EAGER, FusedOpsError, compiled, select_pointwise
from lazytrain.plan.plan import LayerPlan, Plan
from lazytrain.runtime.executor import Executor

CPU = torch.device("cpu")


@pytest.fixture(autouse=True, scope="module")
def fresh_dynamo():
    """The compiled functions' caches start and end empty: the signatures this file compiles
    count toward dynamo's per-function recompile limit for the tests after it."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _inputs(rows: int, width: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    make = lambda: torch.randn(rows, width, generator=g).to(dtype)
    weight = (torch.rand(width, generator=g) + 0.5).to(dtype)
    return make, weight


def _calls(dtype: torch.dtype, rows: int):
    make, weight = _inputs(rows, 48, dtype)
    x = make().view(rows // 4, 4, 48)  # the layers' [batch, seq, hidden]
    _, rstd = pointwise.rms_norm(x, weight, 1e-6, False)
    _, rstd0 = pointwise.rms_norm(x, weight, 1e-6, True)
    heads = make().view(rows // 4, 4, 3, 16).transpose(1, 2)  # [batch, heads, seq, head_dim], strided as HF's
    angles = make()[: rows // 4 * 4].view(rows // 4, 1, 4, 48)
    cos, sin = angles[..., :16].cos(), angles[..., :16].sin()
    return {
        "swiglu": (make(), make()),
        "swiglu_backward": (make(), make(), make()),
        "rms_norm": (x, weight, 1e-6, False),
        "rms_norm_zero_centered": (x, weight, 1e-6, True),
        "rms_norm_backward": (make().view_as(x), x, weight, rstd, False),
        "rms_norm_backward_zero_centered": (make().view_as(x), x, weight, rstd0, True),
        "rotary": (heads, cos, sin),
        "rotary_partial": (heads, cos[..., :8], sin[..., :8]),  # Qwen3.5: a quarter rotated
        "rotary_backward": (heads.contiguous(), cos, sin),
        "rotary_backward_partial": (heads.contiguous(), cos[..., :8], sin[..., :8]),
    }


def _run(ops, name, args):
    out = getattr(ops, name.removesuffix("_zero_centered").removesuffix("_partial"))(*args)
    return out if isinstance(out, tuple) else (out,)


@pytest.mark.parametrize("rows", [32, 52])  # two lengths: one compilation (dynamic shapes) serves both
def test_compiled_functions_equal_eager_in_fp32(rows):
    for name, args in _calls(torch.float32, rows).items():
        for got, want in zip(_run(compiled(), name, args), _run(EAGER, name, args), strict=True):
            assert got.dtype == want.dtype and got.shape == want.shape, name
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)


DEVICES = [CPU, pytest.param(torch.device("cuda"), marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))]


def _to(args, device):
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)


@pytest.mark.parametrize("device", DEVICES, ids=["cpu", "cuda"])
def test_compiled_functions_in_bf16_stay_within_bf16_rounding_of_fp32(device):
    """On CUDA: TorchInductor's Triton kernels, what training on a GPU runs."""
    exact = _calls(torch.float32, 64)
    low = {name: _to(args, device) for name, args in _calls(torch.bfloat16, 64).items()}
    for name in exact:
        ref = _run(EAGER, name, exact[name])
        eager, fused = _run(EAGER, name, low[name]), _run(compiled(), name, low[name])
        eager, fused = [t.cpu() for t in eager], [t.cpu() for t in fused]
        for r, e, f in zip(ref, eager, fused, strict=True):
            assert f.dtype == e.dtype, name
            err_eager = float((e.float() - r).norm() / r.norm())
            err_fused = float((f.float() - r).norm() / r.norm())
            # one rounding at the end instead of one per operation: no further from fp32
            assert err_fused <= 1.5 * err_eager + 1e-3, (name, err_fused, err_eager)


@pytest.mark.parametrize("family", ["qwen2", "qwen3_5"])
def test_the_executor_with_compiled_ops_matches_hf_autograd(tmp_path, family):
    """Every lean op compiled (Qwen3.5: zero-centred norms, partial rotary), kept layers with an
    attention block recomputed in backward next to plain ones, padded."""
    model = make_hf_model(family, layers=4)
    model.save_pretrained(tmp_path / "model")
    adapter = ModelAdapter(load_hf_config(tmp_path / "model"), CPU, torch.float32, fused_ops="compiled")
    assert adapter.pointwise.kind == "compiled"
    assert {"mlp", "self_attn", "input_layernorm"} <= set(adapter.lean_ops["full_attention"])
    store = HostStore(adapter.layouts, torch.float32, pin=False)
    load_safetensors(adapter, store, tmp_path / "model")
    ids, labels, mask = random_batch(3, 13, adapter.vocab_size, padded=True)
    out = model(input_ids=ids, attention_mask=mask, labels=labels, position_ids=torch.arange(13).expand(3, -1))
    out.loss.backward()
    layers = [LayerPlan(mode="keep", tier="gpu", recompute="attention" if i % 2 else "none") for i in range(4)]
    plan = Plan(policy="x", batch_size=3, seq_len=13, layers=layers, head_chunk_tokens=5)
    stats = Executor(adapter, store, plan, CPU).forward_backward(ids, labels, mask)
    assert stats.loss == pytest.approx(out.loss.item(), rel=1e-5)
    for g, layout in enumerate(adapter.layouts):
        for p in layout.params:
            got = store.grads[g][p.offset:p.offset + p.numel].view(p.shape)
            want = dict(model.named_parameters())[layout.hf_prefix + p.name].grad
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=p.name)


def test_selection_by_device_and_setting(monkeypatch, caplog):
    assert select_pointwise(CPU) is EAGER  # auto: eager off CUDA
    assert select_pointwise(CPU, "eager") is EAGER
    fused = select_pointwise(CPU, "compiled")
    assert fused.kind == "compiled"
    # each function is torch.compile's wrapper of the eager one
    assert all(getattr(getattr(fused, name).compiled, "_torchdynamo_orig_callable", None) is fn
               for name, fn in pointwise.FUNCTIONS.items())
    with pytest.raises(FusedOpsError, match="model.fused_ops must be one of auto, compiled, eager, got 'fast'"):
        select_pointwise(CPU, "fast")
    # where compiling fails: auto falls back to eager and says so, compiled refuses
    monkeypatch.setitem(pointwise._PROBED, "cuda", "BackendCompilerFailed: no Triton")
    with caplog.at_level(logging.WARNING, logger="lazytrain.model.pointwise"):
        assert select_pointwise(torch.device("cuda"), "auto") is EAGER
    assert "no Triton" in caplog.text and "unfused" in caplog.text
    with pytest.raises(FusedOpsError, match="set model.fused_ops=eager"):
        select_pointwise(torch.device("cuda"), "compiled")


def test_a_failed_compile_is_caught_by_the_probe(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("inductor: no C++ compiler found")

    monkeypatch.setattr(pointwise.torch, "compile", broken)
    monkeypatch.delitem(pointwise._PROBED, "meta", raising=False)
    assert pointwise._compile_failure(torch.device("meta")) == "RuntimeError: inductor: no C++ compiler found"
    monkeypatch.delitem(pointwise._PROBED, "meta")


def test_past_the_recompile_limit_a_call_runs_eager_and_stays_right():
    """A run's calls past dynamo's limit of signatures per function (dtypes, ranks, strides) must
    not fail: with fullgraph, torch 2.11 raised FailOnRecompileLimitHit there (seen on the H200
    when one test process compiled fp32 and bf16 on the CPU and the GPU)."""
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=1):
        for dtype in (torch.float32, torch.float64, torch.bfloat16):
            gate, up = torch.randn(6, 5, dtype=dtype), torch.randn(6, 5, dtype=dtype)
            torch.testing.assert_close(compiled().swiglu(gate, up), pointwise.swiglu(gate, up))
    torch._dynamo.reset()


def test_one_graph_serves_the_norms_of_every_rank_length_and_coincidence():
    """The norms get rows detached from any view, and sizes are not duck-typed: the first call's
    token count equal to the width (a guard on that equality otherwise), other lengths, 3-D and
    4-D inputs (Qwen3's per-head norms, a view of a larger tensor) take one compiled graph."""
    from torch._dynamo.utils import counters

    from lazytrain.model.lean import LeanRMSNorm

    torch._dynamo.reset()
    counters.clear()
    weight = torch.rand(48) + 0.5
    inputs = [torch.randn(2, 24, 48), torch.randn(3, 5, 48), torch.randn(2, 3, 8, 48)[:, :, 2:6],
              torch.randn(7, 96).view(7, 2, 48)]
    with torch.no_grad():
        for x in inputs:
            got = LeanRMSNorm.apply(x, weight, 1e-6, False, compiled())
            torch.testing.assert_close(got, LeanRMSNorm.apply(x, weight, 1e-6, False, EAGER), rtol=1e-5, atol=1e-6)
    assert counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()


def test_the_setting_is_checked_in_the_config():
    assert load_config(overrides=["model.fused_ops=eager"]).model.fused_ops == "eager"
    with pytest.raises(ConfigError, match="fused_ops"):
        load_config(overrides=["model.fused_ops=fast"])

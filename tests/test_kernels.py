"""Gated-DeltaNet kernel choice: torch references on the CPU, fla-core on CUDA when importable,
one warning naming the install command when it is not."""

import sys
import types

import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from lazytrain.model import kernels
from lazytrain.model.kernels import KernelError, select_linear_attention_kernels

CUDA = torch.device("cuda")  # only the device type is read: nothing runs on it
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def back_to_cpu():
    yield
    select_linear_attention_kernels(CPU)


def test_cpu_binds_the_torch_references(caplog):
    with caplog.at_level("WARNING"):
        choice = select_linear_attention_kernels(CPU)
    assert (choice.delta_rule, choice.conv) == ("torch", "torch")
    # the reference itself, not transformers' wrapper (which would pick fla if installed)
    assert not hasattr(hf.torch_chunk_gated_delta_rule, "__wrapped__")
    assert not caplog.records


def test_cuda_without_fla_warns_once_with_the_install_command(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "fla", None)
    monkeypatch.setitem(sys.modules, "causal_conv1d", None)
    with caplog.at_level("WARNING", logger="lazytrain.model.kernels"):
        choice = select_linear_attention_kernels(CUDA)
        select_linear_attention_kernels(CUDA)
    assert choice.delta_rule == "torch"
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1
    assert "lazytrain[hybrid]" in warnings[0].getMessage() and "slower" in warnings[0].getMessage()


def test_cuda_with_fla_binds_its_kernels_and_torch_overrides(monkeypatch):
    def chunk(*args, **kwargs):
        return "fla chunk"

    def recurrent(*args, **kwargs):
        return "fla recurrent"

    ops = types.ModuleType("fla.ops.gated_delta_rule")
    ops.chunk_gated_delta_rule, ops.fused_recurrent_gated_delta_rule = chunk, recurrent
    for name, module in (("fla", types.ModuleType("fla")), ("fla.ops", types.ModuleType("fla.ops")),
                         ("fla.ops.gated_delta_rule", ops)):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(kernels, "_PROBED", {})
    monkeypatch.setattr(kernels, "_fla_failure", lambda delta, device: None)  # no GPU here to probe on
    assert select_linear_attention_kernels(CUDA).delta_rule == "fla"
    assert hf.torch_chunk_gated_delta_rule is chunk and hf.torch_recurrent_gated_delta_rule is recurrent
    assert select_linear_attention_kernels(CUDA, "torch").delta_rule == "torch"
    assert hf.torch_chunk_gated_delta_rule is not chunk
    with pytest.raises(KernelError, match="'auto' or 'torch'"):
        select_linear_attention_kernels(CUDA, "triton")
    monkeypatch.setattr(kernels, "_PROBED", {})  # a new process: probed again
    monkeypatch.setattr(kernels, "_fla_failure", lambda delta, device: "RuntimeError: Triton too old")
    assert select_linear_attention_kernels(CUDA).delta_rule == "torch"  # installed, failed its probe
    assert hf.torch_chunk_gated_delta_rule is not chunk


def test_a_kernel_without_kwargs_gets_only_its_arguments(monkeypatch):
    """causal-conv1d's functions take no **kwargs; transformers passes the layer's (use_cache)."""
    def conv(x, weight, bias=None, activation=None):
        return "conv", activation

    def update(x, conv_state, weight, bias=None, activation=None):
        return "update"

    module = types.ModuleType("causal_conv1d")
    module.causal_conv1d_fn, module.causal_conv1d_update = conv, update
    monkeypatch.setitem(sys.modules, "causal_conv1d", module)
    assert select_linear_attention_kernels(CUDA).conv == "causal-conv1d"
    assert hf.causal_conv1d_fn(1, 2, None, activation="silu", use_cache=True) == ("conv", "silu")


def test_a_kernel_that_fails_its_probe_is_not_used():
    """fla raises at run time for some Triton versions (seen on the H200): the start-up probe
    reports it (and the selection falls back to the torch reference) instead of a crash later."""
    import torch

    from lazytrain.model.kernels import _DELTA_RULE, _fla_failure

    def refuses(*args, **kwargs):
        raise RuntimeError("Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs produces incorrect results")

    def works(q, k, v, g, beta):
        return (q * k).sum(-1, keepdim=True) * v * beta[..., None] + g[..., None], None

    cpu = torch.device("cpu")
    assert "Triton >= 3.4.0" in _fla_failure({_DELTA_RULE[0]: refuses}, cpu)
    assert _fla_failure({_DELTA_RULE[0]: works}, cpu) is None

"""Gated-DeltaNet kernel choice: torch references on the CPU, fla-core on CUDA when importable,
one warning naming the install command when it is not."""

import sys
import types
from itertools import pairwise

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
    # the reference itself, not transformers' wrapper (which would pick fla if installed), under
    # LazyTrain's packed-rows wrapper
    reference = hf.torch_chunk_gated_delta_rule.__wrapped__
    assert reference.__name__ == "torch_chunk_gated_delta_rule" and not hasattr(reference, "__wrapped__")
    assert not hasattr(hf.causal_conv1d_fn.__wrapped__, "__wrapped__")
    assert not caplog.records


def test_cuda_without_fla_warns_once_with_the_install_command(monkeypatch, caplog):
    monkeypatch.setattr(kernels, "_CHOSEN", {})  # a new process: a CUDA test before may have chosen
    # where fla is installed, transformers has imported its submodules already: block them all
    for name in ["fla", "causal_conv1d", *(m for m in sys.modules if m.startswith(("fla.", "causal_conv1d.")))]:
        monkeypatch.setitem(sys.modules, name, None)
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
    assert hf.torch_chunk_gated_delta_rule.__wrapped__ is chunk and hf.torch_recurrent_gated_delta_rule is recurrent
    assert select_linear_attention_kernels(CUDA, "torch").delta_rule == "torch"
    assert hf.torch_chunk_gated_delta_rule.__wrapped__ is not chunk
    with pytest.raises(KernelError, match="'auto' or 'torch'"):
        select_linear_attention_kernels(CUDA, "triton")
    monkeypatch.setattr(kernels, "_PROBED", {})  # a new process: probed again
    monkeypatch.setattr(kernels, "_fla_failure", lambda delta, device: "RuntimeError: Triton too old")
    assert select_linear_attention_kernels(CUDA).delta_rule == "torch"  # installed, failed its probe
    assert hf.torch_chunk_gated_delta_rule.__wrapped__ is not chunk


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


def segments_of(boundaries: list[list[int]], length: int):
    """``seq_idx`` and ``cu_seq_lens_q`` (`packed_segments`) for rows split at ``boundaries``."""
    from lazytrain.model.adapter import packed_segments

    ids = torch.zeros(len(boundaries), length, dtype=torch.long)
    for row, cuts in enumerate(boundaries):
        for k, cut in enumerate(cuts):
            ids[row, cut:] = k + 1
    return packed_segments(ids)


def per_segment(fn, tensors: list[torch.Tensor], cu: torch.Tensor, dim: int) -> torch.Tensor:
    """``fn`` on each segment alone (the rows flattened along ``dim``), joined again."""
    flat = [t.movedim(dim, 1).reshape(1, -1, *t.movedim(dim, 1).shape[2:]) if t.dim() > 2 else t for t in tensors]
    parts = [fn(*[t[:, a:b].movedim(1, dim) for t in flat]) for a, b in pairwise(cu.tolist())]
    return torch.cat(parts, dim)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("activation", ["silu", None])
def test_the_packed_convolution_restarts_at_every_segment(bias, activation):
    """The short convolution of packed rows equals transformers' convolution run on each segment
    alone (samples of 1, 2, 3 and more tokens than the kernel width; rows of one segment)."""
    from lazytrain.model.kernels import document_causal_conv1d

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 13, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(5, 4, generator=g, dtype=torch.float64, requires_grad=True)
    shift = torch.randn(5, generator=g, dtype=torch.float64, requires_grad=True) if bias else None
    segments = segments_of([[0, 1, 3, 6, 12], [0], [0, 9, 10]], 13)
    got = document_causal_conv1d(x, weight, shift, activation, segments["seq_idx"], segments["cu_seq_lens_q"].numel() - 1)
    reference = kernels._TORCH_PATH["causal_conv1d_fn"]
    rows = x.transpose(0, 1).reshape(1, 5, -1)  # the rows end to end: [1, C, B*T]
    cu = segments["cu_seq_lens_q"].tolist()
    want = torch.cat([reference(rows[:, :, a:b], weight, shift, activation=activation) for a, b in pairwise(cu)],
                     2).view(5, 3, 13).transpose(0, 1)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # without the restart the rows' second sample would read the first's last tokens
    assert not torch.allclose(got, reference(x, weight, shift, activation=activation))
    leaves = [x, weight, *([shift] if bias else [])]
    grads = torch.autograd.grad(got.square().sum(), leaves)
    wants = torch.autograd.grad(want.square().sum(), leaves)
    for a, w in zip(grads, wants):
        torch.testing.assert_close(a, w, rtol=1e-12, atol=1e-12)


def test_the_packed_delta_rule_starts_every_segment_from_zero():
    """The chunked gated-delta rule on packed rows equals the reference on each segment alone,
    through the torch path (segments as zero-padded rows) and the variable-length path (here a
    stand-in that loops over ``cu_seqlens``, as fla's kernel computes), values and gradients."""
    from lazytrain.model.kernels import _delta_rule_by_document

    reference = kernels._TORCH_PATH["torch_chunk_gated_delta_rule"]
    g = torch.Generator().manual_seed(1)
    batch, length, heads, dim = 2, 70, 2, 4  # one segment longer than a 64-token chunk
    q, k, v = (torch.randn(batch, length, heads, dim, generator=g, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    decay = (-torch.rand(batch, length, heads, generator=g, dtype=torch.float64)).requires_grad_()
    beta = torch.rand(batch, length, heads, generator=g, dtype=torch.float64).requires_grad_()
    inputs = [q, k, v, decay, beta]
    segments = segments_of([[0, 5, 6, 40], [0, 66]], length)
    cu = segments["cu_seq_lens_q"]

    def alone(q, k, v, decay, beta):
        return reference(q, k, v, g=decay, beta=beta, use_qk_l2norm_in_kernel=True)[0]

    want = per_segment(alone, inputs, cu, 1).view(batch, length, heads, dim)
    wants = torch.autograd.grad(want.square().sum(), inputs)

    def varlen(q, k, v, g, beta, cu_seqlens, **kwargs):  # fla's contract: one row, offsets into it
        assert q.shape[0] == 1 and cu_seqlens is cu
        return per_segment(lambda *t: reference(*t[:3], g=t[3], beta=t[4], **kwargs)[0],
                           [q, k, v, g, beta], cu_seqlens, 1), None

    for rule in (_delta_rule_by_document(reference, varlen=False), _delta_rule_by_document(varlen, varlen=True)):
        got, state = rule(q, k, v, g=decay, beta=beta, use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
                          seq_idx=segments["seq_idx"])
        assert state is None
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
        grads = torch.autograd.grad(got.square().sum(), inputs)
        for a, w in zip(grads, wants):
            torch.testing.assert_close(a, w, rtol=1e-10, atol=1e-10)
    unpacked = alone(q, k, v, decay, beta)
    assert not torch.allclose(unpacked, want)  # the state would run on from one sample into the next
    with pytest.raises(KernelError, match="zero state"):
        _delta_rule_by_document(reference, varlen=False)(q, k, v, g=decay, beta=beta, cu_seqlens=cu,
                                                         output_final_state=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_packed_rows_through_fla_match_fla_on_each_segment_on_cuda():
    """On CUDA with fla-core: the bound rule on packed rows (fla's variable-length kernel over
    the flattened rows) against fla on each segment alone, bf16, values and gradients; and the
    packed convolution against the bound one per segment."""
    device = torch.device("cuda")
    if select_linear_attention_kernels(device).delta_rule != "fla":
        pytest.skip("fla-core is not installed or failed its probe here")
    rule, fla = hf.torch_chunk_gated_delta_rule, hf.torch_chunk_gated_delta_rule.__wrapped__
    g = torch.Generator(device).manual_seed(0)
    batch, length, heads, dim = 2, 320, 4, 64
    make = lambda *shape: torch.randn(*shape, generator=g, device=device, dtype=torch.bfloat16)
    q, k, v = (make(batch, length, heads, dim).requires_grad_() for _ in range(3))
    decay = (-torch.rand(batch, length, heads, generator=g, device=device)).requires_grad_()
    beta = torch.rand(batch, length, heads, generator=g, device=device, dtype=torch.bfloat16).requires_grad_()
    inputs = [q, k, v, decay, beta]
    segments = {name: t.to(device) for name, t in segments_of([[0, 37, 200, 201], [0, 64, 300]], length).items()}
    cu = segments["cu_seq_lens_q"]
    got, _ = rule(q, k, v, g=decay, beta=beta, use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
                  seq_idx=segments["seq_idx"])
    want = per_segment(lambda *t: fla(*t[:3], g=t[3], beta=t[4], use_qk_l2norm_in_kernel=True)[0], inputs, cu, 1)
    want = want.view(batch, length, heads, dim)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    grads = torch.autograd.grad(got.float().square().sum(), inputs)
    wants = torch.autograd.grad(want.float().square().sum(), inputs)
    for a, w in zip(grads, wants):
        torch.testing.assert_close(a.float(), w.float(), rtol=5e-2, atol=5e-2)
    x = make(batch, 96, length)
    weight = make(96, 4)
    conv = hf.causal_conv1d_fn
    packed = conv(x, weight, None, activation="silu", seq_idx=segments["seq_idx"], cu_seq_lens_q=cu)
    rows = x.transpose(0, 1).reshape(1, 96, -1)
    alone = torch.cat([conv(rows[:, :, a:b].contiguous(), weight, None, activation="silu")
                       for a, b in pairwise(cu.tolist())], 2)
    torch.testing.assert_close(packed, alone.view(96, batch, length).transpose(0, 1), rtol=2e-2, atol=2e-2)


def test_plain_function_sees_through_transformers_wrappers():
    """functools.wraps layers, and the `Func` module transformers 5.2x's hub-kernel decorator
    makes of a function (its forward closes over the function as ``func``)."""
    import functools

    import torch

    from lazytrain.model.hf_wrappers import plain_function

    def rule(q, k, cos, sin, unsqueeze_dim=1):
        return q

    def as_func_module(func):
        class Func(torch.nn.Module):
            def forward(self, *args, **kwargs):
                return func(*args, **kwargs)

        return Func()

    wrapped = functools.wraps(rule)(lambda *a, **k: rule(*a, **k))
    for fn in (rule, wrapped, as_func_module(rule), as_func_module(wrapped)):
        assert plain_function(fn) is rule
    assert isinstance(plain_function(torch.nn.Linear(1, 1)), torch.nn.Linear)  # no func: itself

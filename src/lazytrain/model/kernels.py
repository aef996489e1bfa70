"""Kernels of the Gated-DeltaNet (linear-attention) layers, chosen once at start-up.

transformers' Qwen3.5 layers call four module-level functions: the chunked gated-delta rule
(training, prefill), its one-token recurrent form (decoding), and the short causal convolution
and its one-token update. transformers binds them when it is imported, to ``fla`` /
``causal_conv1d`` if installed, else to readable torch references. LazyTrain decides per device
instead, and says what it chose:

- CUDA: fla-core's Triton kernels for the delta rule (``pip install 'lazytrain[hybrid]'``),
  the ``causal-conv1d`` CUDA kernels for the convolution where that wheel installed; each missing
  one falls back to the torch reference with one warning naming the install command and the cost.
- CPU: the torch references (fla's kernels are Triton, GPU only), which the parity tests check
  against HF autograd.

Packed rows (``data.packing``): the adapter passes each linear-attention layer the rows'
segments (``seq_idx``, ``cu_seq_lens_q``, ``cu_seqlens_cpu``: a segment is one sample, or a
row's padding), and the bound functions keep them apart: the short convolution restarts at each
segment start (`document_causal_conv1d`), and the delta rule starts each segment from a zero
state (fla: its variable-length kernel over the rows flattened into one sequence; the torch
reference: segments of similar length as the rows of zero-padded batches). transformers passes
these keyword arguments on from the layer to both functions in every version LazyTrain supports
(its own ``causal_conv1d_fn`` refuses them without the causal-conv1d package: these bindings
are what makes packing work).
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect
import logging
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lazytrain.errors import LazyTrainError
from lazytrain.model.hf_wrappers import plain_function

log = logging.getLogger(__name__)

INSTALL = "pip install 'lazytrain[hybrid]'  (fla-core; add causal-conv1d where its wheel builds)"
_DELTA_RULE = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")
_CONV = ("causal_conv1d_fn", "causal_conv1d_update")
_TORCH_PATH: dict[str, object] = {}
_CHOSEN: dict[str, str] = {}


class KernelError(LazyTrainError, ValueError):
    pass


@dataclass(frozen=True, slots=True)
class KernelChoice:
    delta_rule: str
    """``fla`` (fla-core Triton kernels) or ``torch`` (transformers' reference)."""
    conv: str
    """``causal-conv1d`` (CUDA kernels) or ``torch`` (a depthwise ``conv1d``)."""


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def _taking_only_its_arguments(impl):
    """``impl``, dropping keyword arguments it does not take (transformers passes the layer's
    extra kwargs, ``use_cache`` when generating, on to these functions, as its own wrappers
    filter them)."""
    params = inspect.signature(impl).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return impl

    @functools.wraps(impl)
    def call(*args, **kwargs):
        return impl(*args, **{k: v for k, v in kwargs.items() if k in params})

    return call


class _SpacedConv(torch.autograd.Function):
    """A depthwise causal ``conv1d`` of packed rows ``x`` [B, C, T] (in ``weight``'s dtype) that
    restarts at every segment: the rows laid end to end with K - 1 zeros before each segment (the
    zeros the unpacked convolution's padding reads), one ``conv1d`` over them, each token's
    output read back. Saves ``x`` itself, as the unpacked convolution does, and rebuilds the
    spaced copy in backward, so packing adds no saved bytes beyond the token positions."""

    @staticmethod
    def _spaced(x: torch.Tensor, place: torch.Tensor, length: int) -> torch.Tensor:
        flat = x.transpose(0, 1).reshape(x.shape[1], -1)
        return flat.new_zeros(x.shape[1], length).index_copy_(1, place, flat)[None]

    @staticmethod
    def forward(ctx, x, weight, bias, place, length):
        batch, channels, tokens = x.shape
        out = F.conv1d(_SpacedConv._spaced(x, place, length), weight.unsqueeze(1), bias, groups=channels)[0]
        # the window ending at a token's place starts K - 1 places before it
        ctx.save_for_backward(x, weight, place)
        ctx.length, ctx.has_bias = length, bias is not None
        return out.index_select(1, place - (weight.shape[-1] - 1)).view(channels, batch, tokens).transpose(0, 1)

    @staticmethod
    def backward(ctx, grad):
        x, weight, place = ctx.saved_tensors
        batch, channels, tokens = x.shape
        width = weight.shape[-1]
        grad_out = grad.new_zeros(1, channels, ctx.length - width + 1)
        grad_out[0].index_copy_(1, place - (width - 1), grad.transpose(0, 1).reshape(channels, -1))
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x, grad_w, grad_b = torch.ops.aten.convolution_backward(
            grad_out, _SpacedConv._spaced(x, place, ctx.length), weight.unsqueeze(1),
            [channels] if ctx.has_bias else None, [1], [0], [1], False, [0], channels,
            [need_x, need_w, need_b and ctx.has_bias])
        if grad_x is not None:
            grad_x = grad_x[0].index_select(1, place).view(channels, batch, tokens).transpose(0, 1)
        return grad_x, None if grad_w is None else grad_w.squeeze(1), grad_b, None, None


def document_causal_conv1d(hidden_states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           activation: str | None, seq_idx: torch.Tensor, segments: int) -> torch.Tensor:
    """The Gated-DeltaNet short convolution (depthwise, causal; ``hidden_states`` [B, C, T],
    ``weight`` [C, K]) restarted at each segment: no output reads an input of an earlier segment.

    ``seq_idx`` [B, T]: each token's segment, numbered 0.. over the rows in order (every row
    starts one); ``segments``: how many. As transformers' reference: computed in ``weight``'s
    dtype, the activation applied after, the result in the input's dtype.
    """
    from transformers.activations import ACT2FN

    width = weight.shape[-1]
    tokens = seq_idx.numel()
    # each token's place in the rows laid end to end, after the K - 1 zeros before its segment
    place = torch.arange(tokens, device=seq_idx.device) + (width - 1) * (seq_idx.reshape(-1) + 1)
    out = _SpacedConv.apply(hidden_states.to(weight.dtype), weight, bias, place, tokens + (width - 1) * segments)
    if activation is not None:
        out = ACT2FN[activation](out)
    return out.to(hidden_states.dtype)


def _conv_by_document(conv):
    """``conv`` (a ``causal_conv1d_fn``), or `document_causal_conv1d` for packed rows."""

    @functools.wraps(conv)
    def call(hidden_states, weight, bias=None, activation=None, seq_idx=None, cu_seq_lens_q=None,
             cu_seqlens_cpu=None, **kwargs):
        if seq_idx is None:
            return conv(hidden_states, weight, bias, activation=activation, **kwargs)
        return document_causal_conv1d(hidden_states, weight, bias, activation, seq_idx, cu_seq_lens_q.numel() - 1)

    return call


GROUP_SPREAD = 2
"""The torch reference runs packed segments in groups whose longest is at most this many times
their shortest (each group one zero-padded batch): at most about this much work and memory per
token, where one batch padded to the longest segment costs segments x longest."""


def _length_groups(cu_seqlens_cpu: torch.Tensor) -> list[list[int]]:
    """The segments (indices), shortest first, in groups of lengths within `GROUP_SPREAD`."""
    lengths = cu_seqlens_cpu.diff().tolist()
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        if groups and lengths[i] <= GROUP_SPREAD * max(1, lengths[groups[-1][0]]):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _rows(t: torch.Tensor, index: torch.Tensor, inside: torch.Tensor) -> torch.Tensor:
    """``t``'s tokens [tokens, ...] at ``index`` [rows, longest], zero where not ``inside``."""
    picked = t[index]
    return picked * inside.view(*inside.shape, *(1,) * (picked.dim() - 2)).to(picked.dtype)


def _delta_rule_by_document(rule, varlen: bool):
    """``rule`` (a chunked gated-delta rule) on packed rows: each segment of ``cu_seqlens``
    (offsets into the rows flattened, as fla takes them; ``cu_seqlens_cpu``: a CPU copy, so no
    step waits on the GPU for them) from a zero state. ``varlen``: ``rule`` takes ``cu_seqlens``
    itself (fla, one flattened row); otherwise segments of similar length (`_length_groups`) run
    as the rows of one batch each, zero-padded at their ends (causal: no real output changes)."""
    takes_cpu_offsets = "cu_seqlens_cpu" in inspect.signature(rule).parameters

    @functools.wraps(rule)
    def call(query, key, value, g, beta, cu_seqlens=None, seq_idx=None, cu_seqlens_cpu=None, **kwargs):
        if cu_seqlens is None:
            return rule(query, key, value, g=g, beta=beta, **kwargs)
        if kwargs.get("initial_state") is not None or kwargs.get("output_final_state"):
            raise KernelError("packed rows (data.packing) train from a zero state: no recurrent cache")
        batch, length = query.shape[:2]
        flat = [t.reshape(batch * length, *t.shape[2:]) for t in (query, key, value, g, beta)]
        if varlen:
            extra = {"cu_seqlens_cpu": cu_seqlens_cpu} if takes_cpu_offsets and cu_seqlens_cpu is not None else {}
            out, state = rule(*(t[None] for t in flat[:3]), g=flat[3][None], beta=flat[4][None],
                              cu_seqlens=cu_seqlens, **extra, **kwargs)
            return out.view(batch, length, *out.shape[2:]), state
        cpu = cu_seqlens.cpu() if cu_seqlens_cpu is None else cu_seqlens_cpu
        parts, order = [], []
        for group in _length_groups(cpu):
            starts, lengths = cpu[group], cpu[[i + 1 for i in group]] - cpu[group]
            steps = torch.arange(int(lengths.max()))
            inside = steps < lengths[:, None]  # [segments, longest]
            index = torch.where(inside, starts[:, None] + steps, 0)
            # index tensors made on the host and sent: a boolean mask on the GPU would wait for it
            on, gather, real = (t.to(query.device, non_blocking=True)
                                for t in (inside, index, inside.reshape(-1).nonzero().squeeze(1)))
            q, k, v, decay, b = (_rows(t, gather, on) for t in flat)
            out, _ = rule(q, k, v, g=decay, beta=b, **kwargs)
            parts.append(out.flatten(0, 1)[real])
            order.append(index[inside])
        # the groups' tokens back in the rows' order
        back = torch.cat(order).argsort().to(query.device, non_blocking=True)
        return torch.cat(parts)[back].view(batch, length, *parts[0].shape[1:]), None

    return call


def _fla() -> dict[str, object] | None:
    try:
        from fla.ops.gated_delta_rule import (
            chunk_gated_delta_rule,
            fused_recurrent_gated_delta_rule,
        )
    except Exception:  # noqa: BLE001 - any import failure (no package, no Triton) means no kernel
        return None
    return {_DELTA_RULE[0]: chunk_gated_delta_rule, _DELTA_RULE[1]: fused_recurrent_gated_delta_rule}


_PROBED: dict[str, str | None] = {}
"""Each device's probe result (None: fla's kernel trained there)."""


def _fla_failure(delta: dict[str, object], device: torch.device) -> str | None:
    """Why fla's chunked kernel cannot train on ``device`` (None: a tiny forward and backward ran).

    fla refuses some Triton versions at run time (on Hopper, Triton 3.4 to 3.7.0 give wrong
    gradients in one backward kernel and fla raises there): a probe at start-up turns that
    into the torch fallback and a warning, not a crash in the first backward.
    """
    try:
        b, t, h, d = 1, 64, 2, 64
        make = lambda *shape: torch.randn(*shape, device=device, dtype=torch.bfloat16, requires_grad=True)
        q, k, v = make(b, t, h, d), make(b, t, h, d), make(b, t, h, d)
        g = (-torch.rand(b, t, h, device=device)).requires_grad_()
        beta = torch.rand(b, t, h, device=device, dtype=torch.bfloat16).requires_grad_()
        out = delta[_DELTA_RULE[0]](q, k, v, g=g, beta=beta)
        (out[0] if isinstance(out, tuple) else out).float().sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as error:  # noqa: BLE001 - any failure of the kernel means: do not use it
        return f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
    return None


def _causal_conv1d() -> dict[str, object] | None:
    try:
        from causal_conv1d import causal_conv1d_fn, causal_conv1d_update
    except Exception:  # noqa: BLE001
        return None
    return {_CONV[0]: _taking_only_its_arguments(causal_conv1d_fn),
            _CONV[1]: _taking_only_its_arguments(causal_conv1d_update)}


SIBLING_MODULES = ("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",)
"""transformers modules whose Gated-DeltaNet layers call the same four functions as Qwen3.5's
(generated from it), bound to the same kernels."""


def _sibling_modules() -> list:
    found = []
    for name in SIBLING_MODULES:
        try:
            found.append(importlib.import_module(name))
        except ImportError:  # a transformers version without that family
            continue
    return found


def select_linear_attention_kernels(device: torch.device, prefer: str = "auto") -> KernelChoice:
    """Bind the Gated-DeltaNet kernels for ``device``: ``auto`` (the fast kernels on CUDA when
    installed, the torch references otherwise) or ``torch`` (the references everywhere)."""
    if prefer not in ("auto", "torch"):
        raise KernelError(f"linear-attention kernels must be 'auto' or 'torch', got {prefer!r}")
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    if not _TORCH_PATH:
        # the references under transformers' own wrappers (which pick fla when installed)
        _TORCH_PATH.update({name: plain_function(getattr(hf, name)) for name in _DELTA_RULE + _CONV})
    fast = device.type == "cuda" and prefer == "auto"
    delta = _fla() if fast else None
    if delta and str(device) not in _PROBED:  # once per device: a probe compiles fla's kernels
        log.info("Gated-DeltaNet: probing fla-core's chunked kernel on %s; its first calls compile Triton "
                 "(and TileLang) kernels, minutes on a machine without their caches (~/.triton), as does "
                 "the first training step's shapes", device)
        started = time.perf_counter()
        _PROBED[str(device)] = _fla_failure(delta, device)
        log.info("Gated-DeltaNet: fla-core probe done in %.1f s", time.perf_counter() - started)
    failure = _PROBED.get(str(device)) if delta else None
    if failure:
        delta = None
    conv = _causal_conv1d() if fast else None
    for names, impl in ((_DELTA_RULE, delta), (_CONV, conv)):
        for name in names:
            setattr(hf, name, impl[name] if impl else _TORCH_PATH[name])
    # packed rows: the chunked rule and the convolution keep each segment apart
    setattr(hf, _DELTA_RULE[0], _delta_rule_by_document(getattr(hf, _DELTA_RULE[0]), varlen=bool(delta)))
    setattr(hf, _CONV[0], _conv_by_document(getattr(hf, _CONV[0])))
    for module in _sibling_modules():  # the same layers in the MoE family: the same kernels
        for name in _DELTA_RULE + _CONV:
            setattr(module, name, getattr(hf, name))
    choice = KernelChoice(delta_rule="fla" if delta else "torch", conv="causal-conv1d" if conv else "torch")
    key = f"{device.type}:{prefer}"
    if _CHOSEN.get(key) != f"{choice}":
        _CHOSEN[key] = f"{choice}"
        delta_text = f"fla-core {_version('fla-core')} Triton" if delta else "torch reference"
        conv_text = f"causal-conv1d {_version('causal-conv1d')}" if conv else "torch conv1d"
        log.info("Gated-DeltaNet kernels on %s: gated-delta rule %s, short convolution %s",
                 device.type, delta_text, conv_text)
        if failure:
            log.warning(
                "Gated-DeltaNet layers run the torch reference of the chunked gated-delta rule on "
                "the GPU: fla-core %s is installed but its kernel failed a start-up probe (%s); "
                "upgrade Triton or fla-core as that message says (on Hopper with Triton < 3.7.1: "
                "pip install 'lazytrain[hybrid-hopper]', which adds tilelang). The reference is an order of "
                "magnitude or more slower in the linear-attention layers' token mixing.",
                _version("fla-core"), failure,
            )
        elif fast and not delta:
            log.warning(
                "Gated-DeltaNet layers run the torch reference of the chunked gated-delta rule on "
                "the GPU: fla-core is not importable. Install it with %s. The reference is an "
                "order of magnitude or more slower in the linear-attention layers' token mixing "
                "(transformers measures over 10x on an H100); plans profiled now price that in.",
                INSTALL,
            )
        elif fast and not conv:
            log.warning(
                "Gated-DeltaNet short convolution runs torch's depthwise conv1d on the GPU: "
                "causal-conv1d is not installed (pip install causal-conv1d, where its wheel "
                "builds). The cost is small: a width-4 convolution per linear-attention layer."
            )
    return choice

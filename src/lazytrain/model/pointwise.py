"""The elementwise parts of a decoder layer, eager or compiled into fused kernels.

A Qwen2.5-7B layer at 64 x 1024 tokens spends 45 of its 176 ms of GPU time outside matmuls and
attention (`bench/studies/layer_breakdown.py`, H200, 2026-12-03): RMSNorm in fp32 (casts, squares,
means and products, each a pass over the activations), SwiGLU's ``silu(gate) * up`` and its
backward, five passes over [tokens, intermediate] tensors. Each pass is memory-bound, so doing
the same arithmetic in one kernel per function saves most of that time. Rotary embedding of the
queries and keys (a concatenation, two products and a sum, forward and backward) is the rest.

The functions here are that arithmetic as plain torch code, the formulas of `lazytrain.model.
lean`'s autograd Functions, which call them through a `Pointwise` set:

- ``eager``: the functions as written, one kernel per operation (every device; the CPU default).
- ``compiled``: the same functions through ``torch.compile`` (TorchInductor: one fused Triton
  kernel per function on a GPU, C++ on the CPU), with dynamic shapes, so padded batches of any
  length reuse one compilation; the norms take rows ([tokens, width], whatever the caller's
  rank), so a layer's norms share one. Each function compiles on its first call in a process
  (seconds; the profiler's warm-up calls take it before anything is timed). Past dynamo's
  recompile limit (8 signatures per function) a call runs eager instead: slower, never wrong.

The compiled kernels keep intermediates in fp32 where eager rounds each operation to bf16, so
in bf16 they differ from eager by bf16 rounding (`tests/test_pointwise.py`), as any fused kernel
does; in fp32 they agree to float rounding.

`select_pointwise` chooses per device (``model.fused_ops``): ``auto`` compiles on CUDA when
TorchInductor works there (one tiny function compiled at start-up proves it; a failure falls back
to eager with a warning), eager elsewhere.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lazytrain.errors import LazyTrainError

log = logging.getLogger(__name__)

FUSED_OPS = ("auto", "compiled", "eager")


class FusedOpsError(LazyTrainError, ValueError):
    pass


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``."""
    return F.silu(gate) * up


def swiglu_backward(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor):
    """Given the gradient of ``silu(gate) * up``: (``silu(gate) * up`` again, for the down
    projection's weight gradient; the gradient of ``gate``; that of ``up``)."""
    act = F.silu(gate)
    return act * up, torch.ops.aten.silu_backward(grad * up, gate), grad * act


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool):
    """(the RMSNorm of ``x``, the per-row ``rsqrt`` in fp32): HF's Qwen2/Llama form
    ``weight * (x_fp32 * rstd).to(x.dtype)``, or with ``zero_centered`` Qwen3.5's
    ``(x_fp32 * rstd * (1 + weight_fp32)).to(x.dtype)``."""
    xf = x.to(torch.float32)
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if zero_centered:
        return (xf * rstd * (1.0 + weight.float())).to(x.dtype), rstd
    return weight * (xf * rstd).to(x.dtype), rstd


def rms_norm_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                      zero_centered: bool):
    """(the gradient of ``x``, that of ``weight``) of `rms_norm`, through autograd's own chain:
    ``normed = xf * rstd``, ``rstd = (mean(xf^2) + eps)^-1/2``."""
    xf = x.to(torch.float32)
    normed = xf * rstd
    rows = grad.reshape(-1, grad.shape[-1])
    if zero_centered:
        g = grad.float()
        grad_w = (g * normed).reshape(rows.shape).sum(0).to(weight.dtype)
        grad_normed = g * (1.0 + weight.float())
    else:
        grad_w = (grad * normed.to(x.dtype)).reshape(rows.shape).sum(0)
        grad_normed = (grad * weight).float()
    grad_rstd = (grad_normed * xf).sum(-1, keepdim=True)
    grad_var = -0.5 * grad_rstd * rstd.pow(3)
    grad_x = (grad_normed * rstd + grad_var * (2.0 / xf.shape[-1]) * xf).to(x.dtype)
    return grad_x, grad_w


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of ``x`` [..., head_dim] (HF's ``apply_rotary_pos_emb`` for one
    tensor, ``cos``/``sin`` already broadcastable): ``x * cos + rotate_half(x) * sin`` on the
    first ``cos.shape[-1]`` channels, the rest (Qwen3.5's partial rotary) passed through."""
    dim = cos.shape[-1]
    part = x[..., :dim]
    rotated = torch.cat((-part[..., dim // 2:], part[..., : dim // 2]), dim=-1)
    out = part * cos + rotated * sin
    return torch.cat((out, x[..., dim:]), dim=-1) if dim < x.shape[-1] else out


def rotary_backward(grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The gradient of `rotary`'s input: ``grad * cos + rotate_half^T(grad * sin)``, where
    ``rotate_half^T(y) = cat(y2, -y1)``."""
    dim = cos.shape[-1]
    part = grad[..., :dim]
    scaled = part * sin
    out = part * cos + torch.cat((scaled[..., dim // 2:], -scaled[..., : dim // 2]), dim=-1)
    return torch.cat((out, grad[..., dim:]), dim=-1) if dim < grad.shape[-1] else out


FUNCTIONS = {"swiglu": swiglu, "swiglu_backward": swiglu_backward, "rms_norm": rms_norm,
             "rms_norm_backward": rms_norm_backward, "rotary": rotary, "rotary_backward": rotary_backward}


@dataclass(frozen=True)
class Pointwise:
    """One way of running the elementwise functions: ``kind`` is ``eager`` or ``compiled``."""

    kind: str
    swiglu: Callable
    swiglu_backward: Callable
    rms_norm: Callable
    rms_norm_backward: Callable
    rotary: Callable
    rotary_backward: Callable


EAGER = Pointwise("eager", **FUNCTIONS)
_COMPILED: list[Pointwise] = []


def _compile(fn: Callable) -> Callable:
    """``fn`` under ``torch.compile`` with dynamic shapes and no duck sizing.

    Not fullgraph: past dynamo's recompile limit (8 input signatures of one function: dtypes,
    ranks, strides) a fullgraph function raises, in the middle of a run (torch 2.11, seen on the
    H200); this one runs eager. No duck sizing: by default two sizes that happen to be equal in
    a call (a batch's token count and the hidden size, say) are compiled as one symbol, guarded,
    and a later call where they differ compiles again; without it a function keeps one graph per
    dtype and layout (sizes 0 and 1 are still specialised)."""
    compiled_fn = torch.compile(fn, dynamic=True)
    try:  # a private module: where it or its setting is absent, duck sizing stays
        from torch.fx.experimental import _config as shape_config

        shapes = shape_config.patch if hasattr(shape_config, "use_duck_shape") else None
    except ImportError:
        shapes = None

    @functools.wraps(fn)
    def call(*args):
        if shapes is None:
            return compiled_fn(*args)
        with shapes(use_duck_shape=False):
            return compiled_fn(*args)

    call.compiled = compiled_fn
    return call


def compiled() -> Pointwise:
    """The functions under `_compile` (made once a process; each compiles on first use)."""
    if not _COMPILED:
        _COMPILED.append(Pointwise("compiled", **{name: _compile(fn) for name, fn in FUNCTIONS.items()}))
    return _COMPILED[0]


_PROBED: dict[str, str | None] = {}
"""Per device type, why compiling failed there (None: a tiny function compiled and ran)."""


def _compile_failure(device: torch.device) -> str | None:
    if device.type not in _PROBED:
        try:
            # a function of its own, so the probe takes none of the real functions' cache entries
            probe = torch.compile(lambda a, b: F.silu(a) * b, dynamic=True, fullgraph=True)
            x = torch.randn(4, 8, device=device)
            with torch.no_grad():
                torch.testing.assert_close(probe(x, x), swiglu(x, x))
            _PROBED[device.type] = None
        except Exception as error:  # noqa: BLE001 - any failure (no Triton, no C++ compiler) means eager
            text = str(error).strip().splitlines()
            _PROBED[device.type] = f"{type(error).__name__}: {text[0] if text else ''}"
    return _PROBED[device.type]


def select_pointwise(device: torch.device, prefer: str = "auto") -> Pointwise:
    """The elementwise functions for ``device`` (``model.fused_ops``): ``auto`` (compiled on CUDA
    where TorchInductor works, eager otherwise), ``compiled`` (anywhere; an error where it cannot
    compile), ``eager``."""
    if prefer not in FUSED_OPS:
        raise FusedOpsError(f"model.fused_ops must be one of {', '.join(FUSED_OPS)}, got {prefer!r}")
    if prefer == "eager" or (prefer == "auto" and device.type != "cuda"):
        return EAGER
    failure = _compile_failure(device)
    if failure is None:
        return compiled()
    if prefer == "compiled":
        raise FusedOpsError(f"model.fused_ops=compiled, but torch.compile cannot run on {device.type} here "
                            f"({failure}); set model.fused_ops=eager (or auto, which falls back to it)")
    log.warning("model.fused_ops=auto: torch.compile failed on %s (%s); the layers' norms, SwiGLU and rotary "
                "embedding run unfused (eager): a Qwen2.5-7B layer took 172 ms eager against 152 fused on an H200",
                device.type, failure)
    return EAGER

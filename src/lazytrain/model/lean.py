"""Memory-lean SwiGLU MLPs and RMSNorms: the same forward, fewer tensors saved for backward.

A decoder layer run under autograd saves every intermediate some backward formula reads. In a
SwiGLU MLP that is the gate and up projections' outputs, ``silu(gate)`` and their product: four
[tokens, intermediate] tensors, about two thirds of what a Qwen2.5-7B layer saves (150 of ~225
KB per token). An RMSNorm computed in fp32 saves an fp32 copy of its input and its normalised
output. The autograd Functions here save only what cannot be recomputed cheaply:

- SwiGLU: the input, ``gate`` and ``up`` (the matmul outputs); ``silu(gate)`` and the product
  are recomputed elementwise in backward (memory-bound work, a small fraction of the MLP's
  matmuls).
- RMSNorm: the input and the per-row ``rsqrt`` (one float per token); the normalised value is
  recomputed.

The forward runs the same operations in the same order as the HF modules it replaces, so
outputs are bit-identical; the backward follows autograd's own formulas (``silu_backward``, the
product rule, the RMSNorm chain through ``rsqrt`` and ``mean``), so gradients agree to rounding
(`tests/test_lean_ops.py`: fp32 to 1e-6, and the executor's parity tests against HF autograd
run with them). Plain torch operations: the same code on the CPU and on CUDA. The profiler
measures saved bytes through saved-tensor hooks, so the planner sees the smaller layers.

`apply_lean_ops` swaps the ``forward`` of the modules it recognises (by class, checked for the
formula's parts: SiLU activation, no biases) inside a layer template; anything else keeps HF's.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

SWIGLU_MLPS = frozenset({"Qwen2MLP", "Qwen3MLP", "LlamaMLP", "Qwen3_5MLP", "Qwen3_5TextMLP"})
"""HF MLP classes computing ``down(silu(gate(x)) * up(x))``."""
RMS_NORMS = frozenset({"Qwen2RMSNorm", "Qwen3RMSNorm", "LlamaRMSNorm"})
"""``weight * (x_fp32 * rsqrt(mean(x_fp32^2) + eps)).to(x.dtype)``."""
ZERO_CENTERED_NORMS = frozenset({"Qwen3_5RMSNorm", "Qwen3_5TextRMSNorm"})
"""``(x_fp32 * rsqrt(mean(x_fp32^2) + eps) * (1 + weight_fp32)).to(x.dtype)``."""


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


class LeanSwiGLU(torch.autograd.Function):
    """``down(silu(x @ gate.T) * (x @ up.T))``, saving x, gate and up outputs only."""

    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down):
        gate = F.linear(x, w_gate)
        up = F.linear(x, w_up)
        out = F.linear(F.silu(gate) * up, w_down)
        ctx.save_for_backward(x, w_gate, w_up, w_down, gate, up)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, w_gate, w_up, w_down, gate, up = ctx.saved_tensors
        act = F.silu(gate)
        grad_out2 = _rows(grad_out)
        grad_w_down = grad_out2.t().mm(_rows(act * up)) if ctx.needs_input_grad[3] else None
        grad_h = grad_out.matmul(w_down)
        grad_up = grad_h * act
        del act
        grad_gate = torch.ops.aten.silu_backward(grad_h * up, gate)
        del grad_h
        x2 = _rows(x)
        grad_w_gate = _rows(grad_gate).t().mm(x2) if ctx.needs_input_grad[1] else None
        grad_w_up = _rows(grad_up).t().mm(x2) if ctx.needs_input_grad[2] else None
        grad_x = grad_gate.matmul(w_gate) + grad_up.matmul(w_up) if ctx.needs_input_grad[0] else None
        return grad_x, grad_w_gate, grad_w_up, grad_w_down


class LeanRMSNorm(torch.autograd.Function):
    """RMSNorm saving its input and the per-row ``rsqrt`` only (``zero_centered``: the Qwen3.5
    form, scaling by ``1 + weight`` in fp32)."""

    @staticmethod
    def forward(ctx, x, weight, eps: float, zero_centered: bool):
        xf = x.to(torch.float32)
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        if zero_centered:
            out = (xf * rstd * (1.0 + weight.float())).type_as(x)
        else:
            out = weight * (xf * rstd).to(x.dtype)
        ctx.save_for_backward(x, weight, rstd)
        ctx.zero_centered = zero_centered
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, rstd = ctx.saved_tensors
        xf = x.to(torch.float32)
        normed = xf * rstd
        if ctx.zero_centered:
            g = grad_out.float()
            grad_w = (g * normed).sum_to_size(weight.shape).to(weight.dtype) if ctx.needs_input_grad[1] else None
            grad_normed = g * (1.0 + weight.float())
        else:
            grad_w = (grad_out * normed.to(x.dtype)).sum_to_size(weight.shape) if ctx.needs_input_grad[1] else None
            grad_normed = (grad_out * weight).float()
        grad_x = None
        if ctx.needs_input_grad[0]:
            # normed = xf * rstd, rstd = (mean(xf^2) + eps)^-1/2: d xf = rstd * (g - normed * mean(g * normed))
            grad_rstd = (grad_normed * xf).sum(-1, keepdim=True)
            grad_var = -0.5 * grad_rstd * rstd.pow(3)
            grad_x = (grad_normed * rstd + grad_var * (2.0 / xf.shape[-1]) * xf).to(x.dtype)
        return grad_x, grad_w, None, None


def _swiglu_forward(self, x):
    return LeanSwiGLU.apply(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)


def _norm_forward(self, x):
    return LeanRMSNorm.apply(x, self.weight, self._lean_eps, False)


def _zero_centered_norm_forward(self, x):
    return LeanRMSNorm.apply(x, self.weight, self._lean_eps, True)


def _is_swiglu(module: torch.nn.Module) -> bool:
    parts = [getattr(module, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    act = getattr(module, "act_fn", None)
    return (type(module).__name__ in SWIGLU_MLPS and all(isinstance(p, torch.nn.Linear) and p.bias is None for p in parts)
            and type(act).__name__ in ("SiLU", "SiLUActivation"))


def apply_lean_ops(template: torch.nn.Module) -> list[str]:
    """Swap in the lean forwards inside ``template``; the names of the modules swapped."""
    swapped = []
    for name, module in template.named_modules():
        kind = type(module).__name__
        if _is_swiglu(module):
            module.forward = types.MethodType(_swiglu_forward, module)
        elif kind in RMS_NORMS | ZERO_CENTERED_NORMS and isinstance(getattr(module, "weight", None), torch.Tensor):
            eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
            if eps is None:
                continue
            module._lean_eps = float(eps)
            forward = _zero_centered_norm_forward if kind in ZERO_CENTERED_NORMS else _norm_forward
            module.forward = types.MethodType(forward, module)
        else:
            continue
        swapped.append(name)
    return swapped

"""Memory-lean SwiGLU MLPs and RMSNorms (the same forward, fewer tensors saved for backward), and
the attention's rotary embedding, their elementwise parts eager or fused.

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
- Rotary embedding (`LeanRotary`, inside the attention modules of `ATTENTIONS`): ``cos`` and
  ``sin``, as autograd saves for HF's function; it is here so that its elementwise work fuses too.

The forward runs the same operations in the same order as the HF modules it replaces, so
outputs are bit-identical; the backward follows autograd's own formulas (``silu_backward``, the
product rule, the RMSNorm chain through ``rsqrt`` and ``mean``), so gradients agree to rounding
(`tests/test_lean_ops.py`: fp32 to 1e-6, and the executor's parity tests against HF autograd
run with them). Their elementwise parts are `lazytrain.model.pointwise`'s functions, run eager
(one kernel per operation, every device) or compiled into fused kernels (``model.fused_ops``;
by default on CUDA), which save the same tensors. The profiler measures saved bytes through
saved-tensor hooks, so the planner sees the smaller layers.

Two more bytes-for-time trades, for a layer run under saved-tensor hooks (the executor's kept
layers, the profiler's count of them):

- A norm's output (the q/k/v projections' or the MLP's input, which those matmuls save for their
  weight gradients) need not be stored: it is the norm of the input the norm saves already.
  Inside `recomputable_outputs` (`ModelAdapter.layer_forward` opens one per layer call) each
  lean norm's output is registered; `saved_recipe` tells a pack hook that a tensor it is given
  is such an output, and what recomputes it (`Recomputed`: once per backward, however many
  nodes read it). 14 KB per token of a Qwen2.5-7B layer (two [tokens, hidden] bf16 tensors: 121.0
  -> 106.6 KB saved), for two norm passes in backward. Without hooks nothing changes: autograd
  keeps the output.
- With `recomputing_mlp` (a kept layer's ``LayerPlan.recompute = "mlp_up"``) `LeanSwiGLU` saves
  the gate projection's output but not the up projection's, and recomputes that in backward
  (one [tokens, hidden] x [hidden, intermediate] matmul): 37.9 of the 106.6 KB per token at 7B,
  for 13.8 ms of a 150 ms layer forward + backward at 64 x 1024 tokens (H200, 2026-12-04). With
  ``"mlp"`` it saves neither and recomputes both (two matmuls), where a checkpoint of the whole
  block re-ran the down projection too: 43.1 ms for the same bytes on that run.

`apply_lean_ops` swaps the ``forward`` of the modules it recognises (by class, checked for the
formula's parts: SiLU activation, no biases) inside a layer template; anything else keeps HF's.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import types
import weakref
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lazytrain.model.hf_wrappers import plain_function
from lazytrain.model.pointwise import EAGER, Pointwise

SWIGLU_MLPS = frozenset({"Qwen2MLP", "Qwen3MLP", "LlamaMLP", "Qwen3_5MLP", "Qwen3_5TextMLP", "Qwen3MoeMLP",
                         "Qwen3_5MoeMLP"})
"""HF MLP classes computing ``down(silu(gate(x)) * up(x))``."""
RMS_NORMS = frozenset({"Qwen2RMSNorm", "Qwen3RMSNorm", "LlamaRMSNorm", "Qwen3MoeRMSNorm"})
"""``weight * (x_fp32 * rsqrt(mean(x_fp32^2) + eps)).to(x.dtype)``."""
ZERO_CENTERED_NORMS = frozenset({"Qwen3_5RMSNorm", "Qwen3_5TextRMSNorm", "Qwen3_5MoeRMSNorm"})
"""``(x_fp32 * rsqrt(mean(x_fp32^2) + eps) * (1 + weight_fp32)).to(x.dtype)``."""


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


class LeanSwiGLU(torch.autograd.Function):
    """``down(silu(x @ gate.T) * (x @ up.T))``, saving x, gate and up outputs only (the outputs
    named in ``recompute``, of ``"gate"`` and ``"up"``, not even those: recomputed in backward);
    the elementwise parts run through ``ops`` (`lazytrain.model.pointwise`: eager or fused)."""

    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, ops: Pointwise, recompute: tuple[str, ...] = ()):
        gate = F.linear(x, w_gate)
        up = F.linear(x, w_up)
        out = F.linear(ops.swiglu(gate, up), w_down)
        kept = [t for name, t in (("gate", gate), ("up", up)) if name not in recompute]
        ctx.save_for_backward(x, w_gate, w_up, w_down, *kept)
        ctx.ops, ctx.recompute = ops, recompute
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, w_gate, w_up, w_down, *kept = ctx.saved_tensors
        # a recomputed output is the forward's matmul again: the same values
        gate = F.linear(x, w_gate) if "gate" in ctx.recompute else kept.pop(0)
        up = F.linear(x, w_up) if "up" in ctx.recompute else kept.pop(0)
        del kept
        if ctx.ops.kind == "eager":
            # one kernel per operation: the product freed before grad_h exists, silu(gate) before
            # grad_gate (about 4.2 [tokens, intermediate] tensors at the peak instead of 5)
            act = F.silu(gate)
            grad_w_down = _rows(grad_out).t().mm(_rows(act * up)) if ctx.needs_input_grad[3] else None
            grad_h = grad_out.matmul(w_down)
            grad_up = grad_h * act
            del act
            grad_gate = torch.ops.aten.silu_backward(grad_h * up, gate)
        else:
            # fused: one kernel reads grad_h, gate and up once and writes all three results
            grad_h = grad_out.matmul(w_down)
            product, grad_gate, grad_up = ctx.ops.swiglu_backward(grad_h, gate, up)
            grad_w_down = _rows(grad_out).t().mm(_rows(product)) if ctx.needs_input_grad[3] else None
            del product
        del grad_h, up
        x2 = _rows(x)
        grad_w_gate = _rows(grad_gate).t().mm(x2) if ctx.needs_input_grad[1] else None
        grad_w_up = _rows(grad_up).t().mm(x2) if ctx.needs_input_grad[2] else None
        grad_x = grad_gate.matmul(w_gate) + grad_up.matmul(w_up) if ctx.needs_input_grad[0] else None
        return grad_x, grad_w_gate, grad_w_up, grad_w_down, None, None


class LeanRMSNorm(torch.autograd.Function):
    """RMSNorm saving its input and the per-row ``rsqrt`` only (``zero_centered``: the Qwen3.5
    form, scaling by ``1 + weight`` in fp32), through ``ops``."""

    @staticmethod
    def forward(ctx, x, weight, eps: float, zero_centered: bool, ops: Pointwise):
        # rows, detached from any view's base: one signature whatever the caller's rank and
        # layout (torch.compile guards on a view's base, and compiles once per signature)
        out, rstd = ops.rms_norm(_rows(x).detach(), weight, eps, zero_centered)
        ctx.save_for_backward(x, weight, rstd)
        ctx.zero_centered, ctx.ops = zero_centered, ops
        return out.reshape(x.shape)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, rstd = ctx.saved_tensors
        grad_x, grad_w = ctx.ops.rms_norm_backward(_rows(grad_out).detach(), _rows(x).detach(), weight, rstd,
                                                   ctx.zero_centered)
        return (grad_x.reshape(x.shape) if ctx.needs_input_grad[0] else None,
                grad_w if ctx.needs_input_grad[1] else None, None, None, None)


class LeanRotary(torch.autograd.Function):
    """HF's ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)`` through ``ops``: saves
    ``cos`` and ``sin`` only, as autograd does for HF's version (their products with constants)."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, unsqueeze_dim: int, ops: Pointwise):
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        ctx.save_for_backward(cos, sin)
        ctx.ops = ops
        return ops.rotary(q, cos, sin), ops.rotary(k, cos, sin)

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        cos, sin = ctx.saved_tensors
        return (ctx.ops.rotary_backward(grad_q, cos, sin) if ctx.needs_input_grad[0] else None,
                ctx.ops.rotary_backward(grad_k, cos, sin) if ctx.needs_input_grad[1] else None,
                None, None, None, None)


ROTARY_MODULES = ("modeling_qwen2", "modeling_qwen3", "modeling_llama", "modeling_qwen3_5", "modeling_qwen3_moe",
                  "modeling_qwen3_5_moe")
"""transformers modules whose ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)`` is the
formula of `pointwise.rotary` (Qwen3.5's with a partial rotary dimension)."""
ATTENTIONS = frozenset({"Qwen2Attention", "Qwen3Attention", "LlamaAttention", "Qwen3_5Attention", "Qwen3MoeAttention",
                        "Qwen3_5MoeAttention"})
"""HF attention classes calling their module's ``apply_rotary_pos_emb`` on the queries and keys."""
_ROTARY_OPS: contextvars.ContextVar[Pointwise | None] = contextvars.ContextVar("lazytrain_rotary", default=None)
"""The ``ops`` of the lean attention running now (None: HF's own rotary embedding)."""
ROTARY_PARAMETERS = ("q", "k", "cos", "sin", "unsqueeze_dim")
"""The signature of the ``apply_rotary_pos_emb`` `LeanRotary` replaces (any other: HF's kept)."""


def _bind_rotary(module) -> bool:
    """Make ``module.apply_rotary_pos_emb`` run `LeanRotary` inside a lean attention's call (HF's
    attention looks it up by name in its module) and HF's own function everywhere else; False
    (nothing bound) where the function takes other parameters than `ROTARY_PARAMETERS`."""
    if hasattr(module, "_lazytrain_hf_rotary"):
        return True
    hf = module.apply_rotary_pos_emb  # called as it is outside a lean attention (a `Func` module too)
    if tuple(inspect.signature(plain_function(hf)).parameters) != ROTARY_PARAMETERS:
        return False
    module._lazytrain_hf_rotary = hf

    @functools.wraps(plain_function(hf))
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        ops = _ROTARY_OPS.get()
        if ops is None or cos.requires_grad or sin.requires_grad:  # LeanRotary gives cos, sin no gradient
            return hf(q, k, cos, sin, unsqueeze_dim)
        return LeanRotary.apply(q, k, cos, sin, unsqueeze_dim, ops)

    module.apply_rotary_pos_emb = apply_rotary_pos_emb
    return True


def _lean_attention(attention: torch.nn.Module) -> bool:
    """Give ``attention`` (one of `ATTENTIONS`) a forward that runs its rotary embedding through
    `LeanRotary` with ``attention._lean_ops`` (whether its module's function is one LeanRotary
    computes)."""
    module = inspect.getmodule(type(attention))
    if module is None or module.__name__.rsplit(".", 1)[-1] not in ROTARY_MODULES \
            or not callable(getattr(module, "apply_rotary_pos_emb", None)) or not _bind_rotary(module):
        return False
    attention.forward = types.MethodType(_attention_forward, attention)
    return True


def _attention_forward(self, *args, **kwargs):
    token = _ROTARY_OPS.set(self._lean_ops)
    try:
        return type(self).forward(self, *args, **kwargs)
    finally:
        _ROTARY_OPS.reset(token)


# -- outputs recomputed instead of saved -----------------------------------------------------

MLP_PROJECTIONS = ("gate", "up")
"""The projections of a SwiGLU MLP whose outputs `recomputing_mlp` may recompute."""

_RECOMPUTE: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("lazytrain_recompute_mlp", default=())
"""Which projections' outputs the lean SwiGLU MLPs running now recompute in backward instead of
saving (`recomputing_mlp`)."""


@contextmanager
def recomputing_mlp(projections: tuple[str, ...]):
    """Within the block, the lean SwiGLU MLPs recompute the outputs of ``projections`` (of
    `MLP_PROJECTIONS`) in backward instead of saving them: ``("up",)`` for
    ``LayerPlan.recompute = "mlp_up"``, both for ``"mlp"`` (`sublayer.recomputing`)."""
    if not projections or set(projections) - set(MLP_PROJECTIONS):
        raise ValueError(f"projections must be some of {MLP_PROJECTIONS}, got {projections}")
    token = _RECOMPUTE.set(tuple(projections))
    try:
        yield
    finally:
        _RECOMPUTE.reset(token)


@dataclass(slots=True, eq=False)
class Recipe:
    """How to recompute a registered output: ``fn(*inputs)``, bit for bit (the same kernels on
    the same values). Compared by identity: one per output registered. A change made past
    autograd's version counter (through ``.data``) is not seen: nothing in a layer does that."""

    fn: Callable[..., torch.Tensor]
    inputs: tuple[torch.Tensor, ...]
    output: weakref.ref
    """The output as its callers got it (alive: its storage is not another tensor's)."""
    version: int
    """Its version counter when registered: changed in place since, it is not the norm's any more."""


_OUTPUTS: contextvars.ContextVar[dict[int, Recipe] | None] = contextvars.ContextVar(
    "lazytrain_recomputable", default=None)
"""The recomputable outputs of the layer call running now, by storage address (None: none kept)."""


@contextmanager
def recomputable_outputs():
    """Register the lean norms' outputs made within the block (under autograd) for
    `saved_recipe`; they are forgotten when it ends."""
    token = _OUTPUTS.set({})
    try:
        yield
    finally:
        _OUTPUTS.reset(token)


def _register(output: torch.Tensor, fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> None:
    """``output`` == ``fn(*inputs)`` (bit for bit: the same kernels on the same values), whole in
    its own storage."""
    outputs = _OUTPUTS.get()
    if outputs is None or not output.requires_grad or output.storage_offset() != 0 or not output.is_contiguous() \
            or output.untyped_storage().nbytes() != output.numel() * output.element_size():
        return
    key = output.untyped_storage().data_ptr()

    def forget(ref: weakref.ref) -> None:
        # the output is gone: so is the entry, and with it the inputs it held (a q/k norm's input
        # is the q/k projection's output, which a layer recomputing its attention would free)
        if key in outputs and outputs[key].output is ref:
            del outputs[key]

    outputs[key] = Recipe(fn, inputs, weakref.ref(output, forget), output._version)


def saved_recipe(t: torch.Tensor) -> Recipe | None:
    """For a tensor autograd saves (given to a pack hook): the `Recipe` of the registered output
    it views, unchanged since (the hook saves the recipe's inputs instead: `Recomputed`); None
    for anything else."""
    outputs = _OUTPUTS.get()
    if not outputs:
        return None
    recipe = outputs.get(t.untyped_storage().data_ptr())
    output = recipe.output() if recipe is not None else None
    if output is None or output._version != recipe.version or t._version != recipe.version or t.dtype != output.dtype \
            or t.is_neg() or t.is_conj():  # a lazy negation / conjugation is not in the storage
        return None
    return recipe


class Recomputed:
    """One recomputable storage as a pack hook keeps it: its inputs as the hook packed them, how
    many saved tensors view it (``reads``: the hook counts them), and the value while some are
    left to read: recomputed at the first `read` of a backward, dropped after the last."""

    __slots__ = ("fn", "inputs", "reads", "value")

    def __init__(self, fn: Callable[..., torch.Tensor], inputs: list):
        self.fn, self.inputs, self.reads, self.value = fn, inputs, 0, None

    def read(self, unpack: Callable[[object], torch.Tensor]) -> torch.Tensor:
        """The whole value (the caller views it as the saved tensor was); ``unpack`` turns the
        packed inputs back into tensors."""
        value = self.value
        if value is None:
            with torch.no_grad():
                value = self.fn(*(unpack(p) for p in self.inputs))
        self.reads -= 1
        self.value = value if self.reads > 0 else None
        return value


def recomputed_read(recipe: Recipe, states: dict, pack: Callable[[torch.Tensor], object]) -> Recomputed:
    """A pack hook's `Recomputed` for one more saved tensor viewing ``recipe``'s output: the one
    in ``states`` (the hook's, by recipe), or a new one there with the recipe's inputs packed by
    ``pack`` (the hook itself)."""
    state = states.get(recipe)
    if state is None:
        state = states[recipe] = Recomputed(recipe.fn, [pack(i) for i in recipe.inputs])
    state.reads += 1
    return state


def _norm_output(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool, ops: Pointwise):
    return ops.rms_norm(_rows(x).detach(), weight, eps, zero_centered)[0].reshape(x.shape)


def _swiglu_forward(self, x):
    return LeanSwiGLU.apply(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight, self._lean_ops,
                            _RECOMPUTE.get())


def _norm_forward(self, x, zero_centered: bool = False):
    out = LeanRMSNorm.apply(x, self.weight, self._lean_eps, zero_centered, self._lean_ops)
    _register(out, functools.partial(_norm_output, eps=self._lean_eps, zero_centered=zero_centered,
                                     ops=self._lean_ops), x, self.weight)
    return out


def _zero_centered_norm_forward(self, x):
    return _norm_forward(self, x, zero_centered=True)


def is_lean_swiglu(module: torch.nn.Module | None) -> bool:
    """Whether ``module`` runs `LeanSwiGLU` (`apply_lean_ops` swapped its forward): what
    `recomputing_mlp` acts on."""
    forward = module.__dict__.get("forward") if module is not None else None
    return getattr(forward, "__func__", None) is _swiglu_forward


def _is_swiglu(module: torch.nn.Module) -> bool:
    parts = [getattr(module, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    act = getattr(module, "act_fn", None)
    return (type(module).__name__ in SWIGLU_MLPS and all(isinstance(p, torch.nn.Linear) and p.bias is None for p in parts)
            and type(act).__name__ in ("SiLU", "SiLUActivation"))


def apply_lean_ops(template: torch.nn.Module, ops: Pointwise = EAGER) -> list[str]:
    """Swap in the lean forwards inside ``template``, their elementwise parts run by ``ops``;
    the names of the modules swapped."""
    swapped = []
    for name, module in template.named_modules():
        kind = type(module).__name__
        if _is_swiglu(module) or kind in RMS_NORMS | ZERO_CENTERED_NORMS | ATTENTIONS:
            module._lean_ops = ops
        if kind in ATTENTIONS:
            if not _lean_attention(module):
                continue
        elif _is_swiglu(module):
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

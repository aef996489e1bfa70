"""Mixture-of-experts layers: routing, the experts' compute and the router's load-balancing loss.

transformers 5 keeps a layer's experts stacked (``mlp.experts.gate_up_proj`` [E, 2I, H], gate
rows first, and ``mlp.experts.down_proj`` [E, H, I]): two tensors of the layer's flat buffer,
streamed with the rest of the layer every step. `moe_forward` replaces the forward of the HF
sparse-MoE blocks (`MOE_BLOCKS`) in the layer templates with the same arithmetic:

- the router: ``softmax(x @ W_r^T)`` in fp32, top-k, the top-k weights renormalised where the
  family does (Qwen3-MoE's ``norm_topk_prob``, always in Qwen3.5-MoE), cast to the compute dtype;
- the experts (`experts_forward`): the (token, slot) pairs sorted by expert once per layer, the
  tokens gathered in that order, the up/gate and down projections as grouped GEMMs over the
  experts' runs (``torch._grouped_mm``) or a loop over the experts (`select_experts_kernel`),
  each row scaled by its routing weight, and the k rows of each token summed back in token
  order (a gather, not an atomic scatter: the same bits in a recompute). An expert no token
  reached does no work, and its gradient is zero;
- the shared expert, where the family has one (Qwen3.5-MoE), gated by ``sigmoid(x @ w_g^T)``.

Load-balancing loss (HF's ``load_balancing_loss_func``, added as ``router_aux_loss_coef * aux``
where the config's ``output_router_logits`` is true): over the M MoE layers and the T real rows
(padding excluded, weights ``w_t``),

    aux = E * sum_e fbar_e * Pbar_e,  fbar_e = C_e / R,  Pbar_e = (1 / R) sum_l sum_t w_t p_lte,

with ``C_e`` the top-k selections of expert e (weighted by ``w_t``) over all layers and
``R = M * sum_t w_t``. ``fbar`` comes from top-k (no gradient) and couples every layer: it is
known only after the last layer's forward. But every layer's backward runs after that, and the
gradient with respect to layer l's router probabilities is

    d aux / d p_lte = E * fbar_e * w_t / R,

a constant of the step. `Routing` collects ``C`` and ``sum w p`` during the step's forward (not
in recomputes), turns them into the loss term and that constant once the forward is over
(`Routing.end_forward`), and an identity node on each layer's router probabilities
(`_AuxGradient`) adds ``coef`` times it to their gradient in the layer's backward, whenever
that runs (a kept layer's saved graph, a checkpoint's re-run). It saves nothing: the softmax's
backward, which turns it into the router logits' gradient, saves its own output anyway.
"""

from __future__ import annotations

import logging
import types

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

MOE_BLOCKS = frozenset({"Qwen3MoeSparseMoeBlock", "Qwen3_5MoeSparseMoeBlock"})
"""HF sparse-MoE blocks: a top-k softmax router (``gate``), stacked experts (``experts``) and,
in Qwen3.5-MoE, a sigmoid-gated shared expert (``shared_expert``, ``shared_expert_gate``)."""
EXPERTS_KERNELS = ("grouped_mm", "loop")
GROUPED_MM_ALIGNMENT = 16
"""Bytes ``torch._grouped_mm`` needs its operands' addresses aligned to."""
_CHOSEN: set[str] = set()


EXPERT_TENSORS = ("experts.gate_up_proj", "experts.down_proj")
"""The stacked expert tensors (names end so inside a layer's group)."""


def expert_pieces(
    name: str, shape: tuple[int, ...]
) -> list[tuple[str, int, tuple[int, ...]]] | None:
    """How a stacked expert tensor ``name`` (of `EXPERT_TENSORS`) is written in HF checkpoint files,
    which hold one tensor per expert and projection (what ``save_pretrained`` writes, and the
    published Qwen3-MoE checkpoints): (file name, first element in the stacked tensor, shape)
    for each, in order; None for any other tensor. ``gate_up_proj[e]`` is expert e's
    ``gate_proj.weight`` rows, then its ``up_proj.weight`` rows; ``down_proj[e]`` its
    ``down_proj.weight``."""
    if not name.endswith(EXPERT_TENSORS) or len(shape) != 3:
        return None
    base = (
        name[: -len("gate_up_proj")] if name.endswith("gate_up_proj") else name[: -len("down_proj")]
    )
    experts, rows, cols = shape
    if name.endswith("down_proj"):
        return [
            (f"{base}{e}.down_proj.weight", e * rows * cols, (rows, cols)) for e in range(experts)
        ]
    half = rows // 2
    return [
        (f"{base}{e}.{proj}_proj.weight", e * rows * cols + k * half * cols, (half, cols))
        for e in range(experts)
        for k, proj in enumerate(("gate", "up"))
    ]


def select_experts_kernel(
    device: torch.device, dtype: torch.dtype, offsets_bytes: list[int]
) -> str:
    """How the experts run on ``device``: ``grouped_mm`` (``torch._grouped_mm``: CUDA, bf16,
    compute capability 9.0 or more, and every stacked expert tensor at ``offsets_bytes`` of its
    layer's flat buffer aligned to `GROUPED_MM_ALIGNMENT`), else ``loop`` (one pair of matmuls
    per expert with tokens; it reads the experts' token counts on the host, once per layer)."""
    why = None
    if device.type != "cuda":
        why = f"{device.type} device"
    elif not hasattr(torch, "_grouped_mm"):
        why = f"torch {torch.__version__} has no torch._grouped_mm"
    elif dtype != torch.bfloat16:
        why = f"{dtype} (grouped GEMMs take bf16)"
    elif torch.cuda.get_device_capability(device) < (9, 0):
        why = f"compute capability {torch.cuda.get_device_capability(device)} < (9, 0)"
    elif any(offset % GROUPED_MM_ALIGNMENT for offset in offsets_bytes):
        why = (
            f"stacked expert tensors not {GROUPED_MM_ALIGNMENT}-byte aligned in the layer's buffer"
        )
    kernel = "loop" if why else "grouped_mm"
    key = f"{device}:{dtype}:{kernel}"
    if key not in _CHOSEN:
        _CHOSEN.add(key)
        log.info(
            "mixture-of-experts layers on %s: %s",
            device,
            "grouped GEMMs (torch._grouped_mm)"
            if why is None
            else f"a loop over the experts ({why})",
        )
    return kernel


def experts_forward(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    indices: torch.Tensor,
    weights: torch.Tensor,
    act,
    kernel: str,
) -> torch.Tensor:
    """``sum_j weights[t, j] * down_e(act(gate_e(x_t)) * up_e(x_t))`` over the experts
    ``e = indices[t, j]`` of each token: ``x`` [T, H], ``gate_up`` [E, 2I, H] (gate rows first),
    ``down`` [E, H, I], ``indices`` and ``weights`` [T, k]; ``kernel`` of `EXPERTS_KERNELS`."""
    tokens, top_k = indices.shape
    num_experts = gate_up.shape[0]
    # the (token, slot) pairs grouped by expert, in token order within each: tokens permuted once
    experts, order = torch.sort(indices.reshape(-1), stable=True)
    ends = torch.searchsorted(
        experts, torch.arange(1, num_experts + 1, device=x.device, dtype=experts.dtype)
    )
    rows = x[order // top_k]
    if kernel == "grouped_mm":
        offsets = ends.to(torch.int32)
        gate, up = torch._grouped_mm(rows, gate_up.transpose(1, 2), offs=offsets).chunk(2, dim=-1)
        out = torch._grouped_mm(act(gate) * up, down.transpose(1, 2), offs=offsets)
    elif kernel == "loop":
        bounds = [0, *ends.tolist()]
        parts = []
        for e in range(num_experts):
            a, b = bounds[e], bounds[e + 1]
            if a < b:  # an expert without tokens does nothing (its weights' gradient stays zero)
                gate, up = F.linear(rows[a:b], gate_up[e]).chunk(2, dim=-1)
                parts.append(F.linear(act(gate) * up, down[e]))
        out = torch.cat(parts) if parts else rows.new_zeros(0, down.shape[1])
    else:
        raise ValueError(f"experts kernel must be one of {EXPERTS_KERNELS}, got {kernel!r}")
    out = out * weights.reshape(-1)[order, None]
    # back to token order, each token's k rows summed (a gather: deterministic, unlike a scatter-add)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return out[inverse].view(tokens, top_k, -1).sum(dim=1)


class _AuxGradient(torch.autograd.Function):
    """The identity on a layer's router probabilities; its backward adds the load-balancing
    loss's gradient with respect to them (`Routing.probs_grad`), known by then."""

    @staticmethod
    def forward(ctx, probs: torch.Tensor, routing: Routing) -> torch.Tensor:
        ctx.routing = routing
        return probs.view_as(probs)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.routing.probs_grad(grad), None


class Routing:
    """The experts' kernel, and the load-balancing loss of one step at a time (see the module's
    docstring): `start`, the forward's layers `observe` their routing, `end_forward` gives the
    loss term, the backwards read `probs_grad`, `end` lets go."""

    def __init__(self, num_experts: int, top_k: int, aux_coef: float | None, kernel: str):
        self.num_experts = num_experts
        self.top_k = top_k
        self.aux_coef = aux_coef
        """``router_aux_loss_coef`` where the config asks for the loss (``output_router_logits``),
        else None: no loss term, no gradient added."""
        self.kernel = kernel
        """How the experts run (`select_experts_kernel`)."""
        self.active = False
        self.collecting = False
        self._weights: torch.Tensor | None = None
        self._sums: torch.Tensor | None = None
        self._scale: torch.Tensor | None = None

    def start(self, row_weights: torch.Tensor | None, device: torch.device) -> None:
        """A step begins: its rows' weights (the flat padding mask, 1 on real tokens; None: all
        real) and zeroed sums; the layers' forwards from now on are observed."""
        if self.aux_coef is None:
            return
        self.active = self.collecting = True
        self._weights = (
            None
            if row_weights is None
            else row_weights.reshape(-1).to(device, torch.float32, non_blocking=True)
        )
        # [counts C_e | probability sums | rows R]
        self._sums = torch.zeros(2 * self.num_experts + 1, dtype=torch.float32, device=device)
        self._scale = None

    def route(self, probs: torch.Tensor) -> torch.Tensor:
        """A layer's router probabilities [T, E], through the node that adds the loss's gradient
        in backward while a step is on."""
        return _AuxGradient.apply(probs, self) if self.active and torch.is_grad_enabled() else probs

    def observe(self, probs: torch.Tensor, indices: torch.Tensor) -> None:
        """Count one layer's top-k choices and sum its probabilities (the step's forward only)."""
        if not self.collecting:
            return
        with torch.no_grad():
            e = self.num_experts
            w = self._weights
            if w is None:
                ones = torch.ones(indices.numel(), dtype=torch.float32, device=probs.device)
                self._sums[:e].scatter_add_(0, indices.reshape(-1), ones)
                self._sums[e : 2 * e] += probs.float().sum(0)
                self._sums[-1] += probs.shape[0]
            else:
                self._sums[:e].scatter_add_(
                    0, indices.reshape(-1), w.repeat_interleave(indices.shape[1])
                )
                self._sums[e : 2 * e] += (probs.float() * w[:, None]).sum(0)
                self._sums[-1] += w.sum()

    def end_forward(self, all_reduce=None) -> torch.Tensor | None:
        """The forward is over: the loss term ``coef * aux`` (a device scalar; None without the
        loss), and the gradient the backwards add. ``all_reduce`` sums the counts over
        data-parallel ranks in place (the global batch's loss)."""
        if not self.active:
            return None
        self.collecting = False
        sums = self._sums
        if all_reduce is not None:
            sums = all_reduce(sums)
        e = self.num_experts
        fraction = sums[:e] / sums[-1]
        aux = e * (fraction * (sums[e : 2 * e] / sums[-1])).sum()
        self._scale = (self.aux_coef * e / sums[-1]) * fraction
        return self.aux_coef * aux

    def probs_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """``grad`` (of one layer's router probabilities) plus the loss term's gradient."""
        if self._scale is None:  # a backward outside a step's (nothing to add)
            return grad
        added = self._scale[None, :].expand_as(grad)
        if self._weights is not None:
            added = added * self._weights[:, None]
        return grad + added

    def end(self) -> None:
        """The step is over (or abandoned)."""
        self.active = self.collecting = False
        self._weights = self._sums = self._scale = None


def moe_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """The forward of a `MOE_BLOCKS` block (installed by `apply_moe`), its weights as the
    layer's ``functional_call`` supplies them."""
    routing: Routing = self._lazytrain_routing
    batch, seq, hidden = hidden_states.shape
    x = hidden_states.reshape(-1, hidden)
    logits = F.linear(x, self.gate.weight)
    probs = routing.route(F.softmax(logits, dim=-1, dtype=torch.float32))
    top, indices = torch.topk(probs, routing.top_k, dim=-1)
    routing.observe(probs, indices)
    if getattr(self.gate, "norm_topk_prob", True):
        top = top / top.sum(dim=-1, keepdim=True)
    experts = self.experts
    out = experts_forward(
        x,
        experts.gate_up_proj,
        experts.down_proj,
        indices,
        top.to(logits.dtype),
        experts.act_fn,
        routing.kernel,
    )
    if hasattr(self, "shared_expert"):
        out = out + F.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
    return out.view(batch, seq, hidden)


def apply_moe(template: torch.nn.Module, routing: Routing) -> list[str]:
    """Give the `MOE_BLOCKS` inside ``template`` `moe_forward`, with ``routing``; their names."""
    swapped = []
    for name, module in template.named_modules():
        if type(module).__name__ in MOE_BLOCKS:
            module._lazytrain_routing = routing
            module.forward = types.MethodType(moe_forward, module)
            swapped.append(name)
    return swapped

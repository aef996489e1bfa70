"""FLOPs per step, measured the same way everywhere (DESIGN.md section 6).

A mixture-of-experts layer computes with a fraction of its parameters: each token goes
through the router, its ``top_k`` experts and the shared expert (with its gate), not through
all ``num_experts``. The model FLOPs count those, the active parameters (`MoeShape`,
`active_nonembedding_params`); ``6NT`` keeps counting every parameter, as other trainers quote
it, and `flops_active` is 6 * N_active * tokens beside it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import transformers

    from lazytrain.model.adapter import ModelAdapter


@dataclass(frozen=True, slots=True)
class MoeShape:
    """The mixture-of-experts MLPs of a model, as its HF config sets them (`moe_shape`)."""

    num_experts: int
    top_k: int
    """Experts each token is routed to (``num_experts_per_tok``)."""
    hidden: int
    expert_intermediate: int
    """Each expert's SwiGLU width (``moe_intermediate_size``)."""
    shared_intermediate: int
    """The shared expert's width (``shared_expert_intermediate_size``; 0: none)."""
    moe_layers: tuple[bool, ...]
    """Per decoder layer, whether its MLP is the mixture of experts (else a dense MLP)."""

    @property
    def expert_params(self) -> int:
        """One expert's: gate, up and down projections."""
        return 3 * self.hidden * self.expert_intermediate

    @property
    def router_params(self) -> int:
        return self.num_experts * self.hidden

    @property
    def shared_params(self) -> int:
        """The shared expert's and its sigmoid gate's (one output)."""
        return (
            3 * self.hidden * self.shared_intermediate + self.hidden
            if self.shared_intermediate
            else 0
        )

    @property
    def active_mlp_params(self) -> int:
        """An MoE MLP's parameters one token computes with: router + top_k experts + shared
        expert and its gate."""
        return self.router_params + self.top_k * self.expert_params + self.shared_params

    @property
    def inactive_params(self) -> int:
        """An MoE MLP's parameters one token does not compute with: the other experts."""
        return (self.num_experts - self.top_k) * self.expert_params


def moe_shape(config: transformers.PretrainedConfig) -> MoeShape | None:
    """The MoE MLPs of the language model ``config`` describes (a ConditionalGeneration's text
    config is read), or None for a dense model. A layer's MLP is MoE as HF builds it: Qwen3-MoE's
    unless its index is in ``mlp_only_layers`` or ``(index + 1) % decoder_sparse_step != 0``;
    every layer of a Qwen3.5-MoE (whose config has neither key)."""
    text = config.get_text_config()
    experts = getattr(text, "num_experts", None) or 0
    if not experts:
        return None
    top_k = text.num_experts_per_tok
    if not 1 <= top_k <= experts:
        raise ValueError(
            f"num_experts_per_tok={top_k} must be between 1 and num_experts={experts}; fix config.json"
        )
    dense = set(getattr(text, "mlp_only_layers", None) or ())
    step = getattr(text, "decoder_sparse_step", None) or 1
    layers = tuple(i not in dense and (i + 1) % step == 0 for i in range(text.num_hidden_layers))
    return MoeShape(
        num_experts=experts,
        top_k=top_k,
        hidden=text.hidden_size,
        expert_intermediate=text.moe_intermediate_size,
        shared_intermediate=getattr(text, "shared_expert_intermediate_size", None) or 0,
        moe_layers=layers,
    )


def active_nonembedding_params(adapter: ModelAdapter) -> int:
    """N_active: the parameters of the TFLOPS formula (all but the input embedding, unless tied)
    that one token computes with: every MoE layer's attention or linear attention, router,
    ``top_k`` experts and shared expert with its gate, not its other experts. A dense model's
    is `ModelAdapter.num_nonembedding_params`."""
    moe = moe_shape(adapter.config)
    n = adapter.num_nonembedding_params()
    return n - sum(moe.moe_layers) * moe.inactive_params if moe else n


def token_mixing_flops_per_token(adapter: ModelAdapter, kind: str, seq_len: int) -> float:
    """Forward + backward FLOPs per token of one layer's token mixing beyond its matmuls with
    parameters (those are in 6 N).

    ``full_attention``: 12 d_attn seq (QK^T and AV, 2 * 2 * d_attn * seq forward, times 3 for
    forward + backward, causality not halved: torchtitan/PaLM). ``linear_attention`` (the
    gated delta rule): per value head a d_k x d_v state; per token the update
    S <- g S + beta (v - S k) k^T is 4 d_k d_v and the output S q 2 d_k d_v, so 6 H_v d_k d_v
    forward and 18 H_v d_k d_v with the backward (the recurrent form's count: the chunked
    kernels do more work for the same result, as attention kernels do).
    """
    config = adapter.config
    if kind == "linear_attention":
        return (
            18.0
            * config.linear_num_value_heads
            * config.linear_key_head_dim
            * config.linear_value_head_dim
        )
    return 12.0 * adapter.attention_dim() * seq_len


def model_flops(adapter: ModelAdapter, tokens: int, seq_len: int) -> float:
    """(6 N_active_nonembedding + sum over layers of their token mixing) * tokens: recompute not
    counted, LM head in N, an MoE layer's active parameters only (`active_nonembedding_params`;
    a dense model's are all); for attention-only stacks 6 N + 12 L d_attn seq."""
    n = active_nonembedding_params(adapter)
    mixing = sum(
        token_mixing_flops_per_token(adapter, kind, seq_len) for kind in adapter.layer_types
    )
    return float(6 * n + mixing) * tokens


def flops_6nt(adapter: ModelAdapter, tokens: int) -> float:
    """6 * all parameters * tokens (the figure most trainers quote; every expert of an MoE)."""
    return 6.0 * adapter.num_params() * tokens


def flops_active(adapter: ModelAdapter, tokens: int) -> float:
    """6 * N_active * tokens: `flops_6nt` with an MoE's active parameters (the input embedding
    included, as in 6NT; for a dense model the same as `flops_6nt`)."""
    moe = moe_shape(adapter.config)
    inactive = sum(moe.moe_layers) * moe.inactive_params if moe else 0
    return 6.0 * (adapter.num_params() - inactive) * tokens


def moe_flops(adapter: ModelAdapter, tokens: int) -> dict[str, float]:
    """The figures a mixture-of-experts model's records add: ``active`` (`flops_active`); a
    dense model's add none."""
    return {"active": flops_active(adapter, tokens)} if moe_shape(adapter.config) else {}

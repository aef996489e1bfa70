"""FLOPs per step, measured the same way everywhere (DESIGN.md section 6)."""

from __future__ import annotations

from lazytrain.model.adapter import ModelAdapter


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
        return 18.0 * config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim
    return 12.0 * adapter.attention_dim() * seq_len


def model_flops(adapter: ModelAdapter, tokens: int, seq_len: int) -> float:
    """(6 N_nonembedding + sum over layers of their token mixing) * tokens: recompute not
    counted, LM head in N; for attention-only stacks 6 N + 12 L d_attn seq."""
    n = adapter.num_nonembedding_params()
    mixing = sum(token_mixing_flops_per_token(adapter, kind, seq_len) for kind in adapter.layer_types)
    return float(6 * n + mixing) * tokens


def flops_6nt(adapter: ModelAdapter, tokens: int) -> float:
    """6 * all parameters * tokens (the figure most trainers quote)."""
    return 6.0 * adapter.num_params() * tokens

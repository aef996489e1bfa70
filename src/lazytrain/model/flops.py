"""FLOPs per step, measured the same way everywhere (DESIGN.md section 6)."""

from __future__ import annotations

from lazytrain.model.adapter import ModelAdapter


def model_flops(adapter: ModelAdapter, tokens: int, seq_len: int) -> float:
    """(6 N_nonembedding + 12 L d_attn seq) * tokens: recompute not counted, LM head in N."""
    n = adapter.num_nonembedding_params()
    attention = 12 * adapter.num_layers * adapter.attention_dim() * seq_len
    return float(6 * n + attention) * tokens


def flops_6nt(adapter: ModelAdapter, tokens: int) -> float:
    """6 * all parameters * tokens (the figure most trainers quote)."""
    return 6.0 * adapter.num_params() * tokens

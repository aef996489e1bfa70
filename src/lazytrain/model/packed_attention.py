"""Attention of packed rows (``data.packing``): flash attention's variable-length kernel where
the device has it, a block-diagonal boolean mask through sdpa elsewhere.

A packed row holds several samples; no token may attend to another sample's. The mask path
(`ModelAdapter.layer_masks` builds a [B, 1, S, S] boolean mask) is exact on every device, but
sdpa has no flash kernel for a dense mask: it runs the memory-efficient or the math kernel, and
the mask itself is B·S² bytes held through the step (2 GiB at 2 x 32768). The ``varlen`` path
lays the rows end to end and cuts them at the segments (`adapter.packed_segments`: each sample,
and each row's padding), then runs torch's ``varlen_attn`` (flash attention with cumulative
sequence offsets) causally within each segment: no mask, the flash kernel's time and saved
bytes. It needs CUDA and bf16 or fp16 (torch 2.11 on has the kernel); grouped-query attention
goes to the kernel as it is (torch 2.11's kernel takes fewer key/value heads as given; later
versions ask for ``enable_gqa``). Set ``model.packed_attention=mask`` to take the mask path
anyway.

HF attention layers look their attention function up by ``config._attn_implementation``; the
adapter registers `ATTENTION_NAME` with transformers' ``AttentionInterface`` and sets it on its
layers' config when it takes the varlen path. That function runs sdpa as before, unless the
layer is given the segments (`layer_masks` passes ``lazytrain_cu_seqlens`` and
``lazytrain_max_seqlen`` instead of a mask).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch
import transformers
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from lazytrain.errors import LazyTrainError

ATTENTION_NAME = "lazytrain_sdpa"
"""The attention implementation the adapter's layers name on the varlen path (sdpa, or varlen
given segments)."""
PACKED_ATTENTION = ("varlen", "mask")

VarlenKernel = Callable[..., torch.Tensor]
"""``torch.nn.attention.varlen.varlen_attn``'s signature: (query [T, H, D], key [T, KV, D],
value, cu_seq_q, cu_seq_k, max_q, max_k, **options) -> [T, H, D]."""


class PackedAttentionError(LazyTrainError, ValueError):
    pass


def torch_varlen_kernel() -> VarlenKernel | None:
    """torch's ``varlen_attn``, or None where this torch has none that takes a causal window."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn if "window_size" in inspect.signature(varlen_attn).parameters else None


def select_packed_attention(device: torch.device, dtype: torch.dtype) -> str:
    """``varlen`` where flash attention's variable-length kernel runs (CUDA, bf16 or fp16, a torch
    that has it), else ``mask``."""
    usable = device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)
    return "varlen" if usable and torch_varlen_kernel() is not None else "mask"


def varlen_attention(kernel: VarlenKernel, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     cu_seqlens: torch.Tensor, max_seqlen: int, scaling: float | None) -> torch.Tensor:
    """Causal attention within each segment of packed rows: ``query`` [B, H, S, D], ``key`` and
    ``value`` [B, KV, S, D] (as HF's attention layers pass them), the rows laid end to end and
    cut at ``cu_seqlens`` (int32, [segments + 1], on the device) into segments of at most
    ``max_seqlen`` tokens, by ``kernel`` (`VarlenKernel`). -> [B, S, H, D], as HF's attention
    functions return."""
    batch, heads, seq, dim = query.shape
    q = query.transpose(1, 2).reshape(batch * seq, heads, dim)
    k = key.transpose(1, 2).reshape(batch * seq, key.shape[1], dim)
    v = value.transpose(1, 2).reshape(batch * seq, value.shape[1], dim)
    gqa = {"enable_gqa": True} if k.shape[1] != heads and _takes_gqa(kernel) else {}
    out = kernel(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, scale=scaling, window_size=(-1, 0), **gqa)
    return out.view(batch, seq, heads, dim)


@functools.cache
def _takes_gqa(kernel: VarlenKernel) -> bool:
    """Whether ``kernel`` asks for ``enable_gqa`` (torch 2.12 on) to take fewer key/value heads."""
    return "enable_gqa" in inspect.signature(kernel).parameters


def lazytrain_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                        lazytrain_cu_seqlens: torch.Tensor | None = None, lazytrain_max_seqlen: int | None = None,
                        **kwargs) -> tuple[torch.Tensor, None]:
    """HF's attention-function interface: sdpa, or with the segments of packed rows the varlen
    kernel set on the layer (``module.lazytrain_varlen``, by `use_varlen`)."""
    if lazytrain_cu_seqlens is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    if dropout:
        raise PackedAttentionError(f"attention dropout {dropout}: the varlen path has none; set "
                                   "model.packed_attention=mask (or attention_dropout=0 in config.json)")
    return varlen_attention(module.lazytrain_varlen, query, key, value, lazytrain_cu_seqlens,
                            lazytrain_max_seqlen, scaling), None


transformers.AttentionInterface.register(ATTENTION_NAME, lazytrain_attention)


def use_varlen(config: transformers.PretrainedConfig, attention_modules: list[torch.nn.Module],
               kernel: VarlenKernel) -> None:
    """Point ``attention_modules`` (built from ``config``) at `lazytrain_attention`, with
    ``kernel`` for segments."""
    config._attn_implementation = ATTENTION_NAME
    for module in attention_modules:
        if module.config is not config:  # a copy: the layer would not see the choice
            module.config._attn_implementation = ATTENTION_NAME
        module.lazytrain_varlen = kernel

"""The Hybrid 8-bit AdamW step in float64, written for clarity: the oracle of the tests.

Nothing here is fast or fused. Nearest codes come from an argmin over the whole map, not from
the look-up tables the kernel uses, so the tests check the tables too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lazytrain.optim.base import AdamWConfig
from lazytrain.optim.quant import BLOCK, TINY, create_dynamic_map


@dataclass(frozen=True)
class ReferenceResult:
    master: torch.Tensor
    """float64, the updated master."""
    m: torch.Tensor
    v: torch.Tensor
    """float64, the new moments before quantization."""
    root: torch.Tensor
    """float64, sqrt(v): what the second-moment codes hold."""
    m_codes: torch.Tensor
    m_absmax: torch.Tensor
    v_codes: torch.Tensor
    v_absmax: torch.Tensor
    m_normalized: torch.Tensor
    v_normalized: torch.Tensor
    """float64, m / absmax and sqrt(v) / absmax: what was quantized."""


def _nearest(x: torch.Tensor, qmap: torch.Tensor) -> torch.Tensor:
    return (x[:, None] - qmap[None, :]).abs().argmin(dim=1)


def quantize64(x: torch.Tensor, qmap: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(codes, absmax, x / absmax) of flat float64 ``x`` in blocks of BLOCK."""
    n = x.numel()
    blocks = -(-n // BLOCK)
    padded = torch.nn.functional.pad(x, (0, blocks * BLOCK - n)).view(blocks, BLOCK)
    absmax = padded.abs().amax(dim=1)
    absmax = torch.where(absmax >= TINY, absmax, 0.0)  # denormal blocks are stored as zero
    normalized = torch.where(absmax[:, None] > 0, padded / absmax[:, None], 0.0).reshape(-1)[:n]
    codes = torch.cat([_nearest(c, qmap.double()) for c in normalized.split(1 << 14)])
    return codes, absmax, normalized


def reference_step(
    master: torch.Tensor,
    grad: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    *,
    step: int,
    clip_coef: float,
    lr: float,
    config: AdamWConfig,
    decay_numel: int,
) -> ReferenceResult:
    """One AdamW step at step count ``step`` (1-based) from moments ``m``, ``v``, in float64.

    ``m`` and ``v`` are the current moments (dequantized, for an 8-bit state). The result holds
    the new master, the new moments and the blockwise quantization of m and of sqrt(v).
    """
    beta1, beta2 = config.betas
    g = grad.reshape(-1).double() * clip_coef
    m = beta1 * m.double() + (1 - beta1) * g
    v = beta2 * v.double() + (1 - beta2) * g * g
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    decay = torch.ones_like(g)
    decay[:decay_numel] = 1 - lr * config.weight_decay
    root = v.sqrt()
    denom = root / math.sqrt(bias_correction2) + config.eps
    new_master = master.double() * decay - lr / bias_correction1 * m / denom
    m_codes, m_absmax, m_norm = quantize64(m, create_dynamic_map(signed=True))
    v_codes, v_absmax, v_norm = quantize64(root, create_dynamic_map(signed=False))
    return ReferenceResult(
        master=new_master,
        m=m,
        v=v,
        root=root,
        m_codes=m_codes,
        m_absmax=m_absmax,
        v_codes=v_codes,
        v_absmax=v_absmax,
        m_normalized=m_norm,
        v_normalized=v_norm,
    )

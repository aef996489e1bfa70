"""transformers' module-level functions under the wrappers transformers puts on them.

LazyTrain swaps some of them (the rotary embedding inside a lean attention, the Gated-DeltaNet
rule and convolution) and checks what it swaps by the function's own signature. transformers
wraps them two ways: ``functools.wraps`` layers, and, from 5.2x with the ``kernels`` package
(a transformers dependency there), ``use_kernel_forward_from_hub`` turns a function into a
``Func`` module whose forward calls the function it closes over (a hub kernel instead, when a
model has kernels activated, which LazyTrain does not do).
"""

from __future__ import annotations

import inspect

import torch


def plain_function(fn):
    """``fn`` without those wrappers: the function transformers' module defines."""
    fn = inspect.unwrap(fn)
    if isinstance(fn, torch.nn.Module):
        inner = inspect.getclosurevars(type(fn).forward).nonlocals.get("func")
        if callable(inner) and inner is not fn:
            return plain_function(inner)
    return fn

"""Sub-layer recompute: a kept layer whose attention or MLP block, or its MLP's up projection,
is recomputed in backward.

A ``keep`` layer runs under autograd and keeps every tensor its backward needs. With
``LayerPlan.recompute`` = ``attention`` (``self_attn``, or ``linear_attn`` in a Gated-DeltaNet
layer), or ``mlp`` where the MLP is not a lean SwiGLU (see below), that block runs under
non-reentrant `torch.utils.checkpoint` instead: its internals are not saved; only its inputs are (through whatever saved-tensor hooks are active
outside, i.e. the executor's, which put them on the plan's tier), and the layer's backward
re-runs the block from them when it first needs one of its tensors.

The block's weights are passed to the checkpoint as explicit inputs, so they are saved like its
other inputs: the executor's pack hook turns a weight into a reference into the layer's weight
slot, and the recompute reads it from the slot that holds the layer in backward (the forward's
slot may hold another layer by then). Tensors in the block's keyword arguments (the mask, the
rotary cos/sin, the hidden states HF passes by name) are moved to positional inputs for the
same reason: checkpoint keeps keyword arguments by reference, outside any hook.

``mlp_up`` is narrower: the layer's memory-lean SwiGLU MLP (`lazytrain.model.lean`) saves its
gate projection's output but not its up projection's, and recomputes that one matmul in backward
(`lean.recomputing_mlp`); a layer whose MLP is not a lean SwiGLU (``model.lean_ops=false``, a
mixture of experts) does not offer it (`options`). In a layer whose MLP is a lean SwiGLU,
``mlp`` is that MLP saving neither projection's output and recomputing both, not a checkpoint:
the same bytes kept (its input and weights), without re-running the down projection, whose
output the backward does not read (Qwen2.5-7B on the H200, 2026-12-04: the checkpoint's
recompute took 43.1 ms, the up projection's alone 13.8).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from functools import partial

import torch
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import checkpoint

from lazytrain.errors import LazyTrainError
from lazytrain.model.lean import MLP_PROJECTIONS, is_lean_swiglu, recomputing_mlp

RECOMPUTE_BLOCKS = ("mlp", "attention")
"""The blocks of a decoder layer whose internals a kept layer may recompute in backward
(``LayerPlan.recompute``): run again from their inputs, or a lean SwiGLU MLP's two projections."""
RECOMPUTE_PARTS = ("mlp_up",)
"""Parts of a block a kept layer may recompute (``LayerPlan.recompute``): the MLP's up projection."""


class RecomputeUnavailable(LazyTrainError, ValueError):
    """A plan asks a layer to recompute something it cannot."""


def options(template: torch.nn.Module) -> tuple[str, ...]:
    """What a kept layer built from ``template`` may recompute in backward (besides nothing)."""
    return RECOMPUTE_BLOCKS + (RECOMPUTE_PARTS if is_lean_swiglu(getattr(template, "mlp", None)) else ())


def check_option(template: torch.nn.Module, layer_type: str, recompute: str) -> None:
    """Raise `RecomputeUnavailable` unless a kept ``layer_type`` layer built from ``template`` can
    recompute ``recompute`` (the executor checks a plan's layers before its first step)."""
    if recompute in RECOMPUTE_PARTS and recompute not in options(template):
        raise RecomputeUnavailable(
            f"the plan recomputes {recompute!r} in a {layer_type!r} layer, whose MLP is not a memory-lean "
            "SwiGLU (model.lean_ops=false, or another kind of MLP); plan again (`lazytrain plan`) for "
            "this model, or set that layer's recompute to 'mlp' or 'none'")


def recomputing(template: torch.nn.Module, layer_type: str, recompute: str, params: dict[str, torch.Tensor]):
    """The context a kept layer's forward runs in for ``recompute`` (``LayerPlan.recompute``)."""
    if recompute == "none":
        return nullcontext()
    if recompute in RECOMPUTE_PARTS:
        check_option(template, layer_type, recompute)
        return recomputing_mlp(("up",))
    if recompute == "mlp" and is_lean_swiglu(getattr(template, "mlp", None)):
        return recomputing_mlp(MLP_PROJECTIONS)  # the checkpoint would re-run the down projection too
    return recomputed(template, block_name(layer_type, recompute), params)


def block_name(layer_type: str, recompute: str) -> str:
    """The HF submodule of a ``layer_type`` layer that ``recompute`` names."""
    if recompute == "mlp":
        return "mlp"
    if recompute == "attention":
        return "linear_attn" if layer_type == "linear_attention" else "self_attn"
    raise ValueError(f"recompute {recompute!r} is not one of {RECOMPUTE_BLOCKS}")


class _Checkpointed:
    """Installed as ``block.forward`` while the layer's forward runs; ``inner`` is the forward
    it replaces."""

    def __init__(self, block: torch.nn.Module, weights: dict[str, torch.Tensor], inner):
        self.block = block
        self.inner = inner
        self.names = list(weights)
        self.weights = [weights[n] for n in self.names]
        self.inside = False

    def __call__(self, *args, **kwargs):
        if self.inside:  # the checkpointed function calling the block itself
            return self.inner(*args, **kwargs)
        leaves, spec = pytree.tree_flatten((args, kwargs))
        where = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        others = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        names, block, n = self.names, self.block, len(self.names)

        def run(*tensors):
            flat = list(others)
            for i, t in zip(where, tensors[n:]):
                flat[i] = t
            a, kw = pytree.tree_unflatten(flat, spec)
            self.inside = True
            try:
                # forward: the block's weights are the tensors given (the layer's leaves);
                # recompute in backward: the ones the executor's unpack hook returns
                return torch.func.functional_call(block, dict(zip(names, tensors[:n])), a, kw, strict=True)
            finally:
                self.inside = False

        return checkpoint(run, *self.weights, *(leaves[i] for i in where),
                          use_reentrant=False, preserve_rng_state=False)


@contextmanager
def recomputed(template: torch.nn.Module, name: str, params: dict[str, torch.Tensor]):
    """Within the block, ``template.<name>`` runs under checkpoint with its weights from
    ``params`` (the layer's parameters, by name inside the layer)."""
    block = getattr(template, name)
    prefix = name + "."
    weights = {k[len(prefix):]: v for k, v in params.items() if k.startswith(prefix)}
    # a forward set on the instance (a memory-lean replacement of the block's) is kept: it is
    # what runs inside the checkpoint, and it is put back afterwards
    own = block.__dict__.get("forward")
    block.forward = _Checkpointed(block, weights, own or partial(type(block).forward, block))
    try:
        yield
    finally:
        if own is None:
            del block.forward
        else:
            block.forward = own

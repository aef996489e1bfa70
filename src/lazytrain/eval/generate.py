"""Batched greedy generation with a KV cache, resident or streamed layer by layer.

``resident``: the whole HF model on the device and ``generate`` (when it fits).
``streamed``: the model stays in the host store; for the whole batch of prompts, each
decoder layer's weights are copied to the device once for the prefill and once per new
token, and every layer keeps its KV cache on the device. Both produce the same tokens.
"""

from __future__ import annotations

import torch
import transformers
from transformers import DynamicCache

from lazytrain.memory.host_store import HostStore
from lazytrain.model.adapter import ModelAdapter
from lazytrain.runtime.streams import Streams
from lazytrain.runtime.weights import WeightStreamer


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[row, width - len(p):] = 1
    return ids, mask


def _cut(tokens: list[int], eos_id: int | None) -> list[int]:
    if eos_id is not None and eos_id in tokens:
        return tokens[: tokens.index(eos_id)]
    return tokens


def cut_at_stop(text: str, stop: tuple[str, ...]) -> str:
    """``text`` up to the first stop string (the stop string itself removed)."""
    ends = [i for i in (text.find(s) for s in stop) if i >= 0]
    return text[: min(ends)] if ends else text


@torch.no_grad()
def generate_resident(
    model: transformers.PreTrainedModel,
    prompts: list[list[int]],
    max_new_tokens: int,
    pad_id: int,
    eos_id: int | None,
) -> list[list[int]]:
    """Greedy continuation of each prompt (eos and what follows removed)."""
    device = next(model.parameters()).device
    ids, mask = left_pad(prompts, pad_id)
    out = model.generate(
        input_ids=ids.to(device),
        attention_mask=mask.to(device),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    new = out[:, ids.shape[1]:].tolist()
    return [_cut(tokens, eos_id) for tokens in new]


@torch.no_grad()
def generate_streamed(
    adapter: ModelAdapter,
    store: HostStore,
    prompts: list[list[int]],
    max_new_tokens: int,
    pad_id: int,
    eos_id: int | None,
) -> list[list[int]]:
    """Greedy generation with the weights streamed from the host store, layer by layer."""
    device, dtype = adapter.device, store.dtype
    streams = Streams(device)
    L = adapter.num_layers
    schedule = list(range(L)) * (max_new_tokens + 1)
    weights = WeightStreamer(store.weights[1 : 1 + L], num_slots=2, depth=1, streams=streams, device=device)
    weights.begin(schedule)
    embed = store.weights[0].to(device)
    final = store.weights[-1].to(device)
    embed_params = adapter.layouts[0].views(embed)
    final_params = adapter.final_layout.views(final)
    head = adapter.head_weight(embed_params, final_params)

    ids, valid = left_pad(prompts, pad_id)
    ids, valid = ids.to(device), valid.to(device)
    batch = ids.shape[0]
    positions = (valid.cumsum(1) - 1).clamp_min(0)
    cache = DynamicCache(config=adapter.config)
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    generated = []
    x = adapter.embed(embed_params["embed_tokens.weight"], ids)
    query_positions = positions
    for step in range(max_new_tokens + 1):
        masks = adapter.layer_masks(valid, x.shape[1])
        rope = adapter.rotary_embeddings(query_positions, dtype)
        for i in range(L):
            slot = weights.acquire(i)
            x = adapter.layer_forward(
                i, adapter.layouts[i + 1].views(slot), x, rope, masks, use_cache=True, **{adapter.cache_kwarg: cache}
            )
            weights.release(i)
        if step == max_new_tokens:
            break
        logits = torch.nn.functional.linear(
            adapter.final_norm(final_params["model.norm.weight"], x[:, -1]), head
        )
        token = logits.float().argmax(-1)
        if eos_id is not None:
            token = torch.where(done, torch.full_like(token, eos_id), token)
            done |= token == eos_id
        generated.append(token)
        if eos_id is not None and bool(done.all()):
            # the remaining schedule is unused; the streamer is local to this call
            break
        x = adapter.embed(embed_params["embed_tokens.weight"], token[:, None])
        valid = torch.cat([valid, torch.ones(batch, 1, dtype=valid.dtype, device=device)], dim=1)
        query_positions = positions[:, -1:] + 1
        positions = torch.cat([positions, query_positions], dim=1)
    tokens = torch.stack(generated, dim=1).tolist() if generated else [[] for _ in prompts]
    return [_cut(t, eos_id) for t in tokens]

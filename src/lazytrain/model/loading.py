"""HF checkpoints in and out of the host store, one tensor at a time.

Loading reads each safetensors shard lazily and copies tensor by tensor into the store's
fp32 masters and streaming buffers, so no second full copy of the model ever exists.
Saving writes HF-named safetensors shards (bf16 by default) from the masters, with
``config.json`` and an index, loadable by ``AutoModelForCausalLM.from_pretrained``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from lazytrain.memory.host_store import HostStore
from lazytrain.model.adapter import ModelAdapter, UnsupportedModelError


def _name_index(adapter: ModelAdapter) -> dict[str, tuple[int, str]]:
    index = {}
    for g, layout in enumerate(adapter.layouts):
        for p in layout.params:
            index[layout.hf_prefix + p.name] = (g, p.name)
    return index


def load_safetensors(adapter: ModelAdapter, store: HostStore, folder: str | Path) -> None:
    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise UnsupportedModelError(
            f"{folder} has no *.safetensors files; LazyTrain reads HF safetensors checkpoints "
            "(convert .bin files with `transformers` first)"
        )
    index = _name_index(adapter)
    seen: set[str] = set()
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if name not in index:
                    if name.endswith("rotary_emb.inv_freq"):
                        continue
                    if name == "lm_head.weight" and adapter.tied:
                        continue
                    raise UnsupportedModelError(
                        f"{path.name}: tensor {name!r} is not part of a {adapter.arch} with this "
                        "config.json; is the folder's config the one the weights were saved with?"
                    )
                group, pname = index[name]
                store.set_param(group, pname, f.get_tensor(name))
                seen.add(name)
    missing = sorted(set(index) - seen)
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise UnsupportedModelError(f"{folder}: {len(missing)} weights missing from the checkpoint: {shown}")


def random_init(adapter: ModelAdapter, store: HostStore, seed: int, device: torch.device) -> None:
    """HF-style random init, generated group by group (on ``device``, fast on a GPU)."""
    gen = torch.Generator(device=device)
    for g, layout in enumerate(adapter.layouts):
        gen.manual_seed(seed * 100_003 + g)
        for p in layout.params:
            store.set_param(g, p.name, adapter.init_value(layout, p, gen, device))


def save_hf(
    adapter: ModelAdapter,
    store: HostStore,
    out_dir: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_bytes: int = 5 * 2**30,
    groups: list[torch.Tensor] | None = None,
) -> Path:
    """Write an HF model folder (config + safetensors shards + index) from the fp32 masters,
    or from ``groups`` (flat per-group values, e.g. a data-parallel rank's full streaming
    weights, which hold every master rounded to the model dtype)."""
    values = store.masters if groups is None else groups
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = adapter.config
    config.dtype = dtype
    config.save_pretrained(out)
    # assign tensors to shards first, then build and write one shard at a time
    assignment: list[list[tuple[int, object]]] = [[]]
    shard_bytes = 0
    esize = torch.empty((), dtype=dtype).element_size()
    for g, layout in enumerate(adapter.layouts):
        for p in layout.params:
            nbytes = p.numel * esize
            if shard_bytes and shard_bytes + nbytes > max_shard_bytes:
                assignment.append([])
                shard_bytes = 0
            assignment[-1].append((g, p))
            shard_bytes += nbytes
    weight_map, total = {}, 0
    for k, members in enumerate(assignment):
        name = (
            "model.safetensors"
            if len(assignment) == 1
            else f"model-{k + 1:05d}-of-{len(assignment):05d}.safetensors"
        )
        shard = {}
        for g, p in members:
            layout = adapter.layouts[g]
            master = values[g][p.offset : p.offset + p.numel]
            shard[layout.hf_prefix + p.name] = master.view(p.shape).to(dtype).contiguous()
            weight_map[layout.hf_prefix + p.name] = name
            total += p.numel * esize
        save_file(shard, str(out / name), metadata={"format": "pt"})
        del shard
    if len(assignment) > 1:
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
        )
    return out

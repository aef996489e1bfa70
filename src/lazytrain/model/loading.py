"""HF checkpoints in and out of the host store, one tensor at a time.

Loading reads each safetensors shard lazily and copies tensor by tensor into the store's
fp32 masters and streaming buffers, so no second full copy of the model ever exists.
Saving writes HF-named safetensors shards (bf16 by default) from the masters, with
``config.json`` and an index, loadable by ``from_pretrained`` of the folder's own class.

A ConditionalGeneration folder (Qwen3.5/3.6 as published) holds more than the language model:
the vision tower (``model.visual.*``) and multi-token-prediction heads (``mtp.*``; a Qwen3.5
CausalLM folder may hold those too). LazyTrain trains the language model only; the other
tensors are kept as loaded (``WeightStore.carried``) and written back unchanged.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from lazytrain.errors import LazyTrainError
from lazytrain.model.adapter import HYBRID_ARCHITECTURES, ModelAdapter, ParamSlot, load_hf_config


class WeightStore(Protocol):
    """What loading and saving need of the model's host storage (``memory.HostStore`` or a
    data-parallel rank's ``ShardedHostStore``): ``model/`` sits below ``memory/`` and imports neither."""

    carried: dict[str, torch.Tensor]
    """Tensors outside the language model, kept as loaded and written back unchanged."""
    build_seconds: dict[str, float]
    """Seconds the build took per phase (`build.build_model` fills it)."""

    def set_param(self, group: int, name: str, value: torch.Tensor, start: int = 0) -> None:
        """Write parameter ``name`` of ``group`` (its master and streamed weight), or its part
        from element ``start`` on."""

    def master_fp32(self, group: int) -> torch.Tensor:
        """The exact fp32 master of ``group``, flat."""


class ModelFileError(LazyTrainError, ValueError):
    """A model folder whose weight files are missing, damaged or do not match its config."""


def check_model_folder(folder: str | Path) -> None:
    """Fail fast, before tokenizer and data, on a folder LazyTrain cannot train from.

    Checks that it exists, holds a config.json of a supported architecture, and that every
    ``*.safetensors`` file's header is complete and its size covers the tensors it lists
    (a truncated download fails here, not half-way through loading).
    """
    folder = Path(folder).expanduser()
    load_hf_config(folder)
    check_weight_files(folder)


def check_weight_files(folder: Path) -> None:
    """Every ``*.safetensors`` file of ``folder`` (there must be one) has a complete header and
    covers the tensors it lists (`lazytrain eval` checks a folder of any architecture so)."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelFileError(
            f"{folder} has no *.safetensors files; LazyTrain reads HF safetensors checkpoints "
            "(convert .bin files with `transformers` first)"
        )
    for path in files:
        try:
            with safe_open(str(path), framework="pt"):
                pass
        except (SafetensorError, OSError) as error:
            raise ModelFileError(
                f"{path} is damaged or incomplete ({error}); download or copy it again"
            ) from None

log = logging.getLogger(__name__)

_LANGUAGE_MODEL_PREFIXES = ("model.language_model.", "lm_head.")


def _name_index(adapter: ModelAdapter) -> dict[str, tuple[int, str, int, tuple[str, ...]]]:
    """Each tensor name a checkpoint file may hold: (group, parameter, first element within it,
    the names of the file tensors it stands for). Stacked experts may be held either way: one
    tensor per expert and projection (as ``save_pretrained`` writes them) or stacked."""
    index = {}
    for g, layout in enumerate(adapter.layouts):
        for p in layout.params:
            pieces = layout.hf_file_pieces(p)
            for name, start, _ in pieces:
                index[name] = (g, p.name, start, (name,))
            if len(pieces) > 1:
                index[layout.hf_name(p)] = (g, p.name, 0, tuple(name for name, _, _ in pieces))
    return index


def _carried(adapter: ModelAdapter, name: str) -> bool:
    """A tensor outside the language model: in a ConditionalGeneration folder anything but the
    language model; in a Qwen3.5 CausalLM folder the multi-token-prediction heads (``mtp.*``,
    which transformers' Qwen3.5 classes ignore when they load)."""
    if adapter.multimodal:
        return not name.startswith(_LANGUAGE_MODEL_PREFIXES)
    return adapter.arch in HYBRID_ARCHITECTURES and name.startswith("mtp.")


def load_safetensors(adapter: ModelAdapter, store: WeightStore, folder: str | Path) -> None:
    folder = Path(folder)
    check_model_folder(folder)
    files = sorted(folder.glob("*.safetensors"))
    index = _name_index(adapter)
    seen: set[str] = set()
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (a safetensors handle, not a dict: not iterable)
                if name not in index:
                    if name.endswith("rotary_emb.inv_freq"):
                        continue
                    if name == "lm_head.weight" and adapter.tied:
                        continue
                    if _carried(adapter, name):
                        store.carried[name] = f.get_tensor(name)
                        continue
                    raise ModelFileError(
                        f"{path}: tensor {name!r} is not part of a {adapter.arch} with this "
                        "config.json; is the folder's config the one the weights were saved with?"
                    )
                group, pname, start, covers = index[name]
                store.set_param(group, pname, f.get_tensor(name), start)
                seen.update(covers)
    missing = sorted({covered for _, _, _, covers in index.values() for covered in covers} - seen)
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ModelFileError(f"{folder}: {len(missing)} weights missing from the checkpoint: {shown}")
    if store.carried:
        parts = sorted({name.split(".")[1] if name.startswith("model.") else name.split(".")[0]
                        for name in store.carried})
        numel = sum(t.numel() for t in store.carried.values())
        log.info(
            "%s: %d tensors outside the language model (%s; %.3fB parameters) are carried through "
            "unchanged and untrained: LazyTrain trains the language model only",
            folder, len(store.carried), ", ".join(parts), numel / 1e9,
        )


def random_init_values(adapter: ModelAdapter, seed: int,
                       device: torch.device) -> Iterator[tuple[int, ParamSlot, torch.Tensor]]:
    """HF-style random init as (group index, parameter, value), generated group by group on
    ``device`` (fast on a GPU): what `random_init` writes into the host store, and what
    ``bench/peers.py`` writes into the other trainers' models, so that all train the same weights."""
    gen = torch.Generator(device=device)
    for g, layout in enumerate(adapter.layouts):
        gen.manual_seed(seed * 100_003 + g)
        for p in layout.params:
            yield g, p, adapter.init_value(layout, p, gen, device)


def random_init(adapter: ModelAdapter, store: WeightStore, seed: int, device: torch.device) -> None:
    """HF-style random init, generated group by group (on ``device``, fast on a GPU)."""
    for g, p, value in random_init_values(adapter, seed, device):
        store.set_param(g, p.name, value)


def save_hf(
    adapter: ModelAdapter,
    store: WeightStore,
    out_dir: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_bytes: int = 5 * 2**30,
    groups: list[torch.Tensor] | None = None,
) -> Path:
    """Write an HF model folder (config + safetensors shards + index) from the fp32 masters,
    or from ``groups`` (flat per-group values, e.g. a data-parallel rank's full streaming
    weights, which hold every master rounded to the model dtype); tensors carried through (a
    vision tower) are written as loaded."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = adapter.hf_config
    config.dtype = dtype
    config.save_pretrained(out)
    # assign tensors to shards first, then build and write one shard at a time; an entry is
    # (group, slot) for a trained tensor or (None, name) for a carried one
    assignment: list[list[tuple[int | None, object]]] = [[]]
    shard_bytes = 0
    esize = torch.empty((), dtype=dtype).element_size()
    # stacked experts as one tensor per expert and projection, as save_pretrained writes them
    entries = [(g, (p, piece), math.prod(piece[2]) * esize) for g, layout in enumerate(adapter.layouts)
               for p in layout.params for piece in layout.hf_file_pieces(p)]
    entries += [(None, name, t.numel() * t.element_size()) for name, t in store.carried.items()]
    for g, p, nbytes in entries:
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
        group_master: tuple[int, torch.Tensor] | None = None  # a split master is joined once
        for g, p in members:
            if g is None:
                shard[p] = store.carried[p].contiguous()
                weight_map[p] = name
                total += shard[p].numel() * shard[p].element_size()
                continue
            param, (hf_name, start, shape) = p
            if group_master is None or group_master[0] != g:
                group_master = (g, store.master_fp32(g) if groups is None else groups[g])
            first = param.offset + start
            shard[hf_name] = group_master[1][first : first + math.prod(shape)].view(shape).to(dtype).contiguous()
            weight_map[hf_name] = name
            total += math.prod(shape) * esize
        save_file(shard, str(out / name), metadata={"format": "pt"})
        del shard
    if len(assignment) > 1:
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
        )
    return out

"""Build a streamed model (adapter + host store) from ``model.source``."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
import transformers

from lazytrain.model.adapter import ModelAdapter, UnsupportedModelError, load_hf_config
from lazytrain.model.loading import WeightStore, load_safetensors, random_init
from lazytrain.model.shapes import SHAPES

Store = TypeVar("Store", bound=WeightStore)


def model_config(source: str, vocab_size: int | None = None) -> transformers.PretrainedConfig:
    """The HF config of ``source``: ``builtin:NAME`` or a local HF folder."""
    if source.startswith("builtin:"):
        name = source.split(":", 1)[1]
        if name not in SHAPES:
            raise UnsupportedModelError(
                f"unknown built-in model shape {name!r}; choose one of {', '.join(SHAPES)} "
                "or give a local HF model folder"
            )
        shape = dict(SHAPES[name])
        if "vocab_size" not in shape:
            if vocab_size is None:
                raise UnsupportedModelError(f"built-in shape {name!r} takes its vocab from the tokenizer")
            shape["vocab_size"] = vocab_size
        return load_hf_config(shape)
    return load_hf_config(source)


def init_device_of(setting: str) -> torch.device | None:
    """The device a built-in shape's random init is drawn on for ``model.init_device``
    (None: the training device)."""
    return torch.device("cpu") if setting == "cpu" else None


def build_model(
    source: str,
    device: torch.device,
    dtype: torch.dtype,
    *,
    store_factory: Callable[..., Store],
    seed: int = 0,
    vocab_size: int | None = None,
    pin: bool = True,
    optimizer_bytes_per_param: float | Callable[[list[int]], float] = 8.0,
    host_limit_bytes: int | None = None,
    master: str = "fp32",
    preflight: Callable[[list[int]], None] | None = None,
    lean_ops: bool = True,
    fused_ops: str = "auto",
    packed_attention: str = "auto",
    init_device: torch.device | None = None,
) -> tuple[ModelAdapter, Store]:
    """Adapter + host store holding the weights (loaded, or random for built-in shapes).

    ``store_factory`` builds the store from the layouts and dtype: ``memory.HostStore``, or a
    data-parallel rank's ``ShardedHostStore`` with its rank arguments bound (the caller picks:
    ``model/`` imports nothing from ``memory/``). ``optimizer_bytes_per_param`` is a number, or
    a function of the groups' sizes giving one. ``preflight`` gets the groups' sizes before any
    host memory is allocated (and may raise). ``lean_ops``: `model.lean` forwards in the layer
    templates (``model.lean_ops``), their elementwise parts as ``fused_ops`` says
    (``model.fused_ops``); ``packed_attention``: ``model.packed_attention``. ``init_device``:
    where a built-in shape's random init is drawn (default ``device``; ``model.init_device``).
    """
    started = time.perf_counter()
    config = model_config(source, vocab_size)
    adapter = ModelAdapter(config, device, dtype, lean_ops=lean_ops, fused_ops=fused_ops)
    if packed_attention != "auto":
        adapter.set_packed_attention(packed_attention)
    adapter_ready = time.perf_counter()
    if preflight is not None:
        preflight([g.numel for g in adapter.layouts])
    if callable(optimizer_bytes_per_param):
        optimizer_bytes_per_param = optimizer_bytes_per_param([g.numel for g in adapter.layouts])
    store = store_factory(
        adapter.layouts,
        dtype,
        pin=pin and device.type == "cuda",
        optimizer_bytes_per_param=optimizer_bytes_per_param,
        host_limit_bytes=host_limit_bytes,
        **({"master": master} if master != "fp32" else {}),  # a sharded store's masters are fp32
    )
    allocated = time.perf_counter()
    if source.startswith("builtin:"):
        random_init(adapter, store, seed, init_device or device)
    else:
        load_safetensors(adapter, store, Path(source).expanduser())
    store.build_seconds = {"adapter_and_kernels": adapter_ready - started, "host_store": allocated - adapter_ready,
                           "weights": time.perf_counter() - allocated}
    return adapter, store

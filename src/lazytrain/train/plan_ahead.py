"""``lazytrain plan``: the plan for a model from its shape alone, without loading its weights.

The model is read from ``config.json`` (a folder needs nothing else) or a built-in shape and
built on the ``meta`` device (its parameter shapes, no memory); the host memory is counted, not
allocated. The cost table is ``plan.costs`` (measured by ``lazytrain profile`` on the training
machine) or, without one, a built-in estimate for an assumed machine, and the result says
which. So a 27B model plans on a laptop before a GPU is rented.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from lazytrain.config import QUANTIZED_KINDS, Config
from lazytrain.data.pipeline import load_tokenizer
from lazytrain.memory import budget
from lazytrain.memory.host_store import activation_room, default_host_limit
from lazytrain.model.adapter import ModelAdapter
from lazytrain.model.build import model_config
from lazytrain.model.flops import moe_shape
from lazytrain.optim.factory import describe_config
from lazytrain.optim.master import MASTER_BYTES
from lazytrain.plan.plan import Plan
from lazytrain.plan.planner import Planner, costs_from_file, estimated_costs, with_capacities
from lazytrain.runtime.device import resolve_device, resolve_dtype
from lazytrain.runtime.executor import host_grad_groups
from lazytrain.train.session import host_limit_bytes, host_settings

if TYPE_CHECKING:
    from lazytrain.plan.costs import CostTable
    from lazytrain.plan.search import SearchResult

log = logging.getLogger(__name__)

GiB = 2**30


@dataclass(kw_only=True, slots=True)
class PlanAhead:
    plan: Plan
    costs: CostTable
    source: str
    """Where ``costs`` came from: ``plan.costs`` and the machine it was measured on, or the
    built-in estimate and the machine it assumes."""
    host: budget.HostBudget
    """The host memory the run would take with this plan (model state + host-tier activations)."""
    planner: Planner
    arch: str
    num_params: int
    fix: str | None = None
    """The smallest change of settings after which ``host`` fits (`budget.smallest_fix`); None:
    it fits, or no setting makes it."""
    sweep: SearchResult | None = None
    """With ``plan.batch_sweep``: the solved plan at each candidate batch (`search.search_batch`),
    the fastest kept; None: no sweep, or not even batch 1 fits (``sweep_error`` says why)."""
    sweep_error: str | None = None


def plan_ahead(config: Config) -> PlanAhead:
    """The plan a GPU run of ``config`` starts with (``plan.policy``; ``auto``: the solved plan)
    for its model at its batch shape, planned for the GPU this machine has, or, on a machine
    without one, for the GPU the cost table was measured on (or the estimate assumes); no
    weights are read or allocated."""
    source = config.model.source
    vocab = len(load_tokenizer(source)) if source.startswith("builtin:") else None  # built-in shapes without one
    here = resolve_device(config.training.device)
    # the dtype the training machine computes in: a GPU's (bf16 by default) unless this one is the CPU
    # and the table was measured on it
    on_cpu = here.type == "cpu" and bool(config.plan.costs) and _table_device(config.plan.costs) == "cpu"
    target = torch.device("cpu") if on_cpu else torch.device("cuda")
    dtype = resolve_dtype(config.model.dtype, target)
    adapter = ModelAdapter(model_config(source, vocab), here, dtype, lean_ops=config.model.lean_ops,
                           fused_ops=config.model.fused_ops)
    numels = [layout.numel for layout in adapter.layouts]
    moe = moe_shape(adapter.config)
    settings = host_settings(config, target, dtype, len(numels))  # gradients placed: each layer's held, for now
    limit = host_limit_bytes(config)
    state = budget.host_budget(numels, settings, limit=limit).state.total
    batch, seq = config.training.batch_size, config.data.max_seq_len
    if config.plan.costs:
        costs, described = _measured(config, adapter, batch, seq)
        elsewhere = costs.host_bytes + state  # the profiled machine's room for activations beside this state
    else:
        gpu_gb, gpu_source = config.memory.gpu_gb, "memory.gpu_gb"
        if gpu_gb is None and here.type == "cuda":  # this machine's card, at the estimate's speeds
            gpu_gb = torch.cuda.get_device_properties(here).total_memory / GiB
            gpu_source = f"this machine's {torch.cuda.get_device_name(here)}"
        costs, described = estimated_costs(
            adapter.layer_types, {kind: [(n, tuple(p.shape)) for n, p in t.named_parameters()]
                                  for kind, t in adapter.templates.items()},
            hidden=adapter.hidden_size, vocab=adapter.vocab_size, embed_params=numels[0], final_params=numels[-1],
            batch_size=batch, seq_len=seq, head_chunk_tokens=config.plan.head_chunk_tokens,
            gpu_gb=gpu_gb, gpu_source=gpu_source, top_k=moe.top_k if moe else 0,
            optimizer=(config.optimizer.kind, config.state_rounding()),
            device_state_bytes_per_param=_device_state_bytes_per_param(settings, numels))
        elsewhere = costs.host_bytes  # the assumed machine's
    # the host budget: memory.host_limit_gb, else this machine's where it trains here, else the
    # table's machine's
    trains_here = here.type == "cuda" or on_cpu
    limit = limit or (default_host_limit() if trains_here else elsewhere)
    room = activation_room(state, limit, pending=state) if trains_here else max(limit - state, 0)
    costs = with_capacities(costs, host_bytes=room, gpu_gb=config.memory.gpu_gb,
                            host_grads=config.memory.gradients == "host")
    if not config.plan.costs:
        whose = ("memory.host_limit_gb" if config.memory.host_limit_gb else "this machine's" if trains_here
                 else "assumed")
        described += f"; host memory {limit / GiB:.0f} GiB ({whose})"
    planner = Planner(config.plan, nvme_tier=config.memory.nvme_dir is not None, gradients=config.memory.gradients)
    # the plan the GPU run would start with: plan.policy (auto: solved), or plan.file's
    plan, _ = planner.initial(planner.resolve_policy(on_gpu=True), costs, adapter.num_layers, batch, seq)
    # the groups the first plan gives no host gradient buffer, as the trainer allocates them
    held = tuple(sorted(set(range(len(numels))) - host_grad_groups(plan, len(numels))))
    settings = dataclasses.replace(settings, held_grads=held)
    staging = 0
    if config.memory.nvme_dir:
        from lazytrain.runtime.profiler import NVME_STAGING_BUFFERS

        staging = NVME_STAGING_BUFFERS * max(lc.input_bytes for lc in costs.layers)
    activations = int(planner.predicted.get("predicted_act_host_gb", 0.0) * 1e9)
    host = budget.host_budget(numels, settings, activations=activations, staging=staging, limit=limit)
    if not trains_here:
        host.machine = limit  # the training machine's, not this one's
    ahead = PlanAhead(plan=plan, costs=costs, source=described, host=host, planner=planner, arch=adapter.arch,
                      num_params=sum(numels), fix=None if host.fits else budget.smallest_fix(numels, settings, host))
    if config.plan.batch_sweep:
        ahead.sweep, ahead.sweep_error = planner.sweep(costs, seq, config.plan.batch_sweep)
    return ahead


def _device_state_bytes_per_param(settings: budget.HostSettings, numels: list[int]) -> float | None:
    """What a parameter stepped on the GPU keeps there, its master and states, with the
    embedding's states as a profile measures it (`profiler.const_update_costs`); None where
    the optimizer has no GPU step (fp32 AdamW)."""
    if settings.optimizer_kind not in QUANTIZED_KINDS:
        return None
    states = budget.optimizer_bytes_per_param(settings.optimizer_kind, numels[:1],
                                              [0] if 0 in settings.fp32_groups else [])
    return states + MASTER_BYTES[settings.master]


def _table_device(path: str) -> str | None:
    """The device the table at ``path`` was profiled on (None where it cannot be read:
    `costs_from_file` then says what is wrong with it)."""
    try:
        return json.loads(Path(path).read_text()).get("device")
    except (OSError, ValueError, AttributeError):
        return None


def _measured(config: Config, adapter: ModelAdapter, batch: int, seq: int) -> tuple[CostTable, str]:
    """``plan.costs`` at this batch shape, checked against this model and optimizer; the
    elementwise ops and packed attention ``auto`` would choose on the training machine are taken
    as the table has them."""
    attention = "causal"
    if config.data.packing:
        attention = {"varlen": "packed_varlen", "mask": "packed"}.get(config.model.packed_attention)
    optimizer, chunk = describe_config(config.optimizer, config.state_rounding())
    table = costs_from_file(config.plan.costs, batch, seq, layer_types=adapter.layer_types, attention=attention,
                            elementwise=None if config.model.fused_ops == "auto" else config.model.fused_ops,
                            optimizer=optimizer, device_step_chunk=chunk)
    return table, f"plan.costs={config.plan.costs} (measured on {table.device})"

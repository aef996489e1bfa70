"""What every command builds from a config before it trains, profiles or plans.

`build_session` is the one place that turns the config into a device, a tokenizer, a
streamed model (adapter + host store), the CPU optimizer and the NVMe tier. Which plan runs
is the `Planner`'s (`Session.planner`, ``plan.*``); the session hands it what it measures (the
cost table: ``plan.costs`` or profiled now, this run's memory). ``lazytrain train``,
``profile`` and the benchmarks go through them; ``lazytrain plan`` builds no session
(`lazytrain.train.plan_ahead`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lazytrain.config import Config, ConfigError
from lazytrain.data.formats import existing_path
from lazytrain.data.pipeline import load_tokenizer
from lazytrain.memory import budget
from lazytrain.memory.host_store import HostStore, activation_room, grad_ring_bytes
from lazytrain.memory.nvme import NvmeStore
from lazytrain.memory.shard import ShardedHostStore, shard_decay_numel
from lazytrain.model.adapter import ModelAdapter
from lazytrain.model.build import build_model, init_device_of
from lazytrain.model.loading import check_model_folder
from lazytrain.optim.base import HostOptimizer
from lazytrain.optim.factory import (
    describe,
    fp32_state_groups,
    make_optimizer,
    state_bytes_per_param,
)
from lazytrain.plan.plan import Plan
from lazytrain.plan.planner import Planner, costs_from_file, keep_all_bytes, with_capacities
from lazytrain.runtime.device import (
    cap_gpu_memory,
    free_memory,
    prefer_expandable_segments,
    resolve_device,
    resolve_dtype,
    serial_compile,
)
from lazytrain.runtime.distributed import DataParallel, local_batch_size, rank_info_from_env

if TYPE_CHECKING:
    from lazytrain.plan.costs import CostTable
    from lazytrain.plan.policies import PolicyOptions

log = logging.getLogger(__name__)

GiB = 2**30


@dataclass(kw_only=True, slots=True)
class Session:
    config: Config
    device: torch.device
    dtype: torch.dtype
    tokenizer: Any
    adapter: ModelAdapter
    store: HostStore
    optimizer: HostOptimizer
    nvme: NvmeStore | None
    parallel: DataParallel | None = None
    """Launched by torchrun: this rank's process group; ``store`` is then a `ShardedHostStore`."""

    @property
    def batch_size(self) -> int:
        """Rows this process runs per step (the global batch over the data-parallel ranks)."""
        batch = self.config.training.batch_size
        return batch if self.parallel is None else local_batch_size(batch, self.parallel.world_size)

    def make_optimizer(self, masters: list[torch.Tensor], decay_numel: list[int]) -> HostOptimizer:
        """Another optimizer of the configured kind (the profiler times one on scratch groups)."""
        return make_optimizer(self.config.optimizer, masters, decay_numel, rounding=self.config.state_rounding())

    _planner: Planner | None = field(default=None, init=False, repr=False)

    @property
    def planner(self) -> Planner:
        """This run's planner (the ``plan`` section, for a data-parallel run or not, with an NVMe
        tier or not): the one place that decides which plan runs. Made at first use, which
        raises `ConfigError` for plan choices this run cannot make."""
        if self._planner is None:
            self._planner = Planner(self.config.plan, data_parallel=self.parallel is not None,
                                    nvme_tier=self.nvme is not None, gradients=self.config.memory.gradients)
        return self._planner

    def policy_options(self) -> PolicyOptions:
        """The ``plan`` section as the policies take it (`Planner.options`)."""
        return self.planner.options

    def host_memory(self, activations: int = 0, costs: CostTable | None = None) -> budget.HostBudget:
        """This run's host bytes per component, with ``activations`` bytes on the host tier (and,
        with an NVMe tier, its pinned staging buffers, sized by ``costs``' layer inputs)."""
        numels = [layout.numel for layout in self.adapter.layouts]
        staging = 0
        if self.nvme is not None and costs is not None:
            from lazytrain.runtime.profiler import NVME_STAGING_BUFFERS

            staging = NVME_STAGING_BUFFERS * max(lc.input_bytes for lc in costs.layers)
        settings = host_settings(self.config, self.device, self.dtype, len(numels))
        if self.store.host_grad_groups is not None:  # as the first plan allocated them
            held = tuple(g for g in range(len(numels)) if g not in self.store.host_grad_groups)
            settings = dataclasses.replace(settings, held_grads=held)
        return budget.host_budget(numels, settings, activations=activations, staging=staging,
                                  limit=host_limit_bytes(self.config))

    def cost_table(self) -> CostTable:
        """The cost table of ``plan.costs`` at the training shape (checked against this run),
        or one profiled now."""
        cfg = self.config
        batch, seq = self.batch_size, cfg.data.max_seq_len
        attention = "causal"  # padded rows take the causal path
        if cfg.data.packing:
            attention = "packed_varlen" if self.adapter.packed_attention == "varlen" else "packed"
        if cfg.plan.costs:
            costs = costs_from_file(cfg.plan.costs, batch, seq, layer_types=self.adapter.layer_types,
                                    attention=attention, elementwise=self.adapter.pointwise.kind,
                                    optimizer=describe(self.optimizer),
                                    device_step_chunk=self.optimizer.device_step_chunk)
            costs = self.for_this_run(costs)
        else:
            from lazytrain.runtime.profiler import profile

            info = self.parallel.info if self.parallel is not None else None
            costs = profile(
                self.adapter, self.store, self.device, batch, seq, self.make_optimizer,
                gpu_bytes=int(cfg.memory.gpu_gb * GiB) if cfg.memory.gpu_gb else None,
                optimizer_state_bytes=self.optimizer.state_bytes(),
                head_chunk_tokens=cfg.plan.head_chunk_tokens,
                nvme=self.nvme,
                host_limit_bytes=host_limit_bytes(cfg),
                attention=attention,
                **({"local_world_size": info.local_world_size, "barrier": self.parallel.barrier} if info else {}),
            )
        if self.parallel is not None:
            # one rank's table: the host's ranks share its PCIe host side and cores
            costs = costs.for_ranks(self.parallel.info.world_size, self.parallel.info.local_world_size)
        return self.with_placed_gradients(costs)

    def with_placed_gradients(self, costs: CostTable) -> CostTable:
        """``costs`` for a plan that places the decoder layers' gradients (``memory.gradients``
        auto or gpu; `CostTable.host_grads` False), before the first plan has allocated the host
        buffers: the room for host activations and the decoder layers' buffers (this rank's) is
        the budget less the state with only the buffers every plan allocates (the embedding's and
        head's, and the pinned ring that brings held gradients home), and the memory available
        less those; the plan then puts each layer's buffer in that room or holds the gradient on
        the GPU. Unchanged otherwise. (Measured afresh, not as the table's room plus the layers'
        buffers: that room is floored at 0, and where the state with every buffer is over the
        budget, as at 27B, the sum would promise the plan memory the host does not have.)"""
        if not self.planner.places_gradients or self.store.host_grad_groups is not None:
            return costs
        state = self.store.bytes(self.optimizer.state_bytes())  # (every group's buffer counted)
        sizes, dtype = self.store.grad_sizes, self.store.dtype
        kept = (sizes[0] + sizes[-1]) * dtype.itemsize + grad_ring_bytes(max(sizes[1:-1], default=0), dtype)
        room = self._activation_room(state.total - state.grads + kept, costs, pending=kept)
        return with_capacities(costs, host_bytes=room, host_grads=False)

    def for_this_run(self, costs: CostTable) -> CostTable:
        """A saved table with this run's capacities: the room for host activations is this
        run's (`activation_room`: its model state, its host budget, the memory available now),
        not the profiled one's; the GPU is ``memory.gpu_gb`` when set."""
        if self.parallel is not None:
            self.parallel.barrier()  # every rank's state allocated before the memory available is read
        # this rank's model state and, with an NVMe tier, its staging buffers, as the profiler counts them
        room = self._activation_room(self.store.bytes(self.optimizer.state_bytes()).total, costs)
        return with_capacities(costs, host_bytes=room, gpu_gb=self.config.memory.gpu_gb)

    def _activation_room(self, state: int, costs: CostTable, pending: int = 0) -> int:
        """`activation_room` for this rank's ``state`` bytes (``pending`` of them not allocated
        yet), its share of the host, with an NVMe tier less its staging buffers (sized by
        ``costs``)."""
        ranks = self.parallel.info.local_world_size if self.parallel is not None else 1
        return activation_room(state, host_limit_bytes(self.config), ranks, self.host_memory(costs=costs).staging,
                               pending)

    def plan(self) -> tuple[Plan, CostTable | None]:
        """The plan to run and, where there is one, the cost table it is predicted with (the
        planner's first plan: `Planner.initial`)."""
        planner, batch, seq = self.planner, self.batch_size, self.config.data.max_seq_len
        on_gpu = self.device.type == "cuda"
        policy = planner.resolve_policy(
            on_gpu=on_gpu, keep_all_bytes=keep_all_bytes(self.adapter.hidden_size, self.adapter.num_layers, batch, seq,
                                                         self.dtype.itemsize),
            free_bytes=0 if on_gpu else free_memory(self.device))
        costs = self.cost_table() if planner.needs_costs(policy) else None
        plan, _ = planner.initial(policy, costs, self.adapter.num_layers, batch, seq)
        return plan, costs


def host_limit_bytes(config: Config) -> int | None:
    return int(config.memory.host_limit_gb * GiB) if config.memory.host_limit_gb else None


def resolve_master(config: Config, device: torch.device, dtype: torch.dtype, distributed: bool = False) -> str:
    """memory.master resolved to fp32, split or bf16 (memory.split_master, its deprecated alias,
    folded in): auto is split for bf16 runs on a GPU, else fp32, and fp32 under torchrun (a
    rank's shard of the masters is fp32: neither the split nor the bf16 master is sharded yet)."""
    choice = config.memory.master_setting()
    if choice in ("split", "bf16") and dtype != torch.bfloat16:
        raise ConfigError(
            f"memory.master={choice} keeps the master in the streamed bf16 weights, this run computes in {dtype} "
            "(fp32 weights already are the masters' precision); set model.dtype=bf16, or memory.master=auto or fp32"
        )
    if choice in ("split", "bf16") and distributed:
        raise ConfigError(
            f"memory.master={choice} is not supported under torchrun yet (each rank keeps an fp32 shard of the "
            "masters); set memory.master=auto or fp32"
        )
    if choice == "auto":
        return "split" if not distributed and dtype == torch.bfloat16 and device.type == "cuda" else "fp32"
    return choice


def host_settings(config: Config, device: torch.device, dtype: torch.dtype, num_groups: int) -> budget.HostSettings:
    """The choices that set the model state's host bytes; with ``memory.gradients`` gpu, or
    auto for the solved plan (``plan.policy`` auto or solved) or a plan file, every decoder
    layer's gradient held on the GPU (for auto the least host memory a plan can need: the plan
    then places each one within what is left). A baseline policy holds none under auto
    (`policies.baseline_plan`)."""
    distributed = rank_info_from_env() is not None
    baseline = None if config.plan.policy in ("auto", "solved") else config.plan.policy  # plan.file: auto
    settings = budget.HostSettings(dtype=dtype, master=resolve_master(config, device, dtype, distributed),
                                   optimizer_kind=config.optimizer.kind,
                                   fp32_groups=fp32_state_groups(config.optimizer, num_groups),
                                   baseline_policy=baseline)
    gradients = config.memory.gradients
    held = gradients == "gpu" or (gradients == "auto" and baseline is None)
    return settings.holding_layer_grads(num_groups) if held else settings


def check_inputs(config: Config) -> None:
    """The model folder and the data path, checked in milliseconds before anything is loaded
    and before the output folder's state is looked at: a missing model or data file is the
    error a user must see first."""
    if not config.model.source.startswith("builtin:"):
        check_model_folder(config.model.source)
    if config.data.dataset != "builtin":
        existing_path(config.data.dataset)


def build_session(config: Config) -> Session:
    """Device, tokenizer, model in host memory, optimizer and NVMe tier for ``config``.

    The model folder is checked before anything else is loaded; host memory is counted before
    anything is allocated (a model that does not fit fails with the bytes per component).
    """
    prefer_expandable_segments()
    serial_compile()
    torch.manual_seed(config.training.seed)
    source = config.model.source
    if not source.startswith("builtin:"):
        check_model_folder(source)  # before tokenizer and data, whose errors would mislead
    device = resolve_device(config.training.device)
    info = rank_info_from_env()
    parallel = None
    if info is not None:  # launched by torchrun: one rank of a data-parallel run
        local_batch_size(config.training.batch_size, info.world_size)  # divisible, or a clear error
        if device.type == "cuda":
            device = torch.device("cuda", info.local_rank)
            torch.cuda.set_device(device)
        parallel = DataParallel(info, device)
    dtype = resolve_dtype(config.model.dtype, device)
    tokenizer = load_tokenizer(source)

    def preflight(numels: list[int]) -> None:
        """Before allocating: the model state against the host budget (raises, naming the
        smallest change that fits, when it does not)."""
        settings = host_settings(config, device, dtype, len(numels))
        need = budget.host_budget(numels, settings, limit=host_limit_bytes(config))
        log.info("host memory, model state (before the plan):\n%s", need.table())
        budget.check_host_fit(numels, settings, need)

    adapter, store = build_model(
        source, device, dtype, seed=config.training.seed, vocab_size=len(tokenizer), pin=config.memory.pin,
        optimizer_bytes_per_param=lambda numels: state_bytes_per_param(config.optimizer, numels),
        host_limit_bytes=host_limit_bytes(config),
        master=resolve_master(config, device, dtype, distributed=parallel is not None),
        preflight=preflight, lean_ops=config.model.lean_ops, fused_ops=config.model.fused_ops,
        packed_attention=config.model.packed_attention,
        init_device=init_device_of(config.model.init_device),
        # the gradient buffers wait for the first plan, which may hold some on the GPU (`Trainer`);
        # a rank's too (`sharded_store_factory`)
        store_factory=(partial(HostStore, defer_grads=True) if parallel is None
                       else sharded_store_factory(parallel, config)),
    )
    if config.memory.gpu_gb:
        cap_gpu_memory(device, config.memory.gpu_gb)
    decay = [g.decay_numel for g in adapter.layouts]
    started = time.perf_counter()
    rounding = config.state_rounding()
    if store.master_mode == "bf16":
        log.info("masters: the bf16 weights themselves, updated with stochastic rounding (memory.master=bf16: "
                 "0 B/param, not exact)")
    if config.optimizer.kind in ("hybrid8bit", "hybrid4bit"):
        four = config.optimizer.kind == "hybrid4bit"
        log.info("%s states: %s rounded to the %s code (optimizer.state_rounding=%s)",
                 "4-bit" if four else "8-bit", "m and sqrt(v)" if four else "sqrt(v)",
                 "stochastically drawn" if rounding == "stochastic" else "nearest", config.optimizer.state_rounding)
    if parallel is None:
        optimizer = make_optimizer(config.optimizer, store.masters, decay, seed=config.training.seed,
                                   rounding=rounding)
    else:
        parallel.barrier()  # local rank 0 has written the shared weights
        optimizer = make_optimizer(config.optimizer, store.masters,
                                   [shard_decay_numel(d, r) for d, r in zip(decay, store.ranges)],
                                   group_numels=[g.numel for g in adapter.layouts],
                                   group_offsets=[r.start for r in store.ranges], seed=config.training.seed,
                                   rounding=rounding)
    store.build_seconds["optimizer"] = time.perf_counter() - started
    log.info("model built: %s", ", ".join(f"{k} {v:.1f} s" for k, v in store.build_seconds.items()))
    nvme = NvmeStore(config.memory.nvme_dir) if config.memory.nvme_dir else None
    return Session(config=config, device=device, dtype=dtype, tokenizer=tokenizer, adapter=adapter,
                   store=store, optimizer=optimizer, nvme=nvme, parallel=parallel)


def sharded_store_factory(parallel: DataParallel, config: Config):
    """``build_model``'s store for a data-parallel rank: the host's shared weights (an arena in
    ``memory.shm_dir``), this rank's shards of the rest."""
    info = parallel.info
    path = Path(config.memory.shm_dir) / f"lazytrain-{parallel.run_id}-host{info.node_rank}.weights"
    return partial(
        ShardedHostStore, rank=info.rank, world_size=info.world_size, local_rank=info.local_rank,
        local_world_size=info.local_world_size, arena_path=path, barrier=parallel.barrier, defer_grads=True,
    )

"""The SFT recipe: config -> data -> plan -> executor -> CPU optimizer -> metrics, checkpoints.

One ``Trainer`` per run: ``setup()`` builds everything, ``train()`` is the loop, and the
output folder ends as an HF model folder (config, safetensors, tokenizer) plus the resolved
LazyTrain config, the prompt template and ``metrics.jsonl``. A ``checkpoint/`` folder in it
holds what ``training.resume=true`` needs to continue exactly where the run stopped.

Launched by ``torchrun`` (one process per GPU) the same recipe runs data parallel: each rank
trains on its rows of every global batch with the host state sharded (``memory.shard``,
``runtime.distributed``); rank 0 alone writes logs, metrics and the model folder, and every
rank writes its shard of the checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from functools import partial
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from lazytrain.config import Config
from lazytrain.data.dataset import BatchConfig, BatchIterator, tokenize_samples
from lazytrain.data.formats import DataSource, load_samples
from lazytrain.data.synthetic import make_samples
from lazytrain.data.template import PromptTemplate, get_template
from lazytrain.data.tokenizer import builtin_tokenizer
from lazytrain.memory.nvme import NvmeStore
from lazytrain.memory.shard import ShardedHostStore, shard_decay_numel
from lazytrain.model.build import build_model, resolve_dtype
from lazytrain.model.flops import flops_6nt, model_flops
from lazytrain.model.loading import save_hf
from lazytrain.optim.adamw import FusedAdamW
from lazytrain.optim.base import HostOptimizer
from lazytrain.plan.costs import CostTable, usable_gpu_bytes
from lazytrain.plan.plan import Plan, checkpoint_all_plan, keep_all_plan, megatrain_plan
from lazytrain.runtime.distributed import DataParallel, local_batch_size, rank_info_from_env
from lazytrain.runtime.executor import Executor
from lazytrain.runtime.streams import prefer_expandable_segments
from lazytrain.runtime.update import HostUpdater
from lazytrain.train.metrics import MetricsWriter, gpu_memory, host_rss_bytes
from lazytrain.train.schedule import learning_rate
from lazytrain.train.shard_checkpoint import check_world_size, shard_file_names

log = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"training.device={name} but CUDA is not available; use training.device=cpu")
    return device


def load_tokenizer(source: str):
    if source.startswith("builtin:"):
        return builtin_tokenizer()
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as e:
        raise ValueError(f"no tokenizer could be loaded from {source}: {e}") from None


def keep_all_bytes(adapter, batch: int, seq_len: int, dtype_bytes: int) -> int:
    """Activations keep_all holds: ~56 hidden-sized values per token and layer (measured on
    Qwen2.5-7B at bf16: 0.2 MB per token per layer)."""
    return 56 * adapter.hidden_size * dtype_bytes * batch * seq_len * adapter.num_layers


def device_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    from lazytrain.memory.host_store import host_memory_total

    return host_memory_total() // 4


def make_plan(config: Config, adapter, seq_len: int, device: torch.device, dtype: torch.dtype) -> Plan:
    pc, batch = config.plan, config.training.batch_size
    num_layers = adapter.num_layers
    if pc.policy == "auto":
        need = keep_all_bytes(adapter, batch, seq_len, torch.empty((), dtype=dtype).element_size())
        policy = "keep_all" if need < device_memory(device) // 2 else "megatrain"
        log.info("plan.policy=auto: %s (keep_all would hold ~%.1f GiB of activations)", policy, need / 2**30)
        pc = dataclasses.replace(pc, policy=policy)
    if pc.policy == "megatrain":
        return megatrain_plan(num_layers, batch, seq_len, pc.megatrain_every, pc.head_chunk_tokens)
    if pc.policy == "keep_all":
        return keep_all_plan(num_layers, batch, seq_len, pc.head_chunk_tokens)
    if pc.policy == "checkpoint_all":
        return checkpoint_all_plan(num_layers, batch, seq_len, pc.checkpoint_tier, pc.head_chunk_tokens)
    path = Path(pc.policy)
    if not path.exists():
        raise ValueError(
            f"plan.policy={pc.policy!r} is neither auto, megatrain, keep_all, checkpoint_all nor an "
            "existing plan.json"
        )
    plan = Plan.load(path)
    plan.weight_prefetch = pc.weight_prefetch
    return plan


def solved_plan(config: Config, costs: CostTable) -> Plan:
    """The MILP's plan for ``costs``: GPU and pinned-host tiers, and NVMe with ``memory.nvme_dir``."""
    from lazytrain.plan.milp import solve_plan

    tiers = ("gpu", "host", "nvme") if config.memory.nvme_dir else ("gpu", "host")
    plan = solve_plan(
        costs, gpu_bytes=costs.gpu_bytes, tiers=tiers,
        optimizer_overlap=config.plan.overlap_optimizer, head_chunk_tokens=config.plan.head_chunk_tokens,
    )
    plan.weight_prefetch = config.plan.weight_prefetch
    return plan


def prediction(plan: Plan, costs: CostTable, overlap: bool) -> dict[str, float]:
    """The simulator's step for ``plan``, as the per-step metrics name the measured figures."""
    from lazytrain.plan.simulate import simulate

    sim = simulate(plan, costs, optimizer_overlap=overlap)
    e = sim.exposed_s
    return {
        "predicted_step_time_s": sim.step_time_s,
        "predicted_gpu_compute_s": e["compute"],
        "predicted_exposed_h2d_s": e["h2d"],
        "predicted_exposed_d2h_s": e["d2h"],
        # the trace sees no NVMe or CPU stream: their waits are GPU idle without a copy
        "predicted_gpu_idle_other_s": e["cpu"] + e["nvme"] + e["idle"],
        "predicted_peak_gpu_gb": sim.peak_gpu_bytes / 1e9,
        "predicted_act_host_gb": sim.peak_host_bytes / 1e9,
        "predicted_act_nvme_gb": sim.peak_nvme_bytes / 1e9,
    }


def measured_streams(stats, trace: dict[str, float]) -> dict[str, float]:
    """Per-step stream figures from the executor's trace (GPU only) and its activation peaks."""
    out = {f"act_{tier}_gb": nbytes / 1e9 for tier, nbytes in stats.peak_activation_bytes.items()}
    if trace:
        out.update({
            "gpu_compute_s": trace["compute_ms"] / 1e3,
            "exposed_h2d_s": trace["h2d_exposed_ms"] / 1e3,
            "exposed_d2h_s": trace["d2h_exposed_ms"] / 1e3,
            "gpu_idle_other_s": trace["other_idle_ms"] / 1e3,
        })
    return out


def fp32_state_groups(config: Config, num_groups: int) -> tuple[int, ...]:
    """Groups whose states stay fp32 under hybrid8bit: the embedding (first) and final (last) ones."""
    return (0, num_groups - 1) if config.optimizer.fp32_embedding_states else ()


def optimizer_bytes_per_param(config: Config, numels: list[int]) -> float:
    if config.optimizer.kind != "hybrid8bit":
        return 8.0
    from lazytrain.optim.hybrid8bit import state_bytes_per_param

    return state_bytes_per_param(numels, fp32_state_groups(config, len(numels)))


def make_optimizer(
    config: Config, masters: list[torch.Tensor], decay_numel: list[int], group_numels: list[int] | None = None
) -> HostOptimizer:
    """The configured optimizer over ``masters``; ``group_numels`` are the whole groups' sizes
    when the masters are a data-parallel rank's shards."""
    oc = config.optimizer
    if oc.kind == "hybrid8bit":
        from lazytrain.optim.hybrid8bit import Hybrid8bitAdamW

        return Hybrid8bitAdamW(masters, decay_numel, oc, fp32_groups=fp32_state_groups(config, len(masters)),
                               group_numels=group_numels)
    return FusedAdamW(masters, decay_numel, oc)


class Trainer:
    """Full-parameter SFT of a streamed model.

    Raises at setup for: an unsupported architecture or a missing model folder, host memory
    that cannot hold the model (with the bytes), data that is empty after truncation, and a
    plan that does not match the model's layer count.
    """

    def __init__(self, config: Config):
        self.config = config
        self.out_dir = Path(config.training.output_dir)
        self.step = 0
        self.skipped_steps = 0

    # -- setup ------------------------------------------------------------------------------

    def setup(self) -> None:
        cfg = self.config
        prefer_expandable_segments()
        if cfg.training.eval_every and cfg.data.dataset != "builtin":
            raise ValueError(
                "training.eval_every needs held-out data, which only the built-in data has here; "
                "set training.eval_every=0 and run `lazytrain eval --model OUT --data FILE`"
            )
        torch.manual_seed(cfg.training.seed)
        self.device = resolve_device(cfg.training.device)
        info = rank_info_from_env()
        self.parallel = None
        # the plan, the profile and the executor see this rank's rows of the global batch
        self.plan_config = cfg
        if info is not None:
            local = local_batch_size(cfg.training.batch_size, info.world_size)
            if self.device.type == "cuda":
                self.device = torch.device("cuda", info.local_rank)
                torch.cuda.set_device(self.device)
            self.parallel = DataParallel(info, self.device)
            self.plan_config = dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, batch_size=local))
        self.is_main = info is None or info.is_main
        if not self.is_main:
            logging.getLogger("lazytrain").setLevel(logging.WARNING)  # rank 0 logs
        self.dtype = resolve_dtype(cfg.model.dtype, self.device)
        self.tokenizer = load_tokenizer(cfg.model.source)
        self.template = self._template()
        self.batches = self._data()
        self.adapter, self.store = build_model(
            cfg.model.source, self.device, self.dtype,
            seed=cfg.training.seed, vocab_size=len(self.tokenizer), pin=cfg.memory.pin,
            optimizer_bytes_per_param=lambda numels: optimizer_bytes_per_param(cfg, numels),
            host_limit_bytes=int(cfg.memory.host_limit_gb * 2**30) if cfg.memory.host_limit_gb else None,
            **({"store_factory": self._sharded_store_factory()} if self.parallel else {}),
        )
        if self.parallel is not None:
            self.parallel.barrier()  # local rank 0 has written the shared weights
        if cfg.memory.gpu_gb and self.device.type == "cuda":
            total = torch.cuda.get_device_properties(self.device).total_memory
            # the device needs an index here (torch 2.11 rejects a bare 'cuda')
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            torch.cuda.set_per_process_memory_fraction(min(1.0, cfg.memory.gpu_gb * 2**30 / total), index)
        decay = [layout.decay_numel for layout in self.adapter.layouts]
        if self.parallel is None:
            self.optimizer = make_optimizer(cfg, self.store.masters, decay)
        else:
            shard_decay = [shard_decay_numel(d, r) for d, r in zip(decay, self.store.ranges)]
            self.optimizer = make_optimizer(cfg, self.store.masters, shard_decay,
                                            [layout.numel for layout in self.adapter.layouts])
        self.nvme = NvmeStore(cfg.memory.nvme_dir) if cfg.memory.nvme_dir else None
        policy = cfg.plan.policy
        if policy == "auto" and self.device.type == "cuda":
            policy = "solved"
        self.costs = None
        if policy == "solved":
            self.costs = self.cost_table()
            self.plan = solved_plan(self.plan_config, self.costs)
        else:
            self.plan = make_plan(self.plan_config, self.adapter, cfg.data.max_seq_len, self.device, self.dtype)
            if cfg.plan.costs:
                self.costs = self.cost_table()
        # what the planner predicts for this plan, logged beside the measured figures each step
        self.predicted = (prediction(self.plan, self.costs, cfg.plan.overlap_optimizer)
                          if self.costs is not None else {"predicted_step_time_s": self.plan.predicted_step_time_s})
        self.executor = Executor(self.adapter, self.store, self.plan, self.device, nvme=self.nvme,
                                 parallel=self.parallel)
        self.executor.trace.enabled = self.device.type == "cuda"
        self.updater = HostUpdater(self.executor, self.optimizer, overlap=cfg.plan.overlap_optimizer)
        if cfg.training.resume and (self.out_dir / "checkpoint").exists():
            self._load_checkpoint(self.out_dir / "checkpoint")
        self.metrics = MetricsWriter(self.out_dir, append=self.step > 0) if self.is_main else None
        if self.is_main:
            cfg.save(self.out_dir / "lazytrain_config.yaml")
            self.template.save(self.out_dir)

    def _sharded_store_factory(self):
        """``build_model``'s store for this rank: the host's shared weights, this rank's shards."""
        info, cfg = self.parallel.info, self.config
        path = Path(cfg.memory.shm_dir) / f"lazytrain-{self.parallel.run_id}-host{info.node_rank}.weights"
        return partial(
            ShardedHostStore, rank=info.rank, world_size=info.world_size, local_rank=info.local_rank,
            local_world_size=info.local_world_size, arena_path=path, barrier=self.parallel.barrier,
        )

    def cost_table(self) -> CostTable:
        """The cost table of ``plan.costs``, or one profiled now at the training shape."""
        cfg = self.plan_config
        if cfg.plan.costs:
            costs = CostTable.load(cfg.plan.costs).at(cfg.training.batch_size, cfg.data.max_seq_len)
            if cfg.memory.gpu_gb:
                costs = dataclasses.replace(costs, gpu_bytes=usable_gpu_bytes(int(cfg.memory.gpu_gb * 2**30)))
            return self._per_rank(costs)
        from lazytrain.runtime.profiler import profile

        info = self.parallel.info if self.parallel is not None else None
        return self._per_rank(profile(
            self.adapter, self.store, self.device, cfg.training.batch_size, cfg.data.max_seq_len,
            lambda masters, decay: make_optimizer(cfg, masters, decay),
            gpu_bytes=int(cfg.memory.gpu_gb * 2**30) if cfg.memory.gpu_gb else None,
            optimizer_state_bytes=self.optimizer.state_bytes(),
            head_chunk_tokens=cfg.plan.head_chunk_tokens,
            nvme=self.nvme,
            **({"local_world_size": info.local_world_size, "barrier": self.parallel.barrier} if info else {}),
        ))

    def _per_rank(self, costs: CostTable) -> CostTable:
        if self.parallel is None:
            return costs
        return costs.for_ranks(self.parallel.info.world_size, self.parallel.info.local_world_size)

    def _template(self) -> PromptTemplate:
        name = self.config.data.template
        if name == "auto":
            name = "compact" if self.config.data.dataset == "builtin" else "alpaca"
        return get_template(name)

    def _data(self) -> BatchIterator:
        dc, tc = self.config.data, self.config.training
        if dc.dataset == "builtin":
            samples = make_samples("train", dc.builtin_train_size, seed=tc.seed, tier=dc.builtin_tier)
        else:
            samples = load_samples(
                DataSource(path=dc.dataset, format=dc.format, prompt_field=dc.prompt_field,
                           response_field=dc.response_field)
            )
        dataset = tokenize_samples(samples, self.tokenizer, self.template, dc.max_seq_len)
        log.info("data: %s", dataset.report.summary())
        self.data_report = dataset.report
        return BatchIterator(
            dataset=dataset,
            config=BatchConfig(batch_size=tc.batch_size, seed=tc.seed, drop_last=True,
                               pad_to_multiple_of=8 if self.device.type == "cuda" else 1),
        )

    # -- the loop ---------------------------------------------------------------------------

    def train(self) -> dict:
        cfg = self.config
        tc, oc = cfg.training, cfg.optimizer
        bar = tqdm(total=tc.steps, initial=self.step, disable=not (tc.progress and self.is_main), desc="train",
                   dynamic_ncols=True)
        last = None
        t_prev = time.perf_counter()
        while self.step < tc.steps:
            batch = next(self.batches)
            if self.parallel is not None:
                batch = self.parallel.local_rows(batch)
            stats = self.executor.forward_backward(batch.input_ids, batch.labels, batch.attention_mask)
            streams = measured_streams(stats, self.executor.trace.summary())
            waited = self.updater.wait_seconds  # this forward waiting for the last CPU update
            lr = learning_rate(self.step, tc.steps, oc.lr, oc.warmup_steps, oc.schedule, oc.min_lr_ratio)
            if not math.isfinite(stats.grad_norm) or not math.isfinite(stats.loss):
                # a non-finite gradient: no state is touched, the step is counted and logged
                self.skipped_steps += 1
                clip = None
            else:
                clip = 1.0
                if tc.max_grad_norm > 0:
                    clip = min(1.0, tc.max_grad_norm / (stats.grad_norm + 1e-6))
                self.updater.start(clip, lr)
            self.step += 1
            now = time.perf_counter()
            step_time, t_prev = now - t_prev, now
            seq = batch.input_ids.shape[1]
            last = {
                "step": self.step,
                "loss": stats.loss,
                "grad_norm": stats.grad_norm,
                "lr": lr,
                "skipped": clip is None,
                "tokens": stats.num_tokens,
                "target_tokens": stats.num_target_tokens,
                "batch_size": int(batch.input_ids.shape[0]),
                "seq_len": seq,
                "step_time_s": step_time,
                "tokens_per_s": stats.num_tokens / step_time,
                "tflops_model": model_flops(self.adapter, stats.num_tokens, seq) / step_time / 1e12,
                "tflops_6nt": flops_6nt(self.adapter, stats.num_tokens) / step_time / 1e12,
                **self.predicted,
                **streams,
                "optimizer_wait_s": waited,
                "h2d_weight_gb": stats.h2d_weight_bytes / 1e9,
                "host_rss_gb": host_rss_bytes() / 1e9,
                **gpu_memory(self.device),
            }
            if self.is_main:
                self.metrics.write(last)
            bar.update(1)
            bar.set_postfix(loss=f"{stats.loss:.4f}", gnorm=f"{stats.grad_norm:.2f}",
                            tok_s=f"{last['tokens_per_s']:.0f}")
            if tc.log_every and self.step % tc.log_every == 0 and not tc.progress and self.is_main:
                log.info("step %d loss %.4f grad_norm %.3f %.0f tok/s", self.step, stats.loss,
                         stats.grad_norm, last["tokens_per_s"])
            if tc.save_every and self.step % tc.save_every == 0 and self.step < tc.steps:
                self.save_checkpoint()
            if tc.eval_every and self.step % tc.eval_every == 0 and self.step < tc.steps and self.is_main:
                self.metrics.write({"step": self.step, **self._eval_metrics()})
        bar.close()
        self.updater.finish()
        if self.is_main:
            self.save_model(self.out_dir)
        self.save_checkpoint()
        final_eval = None
        if self.is_main and (self.config.data.dataset == "builtin" or tc.eval_every):
            final_eval = self._eval_metrics()
            self.metrics.write({"step": self.step, **final_eval})
        if self.is_main:
            self.metrics.close()
        if self.parallel is not None:
            self.parallel.close()
        return {"steps": self.step, "skipped_steps": self.skipped_steps, "last": last, "eval": final_eval}

    def _eval_metrics(self) -> dict:
        """Exact match on held-out data, generating with the weights in the host store."""
        from lazytrain.eval.evaluate import exact_match
        from lazytrain.eval.generate import generate_streamed

        self.updater.finish()
        dc = self.config.data
        samples = make_samples("heldout", dc.heldout_size, seed=self.config.training.seed,
                               tier=dc.builtin_tier)
        tok = self.tokenizer
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

        def run(batch):
            return generate_streamed(self.adapter, self.store, batch, 64, pad, tok.eos_token_id)

        report, _ = exact_match(samples, tok, self.template, run, batch_size=100, desc="eval")
        return {"eval_exact_match": report["accuracy"], "eval_no_answer": report["no_answer"],
                "eval_samples": report["n"]}

    # -- outputs ----------------------------------------------------------------------------

    def save_model(self, out_dir: Path) -> None:
        """An HF model folder: config, safetensors (bf16), tokenizer, prompt template."""
        self.updater.finish()
        # data parallel: the masters are shards; the shared weights hold all of them, rounded
        # to the model dtype, which is what is written
        save_hf(self.adapter, self.store, out_dir, dtype=torch.bfloat16 if self.dtype == torch.bfloat16 else torch.float32,
                groups=self.store.weights if self.parallel is not None else None)
        self.tokenizer.save_pretrained(out_dir)
        self.template.save(out_dir)

    def _rank_world(self) -> tuple[int, int]:
        return (self.parallel.rank, self.parallel.world_size) if self.parallel is not None else (0, 1)

    def save_checkpoint(self) -> None:
        """Masters, optimizer state, data position and step: what resume needs. Data
        parallel: every rank writes its shards, rank 0 the step and data position."""
        self.updater.finish()
        ckpt = self.out_dir / "checkpoint"
        tmp = self.out_dir / "checkpoint.tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        rank, world = self._rank_world()
        masters_name, optimizer_name = shard_file_names(rank, world)
        save_file({f"g{g}": m.contiguous() for g, m in enumerate(self.store.masters)}, str(tmp / masters_name))
        torch.save(self.optimizer.state_dict(), tmp / optimizer_name)
        if self.is_main:
            (tmp / "state.json").write_text(json.dumps({
                "step": self.step,
                "skipped_steps": self.skipped_steps,
                "data": self.batches.state_dict(),
                "num_params": self.store.num_params,
                "world_size": world,
            }))
        if self.parallel is not None:
            self.parallel.barrier()  # every shard is written
        if self.is_main:
            if ckpt.exists():
                for f in ckpt.iterdir():
                    f.unlink()
                ckpt.rmdir()
            tmp.rename(ckpt)
        if self.parallel is not None:
            self.parallel.barrier()

    def _load_checkpoint(self, ckpt: Path) -> None:
        state = json.loads((ckpt / "state.json").read_text())
        if state["num_params"] != self.store.num_params:
            raise ValueError(
                f"checkpoint {ckpt} is of a model with {state['num_params']} parameters, this "
                f"model has {self.store.num_params}; use another training.output_dir"
            )
        rank, world = self._rank_world()
        check_world_size(state, world, ckpt)
        masters_name, optimizer_name = shard_file_names(rank, world)
        masters = load_file(str(ckpt / masters_name))
        for g, m in enumerate(self.store.masters):
            m.copy_(masters[f"g{g}"])
            self.store.sync_weights_from_masters(g)
            if self.parallel is not None:
                self.parallel.publish(self.store, g)  # the other ranks' shards of the weights
            self.executor.weights_updated(g)
        self.optimizer.load_state_dict(torch.load(ckpt / optimizer_name, weights_only=False))
        self.batches.load_state_dict(state["data"])
        self.step = state["step"]
        self.skipped_steps = state["skipped_steps"]

"""One trainer, one model shape, one batch: what a worker process of ``bench/peers.py`` runs.

Every runner trains the same thing: the built-in shape's HF model with LazyTrain's random init
of the same seed (`random_init_values`: the host store of ``lazytrain`` and the peers' models
get the same weights), on the batches of `bench.common.random_batch` (seed = step number),
AdamW with lr 1e-5, betas (0.9, 0.999), eps 1e-8, no weight decay, the global gradient norm
clipped to 1.0, every decoder layer's activations checkpointed (recomputed in backward), and
the LM head and loss computed over chunks of tokens (`ChunkedLossModel`, as LazyTrain's
executor does: the full ``tokens x vocab`` logits of batch 64 x 1024 would need ~100 GB of GPU
memory on their own, so without chunking every peer would be measured on its loss, not its
offload), and CUDA's caching allocator with expandable segments (LazyTrain's setting).

- ``lazytrain``: `bench.common.timed_steps` on the solved plan (the MILP on a profiled cost
  table), 8-bit or fp32 Adam states;
- ``deepspeed_zero3_offload``: ZeRO-3, parameters and optimizer offloaded to pinned CPU
  memory, DeepSpeed's CPU Adam (AdamW mode), bf16;
- ``fsdp2_cpu_offload``: ``fully_shard`` per decoder layer and the root, `CPUOffloadPolicy`,
  bf16 parameters in compute (fp32 reduce), torch's fused CPU AdamW on the fp32 parameters;
- ``pytorch_gpu``: everything on the GPU (fp32 parameters, gradients and states, bf16 autocast,
  fused AdamW): the no-offload ceiling where the model fits.

A runner returns one record: the measured figures (DESIGN.md section 6 names) or a ``status``
that says why there are none.
"""

from __future__ import annotations

import itertools
import os
import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import transformers
from torch.utils.checkpoint import checkpoint

from bench.common import bench_session, random_batch, run_header, timed_steps
from lazytrain.data.pipeline import load_tokenizer
from lazytrain.errors import LazyTrainError
from lazytrain.memory.host_store import HostMemoryError
from lazytrain.model.adapter import ModelAdapter
from lazytrain.model.build import model_config
from lazytrain.model.flops import flops_6nt, model_flops, moe_flops
from lazytrain.model.loading import random_init_values
from lazytrain.plan.milp import PlanInfeasible
from lazytrain.plan.search import search_batch
from lazytrain.plan.simulate import simulate
from lazytrain.runtime.device import prefer_expandable_segments

LR, BETAS, EPS, MAX_GRAD_NORM = 1e-5, (0.9, 0.999), 1e-8, 1.0
RUNNERS = ("lazytrain", "deepspeed_zero3_offload", "fsdp2_cpu_offload", "pytorch_gpu")
GB = 1e9


@dataclass(kw_only=True, slots=True)
class Job:
    """One worker's run."""

    run: str
    """``lazytrain:hybrid8bit``, ``lazytrain:fp32`` or a peer's runner name."""
    model: str
    batch: int
    seq: int
    warmup: int
    steps: int
    device: str
    seed: int
    head_chunk: int
    pin_memory: bool
    """FSDP2's `CPUOffloadPolicy(pin_memory=...)`, decided by the parent from the host budget."""
    host_limit_gb: float | None = None
    """LazyTrain's ``memory.host_limit_gb``: the room the parent's watchdog leaves (GiB)."""
    planner_max_batch_limit: int = 0
    """LazyTrain: find the planner's largest batch up to this (0: not; ~25 s of MILPs at 9B)."""

    @property
    def runner(self) -> str:
        return self.run.partition(":")[0]


class ChunkedLossModel(torch.nn.Module):
    """The HF decoder, then LM head + cross-entropy over ``chunk`` tokens at a time, each chunk
    recomputed in backward: the mean over every next-token target, as LazyTrain's loss.

    The head runs inside this module's forward so that ZeRO-3's and FSDP2's hooks gather its
    weight (the root module owns the embedding, final norm and head)."""

    def __init__(self, lm: transformers.PreTrainedModel, chunk: int):
        super().__init__()
        self.lm = lm
        self.chunk = chunk

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        hidden = self.lm.model(input_ids=input_ids, use_cache=False).last_hidden_state
        hidden = hidden[:, :-1].reshape(-1, hidden.shape[-1])
        targets = labels[:, 1:].reshape(-1)
        total = hidden.new_zeros((), dtype=torch.float32)
        for start in range(0, targets.numel(), self.chunk):
            end = start + self.chunk
            total = total + checkpoint(self._chunk_loss, hidden[start:end], targets[start:end], use_reentrant=False)
        return total / targets.numel()

    def _chunk_loss(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.lm.lm_head(hidden).float(), targets, reduction="sum")


def compute_device(name: str) -> torch.device:
    """``cpu``, or a CUDA device with its index (``cuda`` is ``cuda:0``): buffers, collectives
    and ``torch.cuda.set_device`` need the index, and ``cuda != cuda:0`` as devices."""
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    return device


def shape_adapter(model: str, device: torch.device) -> ModelAdapter:
    """The built-in shape's adapter (its HF config, parameter groups, HF names and FLOPs)."""
    source = f"builtin:{model}"
    return ModelAdapter(model_config(source, len(load_tokenizer(source))), device, torch.bfloat16)


def meta_model(adapter: ModelAdapter, dtype: torch.dtype) -> transformers.PreTrainedModel:
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(adapter.config, dtype=dtype)


def materialize(module: torch.nn.Module, lm: transformers.PreTrainedModel, param_device: str | torch.device,
                device: torch.device) -> None:
    """Allocate a meta model's parameters on ``param_device`` (through ``module``, the root:
    FSDP2's root re-registers its sharded parameters there), tie the head to the embedding again
    where the config ties them (``to_empty`` gives each module its own tensor), and rebuild the
    rotary buffers, which ``to_empty`` leaves uninitialised, on the compute ``device``."""
    module.to_empty(device=param_device)
    tied = lm.config.tie_word_embeddings
    if tied and lm.lm_head.weight is not lm.model.embed_tokens.weight:
        lm.tie_weights()
    if tied and lm.lm_head.weight is not lm.model.embed_tokens.weight:
        raise RuntimeError("the LM head is not tied to the embedding after materialising the model")
    lm.model.rotary_emb = type(lm.model.rotary_emb)(config=lm.config).to(device)
    stray = [name for name, b in lm.named_buffers() if b.device != device]
    if stray:
        raise RuntimeError(f"buffers left off {device} after materialising the model: {stray}")


def init_values(adapter: ModelAdapter, seed: int, device: torch.device):
    """(HF name, value) of LazyTrain's random init, group by group."""
    for g, group in itertools.groupby(random_init_values(adapter, seed, device), key=lambda item: item[0]):
        layout = adapter.layouts[g]
        yield [(layout.hf_name(p), value) for _, p, value in group]


def checkpoint_layers(lm: transformers.PreTrainedModel) -> None:
    """Activation checkpointing of every decoder layer (torch's non-reentrant checkpoint)."""
    kwargs = {"use_reentrant": False}
    if hasattr(lm, "activation_checkpointing_enable"):  # transformers >= 5.24 deprecates the other name
        lm.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    lm.train()


def gpu_peaks(device: torch.device) -> dict:
    if device.type != "cuda":
        return {"peak_gpu_alloc_gb": None, "peak_gpu_reserved_gb": None}
    return {"peak_gpu_alloc_gb": torch.cuda.max_memory_allocated(device) / GB,
            "peak_gpu_reserved_gb": torch.cuda.max_memory_reserved(device) / GB}


def peak_rss_gb() -> float:
    """This process's peak resident set (Linux reports KiB). Pinned (page-locked) host memory
    is resident and counts; the parent also measures the machine's used memory."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB


def torch_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, autocast: bool = False
               ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """One training step with a torch optimizer: loss (under bf16 autocast on CUDA with
    ``autocast``), backward, clipping at MAX_GRAD_NORM, update; returns the loss."""

    def step(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = model(ids, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def timed_loop(step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], job: Job, adapter: ModelAdapter,
               device: torch.device) -> dict:
    """``warmup + steps`` synchronous steps; each measured step from its start to the end of its
    optimizer step (the GPU synchronised: the next step could start there)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, losses = [], []
    for i in range(job.warmup + job.steps):
        ids, labels = random_batch(job.batch, job.seq, adapter.vocab_size, seed=i)
        t0 = time.perf_counter()
        loss = float(step(ids.to(device), labels.to(device)))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - t0
        losses.append(loss)
        print(f"{job.run} b{job.batch} step {i}: {elapsed:.2f} s, loss {loss:.4f}", flush=True)
        if i >= job.warmup:
            times.append(elapsed)
    return {**step_figures(times, job.batch, job.seq, adapter), "losses": losses, "loss": losses[-1],
            **gpu_peaks(device)}


def step_figures(times: list[float], batch: int, seq: int, adapter: ModelAdapter) -> dict:
    """Medians over the measured steps' ``times``: step time, tokens/s, TFLOPS by both formulas
    (and, for a mixture of experts, 6 N_active T: ``tflops_active``)."""
    tokens = batch * seq
    per_step = [{"step_time_s": t, "tokens_per_s": tokens / t,
                 "tflops_6nt": flops_6nt(adapter, tokens) / t / 1e12,
                 "tflops_model": model_flops(adapter, tokens, seq) / t / 1e12,
                 **{f"tflops_{name}": f / t / 1e12 for name, f in moe_flops(adapter, tokens).items()}}
                for t in times]
    return {**{key: statistics.median(s[key] for s in per_step) for key in per_step[0]}, "step_times_s": times}


# -- LazyTrain --------------------------------------------------------------------------------


def planner_max_batch(session, costs, job: Job) -> int:
    """The largest batch the planner fits on this machine (GPU and host), from this run's
    profile: the largest-batch search's first guess for LazyTrain (its plan fills the card at
    any batch, so its GPU peak says nothing of the next batch); 0 when none fits."""
    o = session.policy_options()
    try:
        found = search_batch(costs, job.seq, goal="max_batch", batch_sizes=range(1, job.planner_max_batch_limit + 1),
                             tiers=o.tiers, optimizer_overlap=o.optimizer_overlap,
                             head_chunk_tokens=o.head_chunk_tokens, recompute=o.recompute)
    except PlanInfeasible:
        return 0
    return found.plan.batch_size


def run_lazytrain(job: Job) -> dict:
    kind = job.run.partition(":")[2] or "hybrid8bit"
    overrides = [f"training.seed={job.seed}", "plan.policy=solved"]
    if job.host_limit_gb:
        overrides.append(f"memory.host_limit_gb={job.host_limit_gb:.1f}")
    try:
        session = bench_session(job.model, optimizer=kind, device=job.device, batch=job.batch, seq=job.seq,
                                head_chunk=job.head_chunk, overrides=tuple(overrides))
    except HostMemoryError as error:  # the pre-flight check, before anything is allocated
        return {"status": "does not fit host memory", "error": str(error).split("\n")[0]}
    try:
        plan, costs = session.plan()
    except PlanInfeasible as error:
        return {"status": "does not fit GPU memory", "error": str(error).split("\n")[0]}
    record = timed_steps(session, plan, warmup=job.warmup, steps=job.steps)
    record.update(simulate(plan, costs, optimizer_overlap=True).metrics())
    if job.planner_max_batch_limit:
        record["planner_max_batch"] = planner_max_batch(session, costs, job)
    host = session.store.bytes(session.optimizer.state_bytes()).per_param()
    exact = kind == "fp32"
    return {
        **record, "host_rss_now_gb": record.pop("host_rss_gb"),
        "optimizer": f"LazyTrain {kind} AdamW (CPU, overlapped)", "optimizer_exact": exact,
        "precision": "bf16 weights and compute, fp32 master" + (" (split: bf16 + 16-bit remainder)"
                                                                 if host.get("masters", 4) < 4 else ""),
        "host_bytes_per_param": host, "num_params": session.store.num_params,
        "activation_checkpointing": "the solved plan (per layer: keep, offload or recompute)",
        "offload": {"params": "host (streamed per layer)", "optimizer": "host", "pin_memory": session.device.type == "cuda"},
        "host_limit_gb": job.host_limit_gb,
        **run_header(session.device),
    }


# -- FSDP2 ------------------------------------------------------------------------------------


def run_fsdp2(job: Job) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    device = compute_device(job.device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1,
                            **({"device_id": device} if cuda else {}))
    try:
        adapter = shape_adapter(job.model, device)
        mesh = init_device_mesh(device.type, (1,))
        lm = meta_model(adapter, torch.float32)
        checkpoint_layers(lm)
        model = ChunkedLossModel(lm, job.head_chunk)
        # on the CPU the parameters live there anyway: the policy still runs FSDP2's offload path
        pin = job.pin_memory and cuda
        policy = {"mesh": mesh, "offload_policy": CPUOffloadPolicy(pin_memory=pin),
                  "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
        for layer in lm.model.layers:
            fully_shard(layer, **policy)
        fully_shard(model, **policy)
        materialize(model, lm, "cpu", device)
        params = dict(lm.named_parameters())
        with torch.no_grad():
            for group in init_values(adapter, job.seed, device):
                for name, value in group:
                    params[name].to_local().copy_(value)
        try:
            optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0,
                                          fused=True)
            implementation = "fused"
        except (RuntimeError, ValueError):  # a torch without fused CPU AdamW
            optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0,
                                          foreach=True)
            implementation = "foreach"

        record = timed_loop(torch_step(model, optimizer), job, adapter, device)
    finally:
        dist.destroy_process_group()
    n = adapter.num_params()
    return {
        **record, "optimizer": f"torch.optim.AdamW ({implementation}, CPU, fp32)", "optimizer_exact": True,
        "precision": "fp32 parameters (the masters), bf16 compute (MixedPrecisionPolicy), fp32 reduce",
        "host_bytes_per_param": {"params_fp32": 4, "grads_fp32": 4, "adam_states_fp32": 8, "total": 16},
        "num_params": n, "activation_checkpointing": "every decoder layer (torch checkpoint, non-reentrant)",
        "offload": {"params": "cpu", "optimizer": "cpu", "pin_memory": pin,
                    **({} if cuda else {"note": "CPU run: parameters and compute are both on the CPU"})},
        **run_header(device),
    }


# -- DeepSpeed ZeRO-3 -------------------------------------------------------------------------


def deepspeed_config(batch: int, hidden: int) -> dict:
    """ZeRO-3 with parameters and optimizer offloaded to pinned CPU memory, bf16, DeepSpeed's
    CPU AdamW: DeepSpeed's documented single-GPU offload config, with the bucket sizes HF's
    integration derives from the hidden size (its ``"auto"`` values)."""
    return {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": MAX_GRAD_NORM,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": 0.0}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu", "pin_memory": True},
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "overlap_comm": True,
            "contiguous_gradients": True,
            "sub_group_size": int(1e9),
            "reduce_bucket_size": hidden * hidden,
            "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
            "stage3_param_persistence_threshold": 10 * hidden,
            "stage3_max_live_parameters": int(1e9),
            "stage3_max_reuse_distance": int(1e9),
        },
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def run_deepspeed(job: Job) -> dict:
    import deepspeed

    # zero.Init patches tensor construction; torch._dynamo (imported lazily by transformers'
    # generation utilities) fails to import under that patch, so both are imported before it
    import torch._dynamo
    import transformers.generation.utils

    device = compute_device(job.device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    adapter = shape_adapter(job.model, device)
    config = deepspeed_config(job.batch, adapter.hidden_size)
    # zero.Init partitions each module's parameters to (pinned) CPU memory as it is built: the
    # whole model never exists on the GPU, nor in fp32 on the host
    with deepspeed.zero.Init(config_dict_or_path=config):
        lm = transformers.AutoModelForCausalLM.from_config(adapter.config, dtype=torch.bfloat16)
    lm.model.rotary_emb.to(device)  # buffers only: ZeRO-3 places parameters, not buffers
    params = dict(lm.named_parameters())
    for group in init_values(adapter, job.seed, device):
        targets = [params[name] for name, _ in group]
        with deepspeed.zero.GatheredParameters(targets, modifier_rank=0), torch.no_grad():
            for target, (_, value) in zip(targets, group):
                target.copy_(value)
    checkpoint_layers(lm)
    model = ChunkedLossModel(lm, job.head_chunk)
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    inner = getattr(optimizer, "optimizer", optimizer)

    def step(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = engine(ids, labels)
        engine.backward(loss)
        engine.step()
        return loss.detach()

    record = timed_loop(step, job, adapter, device)
    n = adapter.num_params()
    return {
        **record, "optimizer": f"{type(inner).__name__} (adamw_mode={getattr(inner, 'adam_w_mode', None)})",
        "optimizer_exact": True, "precision": "bf16 parameters and compute, fp32 master and Adam states (CPU)",
        "host_bytes_per_param": {"params_bf16": 2, "master_fp32": 4, "grads_fp32": 4, "adam_states_fp32": 8,
                                 "total": 18},
        "num_params": n, "activation_checkpointing": "every decoder layer (torch checkpoint, non-reentrant)",
        "offload": {"params": "cpu", "optimizer": "cpu", "pin_memory": True}, "deepspeed": deepspeed.__version__,
        "deepspeed_config": config, **run_header(device),
    }


# -- plain PyTorch on the GPU -----------------------------------------------------------------


def run_pytorch_gpu(job: Job) -> dict:
    device = compute_device(job.device)
    adapter = shape_adapter(job.model, device)
    lm = meta_model(adapter, torch.float32)
    materialize(lm, lm, device, device)
    params = dict(lm.named_parameters())
    with torch.no_grad():
        for group in init_values(adapter, job.seed, device):
            for name, value in group:
                params[name].copy_(value)
    checkpoint_layers(lm)
    model = ChunkedLossModel(lm, job.head_chunk)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0, fused=True)

    record = timed_loop(torch_step(model, optimizer, autocast=True), job, adapter, device)
    return {
        **record, "optimizer": "torch.optim.AdamW (fused, GPU, fp32)", "optimizer_exact": True,
        "precision": "fp32 parameters, bf16 autocast", "host_bytes_per_param": {"total": 0},
        "num_params": adapter.num_params(), "activation_checkpointing": "every decoder layer (torch checkpoint, non-reentrant)",
        "offload": {"params": "none", "optimizer": "none", "pin_memory": False}, **run_header(device),
    }


RUN = {"lazytrain": run_lazytrain, "deepspeed_zero3_offload": run_deepspeed, "fsdp2_cpu_offload": run_fsdp2,
       "pytorch_gpu": run_pytorch_gpu}


def run_job(job: Job) -> dict:
    """The runner's record, ``status`` ``ok``, or the reason it has no numbers: out of GPU
    memory, or LazyTrain's pre-flight refusing a model its host cannot hold. Anything else
    propagates (the parent records the worker's last log lines)."""
    t0 = time.perf_counter()
    prefer_expandable_segments()  # the allocator setting LazyTrain's session makes, for every run
    try:
        record = {"status": "ok", **RUN[job.runner](job)}
    except torch.OutOfMemoryError as error:
        record = {"status": "out of GPU memory", "error": str(error).split("\n")[0]}
    except LazyTrainError as error:
        record = {"status": "failed", "error": str(error).split("\n")[0]}
    record["worker_s"] = time.perf_counter() - t0
    record["cuda_alloc_conf"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    record["host_rss_gb"] = peak_rss_gb()
    return record

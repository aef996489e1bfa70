"""Typed configuration: YAML files plus ``section.key=value`` overrides.

Every section is a dataclass with defaults; the docstring under each field is its help
(``lazytrain config`` prints them all, as docs/configuration.md holds them: `cli/reference.py`).
Unknown keys and bad values are errors that name the key and say what is accepted.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import yaml

from lazytrain.errors import ConfigError
from lazytrain.plan.plan import DEVICE_STEPPED, RECOMPUTE, is_offload_window


def check_fields(obj, section: str) -> None:
    """Every ``Literal`` field holds one of its choices and every float is finite (NaN or inf
    in a learning rate or a clip threshold would silently wreck a run)."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        hint = hints[f.name]
        value = getattr(obj, f.name)
        union = typing.get_origin(hint) in (typing.Union, types.UnionType)
        options = [a for a in typing.get_args(hint) if a is not type(None)] if union else [hint]
        for option in options:
            if typing.get_origin(option) is Literal:
                choices = typing.get_args(option)
                if value is not None and value not in choices:
                    raise ConfigError(
                        f"{section}.{f.name}={value!r} is not one of {', '.join(map(str, choices))}"
                    )
        numbers = value if isinstance(value, tuple) else (value,)
        if any(isinstance(v, float) and not math.isfinite(v) for v in numbers):
            raise ConfigError(f"{section}.{f.name}={value} is not a finite number")


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """What to train: the model's weights and shape, and how its layers compute."""

    source: str = "builtin:tiny"
    """A local HF model folder (config.json + safetensors), or ``builtin:NAME`` for a
    random-initialised model of a built-in shape (tiny, qwen2.5-0.5b, qwen2.5-3b, qwen2.5-7b, qwen2.5-14b,
    qwen3-8b, llama-3.1-8b, qwen3.5-9b, qwen3.6-27b, tiny-hybrid)."""
    dtype: Literal["auto", "bf16", "fp32"] = "auto"
    """Compute dtype of streamed weights and activations: auto (bf16 on GPU, fp32 on CPU),
    bf16, fp32."""
    init_device: Literal["auto", "cpu"] = "auto"
    """Where a ``builtin:`` model's random init is drawn: auto (the training device: fast on a
    GPU, but a GPU's generator gives other weights than the CPU's for the same seed), cpu (the
    same weights from a seed on every machine; slower at billions of parameters, and under data
    parallel every rank draws the whole init)."""
    lean_ops: bool = True
    """SwiGLU MLPs and RMSNorms that save fewer tensors for backward (`model/lean.py`: the same
    forward, the elementwise parts and, in kept layers, the norms' outputs recomputed in
    backward; a Qwen2.5-7B layer saves 53% less, 106.6 instead of 225.4 KB per token). false:
    HF's modules as they are."""
    fused_ops: Literal["auto", "compiled", "eager"] = "auto"
    """How the lean ops' elementwise parts run (`model/pointwise.py`): auto (compiled on CUDA
    where torch.compile works, else eager), compiled (fused kernels through torch.compile, on
    any device), eager (one kernel per operation)."""
    packed_attention: Literal["auto", "varlen", "mask"] = "auto"
    """How attention keeps packed rows' samples apart (``data.packing``): auto (varlen where it
    runs: CUDA with bf16/fp16; else mask), varlen (flash attention's variable-length kernel over
    the rows cut at the samples), mask (a block-diagonal mask through sdpa, on every device)."""

    def __post_init__(self) -> None:
        check_fields(self, "model")


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """What to train on: the data file (or the built-in arithmetic), its format and prompt
    template, and how samples become batches."""

    dataset: str = "builtin"
    """``builtin`` (synthetic arithmetic in MetaMathQA form) or a local file/folder."""
    format: Literal["auto", "metamathqa", "alpaca", "json", "jsonl", "parquet", "hf"] = "auto"
    """auto (from the file name and content), metamathqa, alpaca, json, jsonl, parquet, hf."""
    prompt_field: str = "query"
    """Question field for the generic json/jsonl/parquet formats."""
    response_field: str = "response"
    """Answer field for the generic json/jsonl/parquet formats."""
    template: Literal["auto", "alpaca", "compact", "chat"] = "auto"
    """Prompt template: auto (compact for builtin data, alpaca otherwise), alpaca, compact, chat."""
    max_seq_len: int | None = None
    """Samples longer than this are truncated (counted and reported). Default: 128 for the
    built-in data, 1024 for a data file (an alpaca prompt alone is ~40 tokens, ~200
    characters with the built-in tokenizer)."""
    builtin_tier: str = "add2"
    """Difficulty tier of the built-in data."""
    builtin_length_mix: Literal["short", "metamathqa"] = "short"
    """Lengths of the built-in samples: short (the problem alone, ~100 tokens), or metamathqa
    (each problem padded with filler sentences in its question and response to a MetaMathQA-like
    spread, median ~350 tokens; for throughput studies such as packing). The held-out split
    gets the same mix."""
    packing: bool = False
    """Pack samples into rows of exactly max_seq_len tokens (padding only at row ends), with
    attention masked per sample, positions restarting per sample and the loss unchanged per
    sample (in Qwen3.5/3.6 models the Gated-DeltaNet layers' convolution and recurrent state
    restart per sample too). Batches then have one fixed shape."""
    builtin_train_size: int = 20000
    """Problems in the built-in training split (drawn with replacement; held-out problems are
    never among them)."""
    heldout_size: int = 200
    """Held-out problems for evaluation with the built-in data."""

    def __post_init__(self) -> None:
        check_fields(self, "data")
        if self.max_seq_len is None:
            self.max_seq_len = 128 if self.dataset == "builtin" else 1024
        if self.max_seq_len < 8:
            raise ConfigError(f"data.max_seq_len must be >= 8, got {self.max_seq_len}")
        if self.builtin_train_size < 1 or self.heldout_size < 1:
            raise ConfigError("data.builtin_train_size and data.heldout_size must be >= 1")


@dataclass(kw_only=True, slots=True)
class TrainingConfig:
    """The run: steps, batch, device, where its outputs go, checkpoints and resuming."""

    steps: int = 1500
    """Optimizer steps. 1500: at 1000 the built-in default's slowest seeds were still learning
    (loss falling; held-out exact match down to 72% in fp32, 93.5% in bf16); at 1500 LazyTrain's
    bf16 runs reach >= 99.5% on every seed tried on the H200 (docs/optimizer.md, bf16)."""
    batch_size: int = 32
    """Sequences per step (the plan may be solved for it)."""
    max_grad_norm: float = 1.0
    """Global gradient-norm clip; 0 disables clipping."""
    seed: int = 0
    """Seeds the data order, the built-in data, a built-in shape's random init and 8-bit
    stochastic rounding."""
    device: str = "auto"
    """auto (cuda if available, else cpu), cuda, cuda:N, cpu."""
    output_dir: str = "runs/default"
    """The run's folder (created if missing): the trained model (an HF folder), checkpoints/,
    metrics.jsonl and lazytrain_config.yaml; `lazytrain profile` and `lazytrain plan` write
    costs.json and plan.json there."""
    log_every: int = 10
    """Print a metrics line every N steps (metrics.jsonl gets every step)."""
    save_every: int = 0
    """Write a resumable checkpoint every N steps (0: by time only, see save_every_minutes)."""
    save_every_minutes: float = 30.0
    """Write a resumable checkpoint when this many minutes passed since the last one (0: off).
    A checkpoint is always written at the end and on SIGINT / SIGTERM."""
    keep_checkpoints: int = 1
    """Complete checkpoints kept in output_dir/checkpoints; the newest is only removed once
    the next one is complete, so the disk must hold keep_checkpoints + 1 at a save."""
    checkpoint_in_place: bool = False
    """Delete the previous checkpoint *before* writing the next: needs room for
    keep_checkpoints only (e.g. a 7B model, ~46 GB a checkpoint, on a 64 GB disk), but a kill
    or a full disk during that save leaves none."""
    max_skipped_steps: int = 10
    """Stop with an error after this many consecutive steps skipped for a non-finite loss or
    gradient (the last checkpoint is kept; the model is not written)."""
    overwrite: bool = False
    """Train into an output_dir that holds an earlier run (its checkpoints are deleted);
    without it that is an error (use resume=true to continue it)."""
    eval_every: int = 0
    """Exact-match evaluation on the held-out split every N steps (0: only at the end)."""
    progress: bool = True
    """Show a progress bar."""
    resume: bool = False
    """Continue from the newest checkpoint in output_dir (same model, data and batch size);
    an error when there is none."""

    def __post_init__(self) -> None:
        check_fields(self, "training")
        for name in ("steps", "batch_size", "log_every", "keep_checkpoints", "max_skipped_steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"training.{name} must be >= 1, got {getattr(self, name)}")
        # (non-finite values were refused by check_fields)
        if self.max_grad_norm < 0:
            raise ConfigError(f"training.max_grad_norm must be >= 0 (0: no clipping), got {self.max_grad_norm}")
        if self.save_every_minutes < 0:
            raise ConfigError(f"training.save_every_minutes must be >= 0 (0: off), got {self.save_every_minutes}")
        if self.save_every < 0 or self.eval_every < 0:
            raise ConfigError("training.save_every and training.eval_every must be >= 0")


@dataclass(kw_only=True, slots=True)
class AdamWConfig:
    """AdamW's hyperparameters: what every CPU optimizer (``optim/``) takes."""

    lr: float = 2e-5
    """Peak learning rate (the schedule scales it per step)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW's decay rates of the first and second moment estimates, each in [0, 1)."""
    eps: float = 1e-8
    """Added to sqrt(v) in AdamW's denominator (> 0)."""
    weight_decay: float = 0.0
    """Decoupled weight decay, applied to matrices and embeddings, not to norms or biases."""

    def __post_init__(self) -> None:
        self.betas = tuple(float(b) for b in self.betas)  # type: ignore[assignment]
        if self.lr < 0:
            raise ConfigError(f"optimizer.lr must be >= 0, got {self.lr}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"optimizer.betas must be two numbers in [0, 1), got {self.betas}")
        if self.eps <= 0:
            raise ConfigError(f"optimizer.eps must be > 0, got {self.eps}")
        if self.weight_decay < 0:
            raise ConfigError(f"optimizer.weight_decay must be >= 0, got {self.weight_decay}")


QUANTIZED_KINDS = ("hybrid8bit", "hybrid4bit")
"""optimizer.kind values with quantized states (rounding, fp32 small groups, a GPU step)."""


@dataclass(kw_only=True, slots=True)
class OptimizerConfig(AdamWConfig):
    """The CPU optimizer (AdamW with fp32 or 8-bit states) and its learning-rate schedule."""

    lr: float | None = None
    """Peak learning rate; null (auto): 2e-3 for the built-in tiny model (trained from
    scratch), 1e-5 for every other model (fine-tuning)."""
    kind: Literal["fp32", "hybrid8bit", "hybrid4bit"] = "fp32"
    """fp32 (torch fused AdamW, 8 B/param of state), hybrid8bit (8-bit blockwise, ~2.06 B/param)
    or hybrid4bit (4-bit blockwise, ~1.06 B/param; not exact, docs/optimizer.md)."""
    fp32_embedding_states: bool = False
    """hybrid8bit and hybrid4bit only: keep fp32 m and v for the embedding and the final group (final norm and
    untied LM head), as bitsandbytes advises for embeddings. Costs 6 B more per parameter of
    those groups: Qwen2.5-7B (2 x 545 M of 7.6 B parameters) goes from 2.06 to 2.91 B/param,
    a tied model of the same shape (one 545 M matrix of 7.1 B) to 2.52. On the built-in default
    it measured no closer to fp32 than all-8-bit states (``bench/studies/optim_convergence_seeds.py``)."""
    state_rounding: Literal["auto", "nearest", "stochastic"] = "auto"
    """hybrid8bit and hybrid4bit only: how the states are requantized each step: sqrt(v) (8-bit),
    m and sqrt(v) (4-bit). nearest: the nearest code. stochastic: one of the two codes around
    the value, drawn so that its expected value is the value (reproducible: a hash of
    training.seed, the group, the step and the element), so that small changes are not rounded
    away. auto: for hybrid8bit, stochastic when fine-tuning (weights loaded from model.source),
    nearest when training a built-in shape from its random init; for hybrid4bit, stochastic.
    Measured (docs/optimizer.md): fine-tuning a 0.5B model on the H200 (5 seeds), stochastic
    codes end 0.06% above fp32's tail loss and the null (fp32 in another rounding order) 0.04%,
    nearest codes 0.13%, outside the null's interval; along the run all three are within the
    null's spread. Training the built-in model from scratch, stochastic codes ended worse on
    one seed of three. The 8-bit step takes ~28% more CPU time (0.258 -> 0.330 ns/param, 16
    cores); a 7B step (b64 x s1024, H200) measured +3.4% and -0.7% in two pairs of runs.
    4-bit states with nearest codes ended a fine-tune's CPU proxy (5 seeds) at 1.097x fp32's
    tail loss, m's rounding the cause (its small changes rounded away); with stochastic codes
    at 1.008x (docs/optimizer.md, 4-bit states). They cost 15-40% more CPU time a step."""
    warmup_steps: int = 20
    """Steps of linear warmup from lr / warmup_steps to lr (0: none)."""
    schedule: Literal["cosine", "constant"] = "cosine"
    """cosine (to min_lr_ratio * lr) or constant, after linear warmup."""
    min_lr_ratio: float = 0.1
    """The cosine schedule's final learning rate, as a fraction of lr (in [0, 1])."""

    def __post_init__(self) -> None:
        check_fields(self, "optimizer")
        lr, self.lr = self.lr, 0.0 if self.lr is None else self.lr
        AdamWConfig.__post_init__(self)  # validates betas, eps, decay (and lr unless auto)
        self.lr = lr
        if self.fp32_embedding_states and self.kind not in QUANTIZED_KINDS:
            raise ConfigError(
                "optimizer.fp32_embedding_states applies to optimizer.kind=hybrid8bit or hybrid4bit only "
                "(fp32 keeps every state in fp32); unset it or set optimizer.kind=hybrid8bit"
            )
        if self.state_rounding == "stochastic" and self.kind not in QUANTIZED_KINDS:
            raise ConfigError(
                f"optimizer.state_rounding={self.state_rounding} applies to optimizer.kind=hybrid8bit "
                "or hybrid4bit only (fp32 states are not rounded); set it to auto (the default) or "
                "nearest, or set optimizer.kind=hybrid8bit"
            )
        if self.warmup_steps < 0:
            raise ConfigError(f"optimizer.warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"optimizer.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")


@dataclass(kw_only=True, slots=True)
class PlanConfig:
    """Which plan the executor runs: per layer, what is kept, checkpointed, offloaded or
    recomputed, and where each optimizer step runs (see `lazytrain plan`)."""

    policy: Literal["auto", "solved", "megatrain", "keep_all", "checkpoint_all"] = "auto"
    """solved: profile this machine (or read plan.costs) and solve the MILP (see `lazytrain
    plan`); megatrain, keep_all, checkpoint_all: the fixed baselines of `plan.policies`.
    auto: solved on a GPU; on the CPU (no streams to overlap) keep_all when its activations
    (estimated) fit in an eighth of RAM, else megatrain."""
    file: str | None = None
    """A plan.json (from `lazytrain plan`) to run instead of a policy; plan.policy must then
    stay auto."""
    costs: str | None = None
    """A cost table (costs.json from `lazytrain profile`) for the solved policy; null:
    profile at start-up."""
    megatrain_every: int = 4
    """Checkpoint interval of the megatrain policy."""
    checkpoint_tier: Literal["gpu", "host", "nvme"] = "gpu"
    """Where checkpoint_all keeps layer inputs: gpu, host or nvme (needs memory.nvme_dir)."""
    head_chunk_tokens: int = 4096
    """Tokens whose logits the LM head and loss compute at once (the logits of a whole batch
    would take batch x seq x vocab floats of GPU memory)."""
    weight_prefetch: int = 1
    """Layers of weights copied ahead (1 = double buffering)."""
    overlap_optimizer: bool = True
    """Run the CPU optimizer step behind the next step's forward."""
    recompute_blocks: tuple[str, ...] = ("mlp", "attention", "mlp_up")
    """What the solved plan may recompute inside a kept layer's backward: mlp, attention (the
    block, keeping only its inputs), mlp_up (the MLP's up projection); [] keeps or recomputes
    whole layers only."""
    const_update: Literal["auto", "host", "device"] = "auto"
    """Where the embedding and the final norm + head (resident on the GPU) take their optimizer
    step: host (the CPU optimizer, with the layers), device (the GPU: their master remainders
    and optimizer states then live there, ~4 B per parameter of those groups, and neither their
    gradients nor their weights cross PCIe; optimizer.kind=hybrid8bit, one process), or auto
    (the solved plan takes whichever the planner predicts faster; other policies: host)."""
    device_layers: int | None = None
    """With the embedding and head stepped on the GPU: how many of the first decoder layers are
    resident there too (not streamed) and stepped there (~3.5 B per parameter of those layers on
    the card beside their weights; the CPU optimizer then starts on the layers after them as the
    forward starts), or null (auto, the default: the solved plan chooses, solving the MILP for
    several numbers, 38-47 s for 28-64 layers on 2 cores; other policies: 0). On the H200 at 7B,
    batch 64, the planner's choice (4) measured 2-5% faster than 0 in two processes."""
    device_steps: int | None = 0
    """With the embedding and head stepped on the GPU: how many streamed decoder layers after
    the resident ones are stepped there too, their weights, gradients, master remainders and
    optimizer states copied in from pinned host memory at each update and back, the gradients
    excepted (~8 B per parameter in and ~6 out over PCIe; two layers' worth of scratch on the
    card through the first forwards), which takes them off the CPU without holding them on the
    card; or null: the
    solved plan takes the fewest that keep the overlapped CPU update ahead of the forward at
    the cost table's rate, or where those do not fit (each takes a host gradient buffer), the
    most that do (other policies: 0)."""

    offload_window: int = 1
    """The solved plan's model of a host-tier layer's offload (`Plan.offload_window`): its copy
    out within the next stage (1), or spread over up to this many stages, its GPU memory held
    meanwhile, so that the planner may send a layer's MLP activations to the host where a
    layer's forward is too short to copy them (recomputing less). Predicted on the H200 at 7B
    (2026-12-05 tables, 8 resident layers, `bench/studies/offload_window.py --solve`): 2.2-2.6% faster
    steps at 2, 2.4-3.3% at 3; not yet measured, so 1 stays the default. The executor runs every plan alike (it waits for no
    offload)."""
    batch_sweep: int = 0
    """`lazytrain plan` only: also solve the plan at each candidate batch size up to this (1, 2,
    3, 4, 6, 8, 12, ...: `plan.search.candidate_batches`) at data.max_seq_len, and print each
    one's predicted step, tokens/s, where its time goes and the resource that binds it (GPU
    compute, PCIe, the CPU update), up to the first batch no plan fits, and the fastest; 0:
    only training.batch_size."""
    recalibrate_after: int = 4
    """A solved plan is re-solved when the updates of this many steps are timed (each is
    timed as the next step starts: after step N + 1), on their CPU update rate (the slowest
    of updates 2..N; `policies.measured_update_rate`) with a margin (below), when the cost
    table's is more than 5% off that: profiled alone, the update ran up to 1.5x slower inside the step on the H200, beside the
    PCIe copies. The re-solved plan is taken when the planner predicts it at least 1% faster on
    the corrected table (one process only). The rate planned for is the measured one 10%
    slower (`policies.UPDATE_RATE_MARGIN`: slack for the update costs less than a forward
    waiting for it); a plan taken so is measured the same way in turn, planned for no faster
    than the table's (`policies.planned_update_rate`), up to
    `policies.MAX_RECALIBRATIONS` re-solves. 0 (or 1: no update after the first): never."""

    def __post_init__(self) -> None:
        check_fields(self, "plan")
        if self.megatrain_every < 1 or self.head_chunk_tokens < 1 or self.weight_prefetch < 1:
            raise ConfigError("plan.megatrain_every, head_chunk_tokens, weight_prefetch must be >= 1")
        if not is_offload_window(self.offload_window):
            raise ConfigError(f"plan.offload_window must be an integer >= 1 (1: each offload within a stage), "
                              f"got {self.offload_window!r}")
        if self.batch_sweep < 0:
            raise ConfigError(f"plan.batch_sweep must be >= 0 (0: no sweep), got {self.batch_sweep}")
        if self.recalibrate_after < 0:
            raise ConfigError(f"plan.recalibrate_after must be >= 0 (0: never), got {self.recalibrate_after}")
        options = [r for r in RECOMPUTE if r != "none"]
        unknown = sorted(set(self.recompute_blocks) - set(options))
        if unknown:
            raise ConfigError(f"plan.recompute_blocks: {unknown} cannot be recomputed; use any of "
                              f"{', '.join(options)}, or []")
        if self.file is not None and self.policy != "auto":
            raise ConfigError(
                f"plan.file={self.file} and plan.policy={self.policy} both choose the plan; drop one"
            )


@dataclass(kw_only=True, slots=True)
class MemoryConfig:
    """The memory LazyTrain may use: the GPU cap, the host budget, pinning, the NVMe tier."""

    pin: bool = True
    """Page-lock the host weight and gradient arenas (needed for async full-speed copies)."""
    host_limit_gb: float | None = None
    """Host memory LazyTrain may plan for: model state, optimizer state, host-tier activations
    and their pinned staging buffers together (default: RAM, or the cgroup limit, minus 5% and
    at least 4 GiB for the process itself). The solved plan keeps host activations within what
    is left after the model state."""
    master: Literal["auto", "fp32", "split", "bf16"] = "auto"
    """What holds the master weights AdamW updates (optim/master.py): fp32 (4 B per parameter,
    exact); split (the streamed bf16 weight plus a 16-bit remainder: 2 B, exact, optim/split.py);
    bf16 (the streamed bf16 weight alone, updated with stochastic rounding: 0 B, NOT exact: each
    step rounds the fp32 update to bf16, so the weights carry rounding noise an fp32 master does
    not); auto (split for bf16 runs on a GPU, else fp32). split and bf16 need model.dtype=bf16
    and one process (not torchrun)."""
    split_master: Literal["auto", "true", "false"] = "auto"
    """Deprecated alias of memory.master: true is master=split, false is master=fp32, auto
    defers to memory.master."""
    nvme_dir: str | None = None
    """Folder for the NVMe activation tier (files are removed when freed and at exit)."""
    gpu_gb: float | None = None
    """GPU memory cap for the step (the solved plan must fit in it; on CUDA the allocator is
    capped too). Default: the whole device."""
    gradients: Literal["auto", "host", "gpu"] = "host"
    """Where each streamed decoder layer's gradient waits from its backward until the step's
    clip coefficient is known (`LayerPlan.grad`): host (a pinned host buffer per layer, copied
    out in the backward: the default, the path every GPU measurement so far ran), auto (the
    solved plan places each one, with the activations, against the GPU and host budgets; a
    baseline policy, host), gpu (held on the GPU, copied home through a small pinned ring at the
    update: no host gradient buffers, 2 B per parameter less host memory). Exact in every case:
    the same bits reach the same optimizer step. The held path has run on the CPU only
    (2026-12-06): auto becomes the default once a GPU has measured it."""
    shm_dir: str = "/dev/shm"
    """Data parallel with several ranks per host: the tmpfs where the host's shared weight
    arena is created (and unlinked as soon as every local rank has mapped it)."""

    def __post_init__(self) -> None:
        self.split_master = str(self.split_master).lower()  # YAML reads true/false as booleans
        check_fields(self, "memory")
        alias = SPLIT_MASTER_ALIAS.get(self.split_master)
        if alias is not None and self.master not in ("auto", alias):
            raise ConfigError(
                f"memory.split_master={self.split_master} (a deprecated alias of memory.master={alias}) contradicts "
                f"memory.master={self.master}; drop memory.split_master and keep memory.master"
            )
        for name in ("host_limit_gb", "gpu_gb"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"memory.{name} must be > 0 GiB (or unset), got {value}")


    def master_setting(self) -> str:
        """memory.master with the deprecated memory.split_master folded in (auto, fp32, split or
        bf16; `train.session.resolve_master` resolves auto)."""
        return SPLIT_MASTER_ALIAS.get(self.split_master, self.master) if self.master == "auto" else self.master


SPLIT_MASTER_ALIAS = {"true": "split", "false": "fp32"}
"""memory.split_master's values as memory.master (auto defers to memory.master)."""


@dataclass(kw_only=True, slots=True)
class EvalConfig:
    """``lazytrain eval``: exact match of a saved model on held-out or user data."""

    model: str | None = None
    """A model folder written by ``lazytrain train`` (or any HF folder); default:
    training.output_dir."""
    data: str = "builtin"
    """``builtin`` (the held-out split of the built-in data) or a local file."""
    format: Literal["auto", "metamathqa", "alpaca", "json", "jsonl", "parquet", "hf"] = "auto"
    """The data file's format, as data.format."""
    builtin_tier: str = "add2"
    """Difficulty tier of the built-in held-out problems (the training run's data.builtin_tier)."""
    num_samples: int = 200
    """Samples to evaluate (the first N of the file; N held-out problems for builtin)."""
    seed: int = 0
    """Which built-in held-out problems are drawn (the training run's training.seed gives the
    ones its end-of-run evaluation scored)."""
    max_new_tokens: int = 64
    """Tokens generated per answer at most."""
    batch_size: int = 64
    """Prompts generated at once."""
    device: str = "auto"
    """auto (cuda if available, else cpu), cuda, cuda:N, cpu."""
    mode: Literal["auto", "resident", "streamed"] = "auto"
    """auto (resident when the model fits in 90% of free GPU memory), resident, streamed."""
    template: str = "saved"
    """saved (the template stored with the model), or a built-in template name."""
    output: str | None = None
    """Predictions JSONL (default: MODEL/eval_predictions.jsonl)."""
    stop: tuple[str, ...] = ("\n\n\n", "### Instruction", "\nQ: ")
    """Generation is cut at the first of these strings (and at the tokenizer's eos)."""

    def __post_init__(self) -> None:
        check_fields(self, "eval")
        self.stop = tuple(self.stop)
        if self.num_samples < 1 or self.batch_size < 1 or self.max_new_tokens < 1:
            raise ConfigError("eval.num_samples, eval.batch_size and eval.max_new_tokens must be >= 1")


@dataclass(kw_only=True, slots=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def __post_init__(self) -> None:
        if self.optimizer.lr is None:
            self.optimizer.lr = 2e-3 if self.model.source == "builtin:tiny" else 1e-5
        if self.eval.model is None:
            self.eval.model = self.training.output_dir
        for name, what in DEVICE_STEPPED.items():
            value = getattr(self.plan, name)
            if value is not None and value < 0:
                raise ConfigError(f"plan.{name} must be >= 0 or null (auto), got {value}")
            if value and self.plan.const_update == "host":
                raise ConfigError(f"plan.{name}={value} {what}; set plan.const_update=device (or auto), or "
                                  f"plan.{name}=0")
        if self.plan.const_update == "device" and self.optimizer.kind not in QUANTIZED_KINDS:
            raise ConfigError(
                f"plan.const_update=device steps the embedding and head on the GPU, which optimizer.kind="
                f"{self.optimizer.kind} cannot (its step is CPU-only); set optimizer.kind=hybrid8bit (or "
                "hybrid4bit) or "
                "plan.const_update=auto"
            )
        master = self.memory.master_setting()
        if master in ("split", "bf16") and self.model.dtype == "fp32":
            raise ConfigError(
                f"memory.master={master} keeps the master in the streamed bf16 weights, and model.dtype=fp32 "
                "streams fp32 weights (already the masters' precision); set model.dtype=bf16, or memory.master=fp32"
            )
        if self.training.eval_every and self.data.dataset != "builtin":
            raise ConfigError(
                "training.eval_every needs held-out data, which only the built-in data has here; "
                "set training.eval_every=0 and run `lazytrain eval eval.model=OUT eval.data=FILE`"
            )

    def state_rounding(self) -> str:
        """optimizer.state_rounding resolved (kept as given in the config, so that a saved
        config still says auto): auto is stochastic for 4-bit states, and for 8-bit states
        fine-tuning weights loaded from model.source; nearest for 8-bit states from a built-in
        shape's random init, and for fp32 states (docs/optimizer.md, rounding of the states)."""
        rounding = self.optimizer.state_rounding
        if rounding != "auto":
            return rounding
        fine_tuning = not self.model.source.startswith("builtin:")
        kind = self.optimizer.kind
        return "stochastic" if kind == "hybrid4bit" or (kind == "hybrid8bit" and fine_tuning) else "nearest"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def save(self, path: str | Path) -> None:
        d = self.to_dict()
        d["optimizer"]["betas"] = list(d["optimizer"]["betas"])
        d["eval"]["stop"] = list(d["eval"]["stop"])
        Path(path).write_text(yaml.safe_dump(d, sort_keys=False))


def _coerce(section: str, key: str, value, hint):
    args = typing.get_args(hint)
    if type(None) in args:
        if value is None:
            return None
        hint = next(a for a in args if a is not type(None))
    try:
        if hint is bool:
            text = str(value).lower()
            if text not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError
            return text in ("true", "1", "yes")
        if hint is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if hint is float:
            return float(value)
        if hint is str:
            if isinstance(value, (dict, list)):
                raise ValueError
            return str(value)
        if typing.get_origin(hint) is Literal:
            return value
        if typing.get_origin(hint) is tuple:
            item = typing.get_args(hint)[0]
            values = value if isinstance(value, (list, tuple)) else [value]
            return tuple(str(v) if item is str else float(v) for v in values)
    except (TypeError, ValueError):
        name = getattr(hint, "__name__", str(hint))
        raise ConfigError(f"{section}.{key}={value!r} is not a valid {name}") from None
    return value


def _build(cls, section: str, values: dict):
    if not isinstance(values, dict):
        raise ConfigError(f"config section {section!r} must be a mapping, got {values!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ConfigError(
            f"unknown key(s) {', '.join(section + '.' + k for k in unknown)}; "
            f"{section} accepts: {', '.join(sorted(fields))}"
        )
    kwargs = {k: _coerce(section, k, v, hints[k]) for k, v in values.items()}
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(str(e)) from None


SECTIONS = {
    "model": ModelConfig,
    "data": DataConfig,
    "training": TrainingConfig,
    "optimizer": OptimizerConfig,
    "plan": PlanConfig,
    "memory": MemoryConfig,
    "eval": EvalConfig,
}


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """A `Config` from an optional YAML file and ``section.key=value`` overrides."""
    raw: dict = {}
    if path is not None:
        p = Path(path)
        if not p.exists():
            raise ConfigError(f"config file {p} does not exist")
        try:
            raw = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: not valid YAML: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{p}: the top level must be a mapping of sections")
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        key, value = item.split("=", 1)
        if key.count(".") != 1:
            raise ConfigError(f"override key {key!r} must be section.key (e.g. training.steps)")
        section, name = key.split(".")
        try:
            raw.setdefault(section, {})[name] = yaml.safe_load(value) if value != "" else ""
        except yaml.YAMLError:
            raise ConfigError(
                f"override {item!r}: {value!r} is not a valid value (YAML); quote a string, "
                "write lists as [a, b]"
            ) from None
    unknown = sorted(set(raw) - set(SECTIONS))
    if unknown:
        raise ConfigError(f"unknown config section(s) {unknown}; sections are {sorted(SECTIONS)}")
    return Config(**{name: _build(cls, name, raw.get(name) or {}) for name, cls in SECTIONS.items()})

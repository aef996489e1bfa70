"""Synthetic cost tables from model dimensions and machine numbers (no profiling).

For benchmarks and tests of the planner, and as a first guess before `lazytrain profile` has
run. Times come from FLOP counts at an assumed matmul rate; activation sizes from the tensors a
Llama/Qwen2-style decoder layer saves for backward with fused (flash) attention.

A mixture-of-experts layer (`ExpertShape`) streams and updates all its weights (every expert:
a large batch routes tokens to nearly all of them) but computes with its active parameters
only: the router, ``top_k`` experts and the shared expert. Its estimate (`_estimated_layer`)
adds what a dense layer does not have: the permutation of tokens to their experts and back
(memory-bound: `MachineGuess.hbm_gbps`), each expert's weights read from GPU memory once per
grouped GEMM whatever its tokens (so small batches, with few tokens per expert, run below the
matmul rate), and the routing state the backward needs (`moe_saved_bytes_per_token`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

from lazytrain.plan.costs import RECOMPUTE_OPTIONS, CostTable, LayerCosts, RecomputeCosts, ShapeFit

GB = 1e9


@dataclass(kw_only=True, slots=True)
class DecoderShape:
    """Dimensions of a Llama/Qwen2-style decoder-only model."""

    num_layers: int
    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    vocab: int
    qkv_bias: bool = True
    tied_embeddings: bool = False

    @property
    def kv_dim(self) -> int:
        return self.hidden // self.num_heads * self.num_kv_heads

    @property
    def layer_params(self) -> int:
        h, kv = self.hidden, self.kv_dim
        attention = 2 * h * h + 2 * h * kv + ((h + 2 * kv) if self.qkv_bias else 0)
        return attention + 3 * h * self.intermediate + 2 * h

    @property
    def const_params(self) -> int:
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return embeddings + self.hidden

    @property
    def head_params(self) -> int:
        """The last group's: the final norm, and the head unless tied to the embedding."""
        return (0 if self.tied_embeddings else self.vocab * self.hidden) + self.hidden


QWEN25_32B = DecoderShape(
    num_layers=64, hidden=5120, intermediate=27648, num_heads=40, num_kv_heads=8, vocab=152064
)


UPDATE_NS_PER_PARAM = {
    ("fp32", "nearest"): 0.45,
    ("hybrid8bit", "nearest"): 0.33,
    ("hybrid8bit", "stochastic"): 0.40,
    ("hybrid4bit", "nearest"): 0.27,
    ("hybrid4bit", "stochastic"): 0.37,
}
"""The CPU update's ns/param by (``optimizer.kind``, resolved ``optimizer.state_rounding``), the
H100 machine's 16-core host with a bf16 weight out, rounded up from one try each
(`bench/results/optim_h100-host_2026-12-07_rounding.md`: 0.329 / 0.396 for 8-bit nearest /
stochastic, 0.268 / 0.367 for 4-bit, torch's fused fp32 AdamW 0.402-0.492). A profile measures
the machine's own (`plan.costs`)."""


def update_ns_per_param(kind: str, rounding: str) -> float:
    """`UPDATE_NS_PER_PARAM` of an optimizer kind and its resolved state rounding (fp32 states
    have none)."""
    key = (kind, "nearest" if kind == "fp32" else rounding)
    if key not in UPDATE_NS_PER_PARAM:
        raise ValueError(f"no assumed update rate for optimizer.kind={kind} with {rounding} rounding; "
                         f"known: {', '.join(f'{k}/{r}' for k, r in UPDATE_NS_PER_PARAM)}")
    return UPDATE_NS_PER_PARAM[key]


@dataclass(kw_only=True, slots=True)
class MachineGuess:
    """Rough numbers of a machine (defaults: one H200 on PCIe Gen5, a large host, NVMe RAID)."""

    matmul_tflops: float = 550.0
    """Sustained bf16 rate of the layer's kernels."""
    h2d_gbps: float = 53.0
    d2h_gbps: float = 53.0
    bidir_gbps: float = 45.0
    nvme_read_gbps: float = 12.0
    nvme_write_gbps: float = 8.0
    optimizer_ns_per_param: float = 0.2
    """The CPU update's rate; the built-in estimate of a run sets its optimizer's
    (`update_ns_per_param`)."""
    copy_slowdown: float = 1.03
    device_step_ps_per_param: float = 30.0
    """The compiled GPU optimizer step of 8- or 4-bit states (the embedding's and head's with
    ``plan.const_update=device``, resident layers', streamed GPU steps'): the profiles of
    2026-12-04..07 measured 14-31 ps/param for 8-bit states on H100s and H200s and 28.6 for 4-bit
    ones on an H100 (`CostTable.const_update_ms` over ``const_params``)."""
    device_step_work_bytes: int = 1_700_000_000
    """That step's temporaries (`CostTable.device_step_work_bytes`): 1.61 GB measured for the
    4-bit step in pieces of 2^26 elements (H100, 2026-12-07), 0.54 GB for the 8-bit one."""
    expert_gemm_efficiency: float = 0.4
    """The routed experts' grouped GEMMs' rate over ``matmul_tflops``: one MoE profile so far,
    Qwen3-30B-A3B on an H100 (2026-12-07, 64 x 1024: a layer's forward 30.1 ms and backward
    62.9 ms, against 16.5 and 33.0 estimated with its experts at the dense rate; a dense
    Qwen2.5-14B layer there ran 59.5 / 128.1 ms against 67.0 / 134.1 estimated), 128 experts of
    768 x 2048 with ~4,096 tokens each."""
    hbm_gbps: float = 3500.0
    """Sustained GPU memory bandwidth of memory-bound kernels (the H200's HBM3e peaks at 4.8
    TB/s): an MoE layer's token permutation and its experts' weight reads."""
    gpu_bytes: int = 140 * 10**9
    gpu_reserve_bytes: int = 2 * 10**9
    """CUDA context, allocator slack and the like: part of the fixed GPU bytes."""
    host_bytes: int = 400 * 10**9
    nvme_bytes: int = 4 * 10**12
    device: str = "synthetic H200 (PCIe Gen5)"


def synthetic_cost_table(
    shape: DecoderShape,
    batch_size: int,
    seq_len: int,
    machine: MachineGuess | None = None,
    head_chunk_tokens: int = 4096,
) -> CostTable:
    """A `CostTable` for ``shape`` at (batch_size, seq_len) on ``machine`` (estimates only)."""
    mc = machine or MachineGuess()
    h, i, kv = shape.hidden, shape.intermediate, shape.kv_dim
    tokens = batch_size * seq_len
    rate = mc.matmul_tflops * 1e12 / 1e3  # FLOPs per ms
    params = shape.layer_params
    # Causal attention: QK^T and AV, half the score matrix.
    attention_flops = 2 * seq_len * h
    forward_ms = tokens * (2 * params + attention_flops) / rate + 0.2  # + launch overhead
    bf16 = 2
    # what a kept layer saves with the memory-lean ops (`lazytrain.model.lean`): its input, q/k/v,
    # the attention output, the residual after attention, gate and up (the norms' outputs are
    # recomputed from their inputs). Sub-layer options: the MLP keeps its input (the residual,
    # kept already) instead of gate and up; attention its input (the layer's) instead of q, k,
    # v and its output; mlp_up recomputes the up projection instead of keeping its output. The
    # lean MLP's mlp recomputes the gate and up projections (not the down one)
    mlp_flops = 2 * 2 * h * i
    attention_block_flops = 2 * (2 * h * h + 2 * h * kv) + attention_flops
    recompute_options = {
        "mlp": RecomputeCosts(
            saved_bytes=tokens * (4 * h + 2 * kv) * bf16,
            recompute_ms=tokens * mlp_flops / rate,
            backward_work_bytes=tokens * (6 * i + 4 * h) * bf16,
        ),
        "attention": RecomputeCosts(
            saved_bytes=tokens * (2 * h + 2 * i) * bf16,
            recompute_ms=tokens * attention_block_flops / rate,
            backward_work_bytes=tokens * (4 * i + 6 * h + 2 * kv) * bf16,
        ),
        "mlp_up": RecomputeCosts(
            saved_bytes=tokens * (4 * h + 2 * kv + i) * bf16,
            recompute_ms=tokens * 2 * h * i / rate,
            backward_work_bytes=tokens * (5 * i + 4 * h) * bf16,
        ),
    }
    layer = LayerCosts(
        params=params,
        weight_bytes=params * bf16,
        forward_ms=forward_ms,
        backward_ms=2 * forward_ms,
        recompute_ms=1.05 * forward_ms,
        input_bytes=tokens * h * bf16,
        saved_bytes=tokens * (4 * h + 2 * kv + 2 * i) * bf16,
        forward_work_bytes=tokens * (3 * i + h) * bf16,
        backward_work_bytes=tokens * (4 * i + 4 * h) * bf16,
        recompute_options=recompute_options,
    )
    const = shape.const_params
    head_flops = 6 * shape.vocab * h * tokens
    chunk = min(head_chunk_tokens, tokens)
    time_fit = ShapeFit(per_token=2 * params / rate, per_token_seq=2 * h / rate, const=0.2)
    return CostTable.uniform(
        shape.num_layers,
        layer,
        batch_size=batch_size,
        seq_len=seq_len,
        embed_forward_ms=0.5 + tokens * h * bf16 / 2e9,
        embed_backward_ms=1.0 + tokens * h * 4 / 1e9,
        head_ms=head_flops / rate,
        # the chunk's bf16 logits and their fp32 copy; per token: the final norm's input, output
        # and gradients, the selected hidden rows and their gradient
        head_work_bytes=chunk * shape.vocab * 6 + tokens * h * 12,
        head_token_bytes=h * 12,
        # the incoming gradient, the fp32 sums of the (at most) distinct tokens, one fp32 chunk
        embed_backward_work_bytes=(tokens * bf16 + min(tokens, shape.vocab) * 4 + min(tokens, 8192) * 4) * h,
        head_chunk_tokens=head_chunk_tokens,
        const_params=const,
        head_params=shape.head_params,
        const_weight_bytes=const * bf16,
        const_grad_bytes=const * bf16,
        h2d_gbps=mc.h2d_gbps,
        d2h_gbps=mc.d2h_gbps,
        bidir_gbps=mc.bidir_gbps,
        nvme_read_gbps=mc.nvme_read_gbps,
        nvme_write_gbps=mc.nvme_write_gbps,
        optimizer_ns_per_param=mc.optimizer_ns_per_param,
        copy_slowdown=mc.copy_slowdown,
        gpu_bytes=mc.gpu_bytes,
        gpu_fixed_bytes=2 * const * bf16 + mc.gpu_reserve_bytes,
        host_bytes=mc.host_bytes,
        nvme_bytes=mc.nvme_bytes,
        fits={
            "forward_ms": time_fit,
            "backward_ms": time_fit,
            "recompute_ms": time_fit,
        },
        device=mc.device,
        notes={"synthetic": True, "matmul_tflops": mc.matmul_tflops},
    )


def random_cost_table(seed: int, num_layers: int, *, uniform: bool = False, options: bool = True,
                      keep_forward: bool = True, const_update: bool = False) -> CostTable:
    """A random but self-consistent table, for fuzzing the planner (capacities unconstrained:
    GPU memory is set to fit every plan; tests shrink it). Layers may recompute a random subset
    of the sub-layer blocks (``options``); with ``keep_forward`` a kept layer's forward may have
    a measured working set of its own (else the no-grad forward's stands in); with
    ``const_update`` the table has the embedding's and head's GPU step (time and bytes)."""
    rng = random.Random(seed)

    def u(lo: float, hi: float) -> float:
        return rng.uniform(lo, hi)

    def layer() -> LayerCosts:
        forward = u(1, 50)
        input_bytes = int(u(0.01, 0.5) * GB)
        weights = int(u(0.05, 2.0) * GB)
        return LayerCosts(
            params=weights // 2,
            weight_bytes=weights,
            forward_ms=forward,
            backward_ms=forward * u(1.5, 2.5),
            recompute_ms=forward * u(1.0, 1.2),
            input_bytes=input_bytes,
            saved_bytes=int(input_bytes * u(1, 30)),
            forward_work_bytes=int(input_bytes * u(0, 20)),
            backward_work_bytes=int(input_bytes * u(0, 30)),
        )

    # the sub-layer options from a second generator: the tables without them stay as they were
    sub = random.Random(seed + 1)

    def with_options(lc: LayerCosts) -> LayerCosts:
        options = {}
        for name in sub.sample(RECOMPUTE_OPTIONS, sub.randint(0, len(RECOMPUTE_OPTIONS))):
            share = sub.uniform(0.1, 0.9)  # of the saved bytes beyond the input
            options[name] = RecomputeCosts(
                saved_bytes=lc.input_bytes + int((lc.saved_bytes - lc.input_bytes) * (1 - share)),
                recompute_ms=lc.recompute_ms * share * sub.uniform(0.8, 1.2),
                backward_work_bytes=int(lc.backward_work_bytes * sub.uniform(1.0, 1.5)),
            )
        return replace(lc, recompute_options=options)

    # the kept forwards' working sets from a third generator: about a third of the layers
    # stay unmeasured (None), as in tables profiled before they were
    fwd = random.Random(seed + 2)

    def measured_or_none(nbytes: int) -> int | None:
        return None if fwd.random() < 1 / 3 else int(nbytes * fwd.uniform(0.2, 1.5))

    def with_keep_forward(lc: LayerCosts) -> LayerCosts:
        return replace(lc, keep_forward_work_bytes=measured_or_none(lc.forward_work_bytes),
                       recompute_options={k: replace(rc, forward_work_bytes=measured_or_none(lc.forward_work_bytes))
                                          for k, rc in lc.recompute_options.items()})

    first = layer()
    layers = [replace(first) if uniform else layer() for _ in range(num_layers)]
    if options:
        first = with_options(layers[0])
        layers = [replace(first) if uniform else with_options(lc) for lc in layers]
    if keep_forward:
        first = with_keep_forward(layers[0])
        layers = [replace(first) if uniform else with_keep_forward(lc) for lc in layers]
    h2d, d2h = u(10, 60), u(10, 60)
    serial = h2d * d2h / (h2d + d2h)
    saved = sum(lc.saved_bytes for lc in layers)
    const_params = int(u(0.01, 1.0) * GB)
    table = CostTable(
        batch_size=rng.choice([1, 2, 4, 8]),
        seq_len=rng.choice([512, 1024, 4096]),
        layers=layers,
        embed_forward_ms=u(0.1, 5),
        embed_backward_ms=u(0.1, 5),
        head_ms=u(1, 100),
        head_work_bytes=int(u(0, 2) * GB),
        head_token_bytes=u(0, 20_000),
        embed_backward_work_bytes=int(u(0, 2) * GB),
        const_params=const_params,
        const_weight_bytes=2 * const_params,
        const_grad_bytes=2 * const_params,
        h2d_gbps=h2d,
        d2h_gbps=d2h,
        bidir_gbps=u(serial, min(h2d, d2h)),
        nvme_read_gbps=u(1, 15),
        nvme_write_gbps=u(1, 15),
        optimizer_ns_per_param=u(0, 1),
        copy_slowdown=u(1.0, 1.3),
        gpu_bytes=10**15,
        gpu_fixed_bytes=int(u(1, 10) * GB),
        host_bytes=rng.choice([0, int(u(0, 1) * saved), 10 * saved]),
        nvme_bytes=rng.choice([0, int(u(0, 1) * saved), 10 * saved]),
        device="random",
        # drawn last, so the draws above are those of tables from before the field: an older
        # table's (None: all constants updated first) or a share of the constants
        head_params=None if rng.random() < 0.3 else int(const_params * u(0, 0.6)),
    )
    if const_update:
        # from a fourth generator, so the table is otherwise the one without them: 1-50 ms per
        # billion parameters, 2-6 bytes per parameter of master remainder and states
        dev = random.Random(seed + 3)
        table.const_update_ms = const_params * dev.uniform(1e-9, 5e-8)
        table.const_update_bytes = int(const_params * dev.uniform(2, 6))
    return table


@dataclass(kw_only=True, slots=True)
class ExpertShape:
    """A mixture-of-experts MLP: ``num_experts`` SwiGLU experts of width ``intermediate``, a
    router choosing ``top_k`` of them per token, and a shared expert of width
    ``shared_intermediate`` with a sigmoid gate (0: none)."""

    num_experts: int
    top_k: int
    intermediate: int
    shared_intermediate: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts or self.intermediate < 1 or self.shared_intermediate < 0:
            raise ValueError(f"an MoE MLP needs 1 <= top_k <= num_experts and widths >= 1, got {self}")

    def expert_params(self, hidden: int) -> int:
        """One expert's (gate, up and down projections)."""
        return 3 * hidden * self.intermediate

    def active_params(self, hidden: int) -> int:
        """What one token computes with: router + ``top_k`` experts + the shared expert and its gate."""
        shared = 3 * hidden * self.shared_intermediate + hidden if self.shared_intermediate else 0
        return self.num_experts * hidden + self.top_k * self.expert_params(hidden) + shared


ROUTING_BYTES_PER_CHOICE = 20
"""Per token and chosen expert: its index (int64, as ``torch.topk`` gives it), its routing weight
(fp32) and its place in the permutation that groups tokens by expert (int64)."""


def moe_saved_bytes_per_token(experts: ExpertShape, hidden: int, dtype_bytes: int) -> float:
    """Bytes an MoE MLP keeps for its backward per token (beyond its input, the layer's residual,
    which the dense estimate counts already), in activations of ``dtype_bytes``:

    ``k (2 h + 2 I) b + 4 E + 20 k [+ (2 I_s + h + 1) b]``

    per chosen expert (k = top_k) the token's permuted hidden state (h, the grouped GEMM's input),
    the expert's gate and up outputs (2 I, the SwiGLU's backward) and its output (h, which the
    routing weight's gradient reads); the router's fp32 logits (E, for the softmax's backward);
    the routing indices, weights and permutation (`ROUTING_BYTES_PER_CHOICE`); with a shared
    expert its gate and up outputs, its output and its gate's logit."""
    h, k, b = hidden, experts.top_k, dtype_bytes
    shared = (2 * experts.shared_intermediate + h + 1) * b if experts.shared_intermediate else 0
    return k * (2 * h + 2 * experts.intermediate) * b + 4 * experts.num_experts + ROUTING_BYTES_PER_CHOICE * k + shared


@dataclass(kw_only=True, slots=True)
class LayerShape:
    """One decoder layer type's widths, as its parameters' shapes give them (`layer_shape`)."""

    params: int
    hidden: int
    intermediate: int
    """The MLP's width (an MoE's: each expert's)."""
    mixer_in: int
    """Widths the attention (or linear-attention) block projects its input to (q, k, v, gates):
    what it saves for backward besides its input."""
    mixer_out: int
    """Width its output projection takes (the attention output it saves)."""
    quadratic: bool
    """Full attention: its score FLOPs grow with the sequence (linear attention's state update
    is ~1% of a layer's matmul FLOPs per token, left out)."""
    mlp_params: int = 0
    """The MLP's parameters (every expert, the router, the shared expert); 0: 3 hidden
    intermediate, a SwiGLU's."""
    experts: ExpertShape | None = None
    """The MLP's experts (None: a dense MLP)."""

    @property
    def mixer_params(self) -> int:
        """The layer's parameters outside its MLP (attention or linear attention, norms)."""
        return self.params - (self.mlp_params or 3 * self.hidden * self.intermediate)

    @property
    def active_params(self) -> int:
        """The parameters one token computes with: all of a dense layer's; an MoE layer's
        attention and its MLP's active ones (`ExpertShape.active_params`)."""
        if self.experts is None:
            return self.params
        return self.mixer_params + self.experts.active_params(self.hidden)


OUTPUT_PROJECTIONS = ("o_proj.weight", "out_proj.weight")
"""The names that end an attention block's output projection in the supported families."""
EXPERTS = "mlp.experts."
"""Where an MoE MLP's stacked expert weights live (HF: ``gate_up_proj`` (E, 2 I, h) and
``down_proj`` (E, h, I))."""
SHARED_EXPERT = "mlp.shared_expert."


def layer_shape(params: Sequence[tuple[str, tuple[int, ...]]], hidden: int, quadratic: bool,
                top_k: int = 0) -> LayerShape:
    """The widths of a decoder layer of ``params`` (name, shape) in a model of width ``hidden``
    (matrices are HF ``(out, in)``; ``mlp.`` names the MLP). An MLP with stacked experts
    (``mlp.experts.*``, (num_experts, ...)) is a mixture of experts routing each token to
    ``top_k`` of them (the config's ``num_experts_per_tok``)."""
    matrices = [(n, s) for n, s in params if len(s) == 2]
    mixer = [(n, s) for n, s in matrices if not n.startswith("mlp.")]
    outputs = [s for n, s in mixer if n.endswith(OUTPUT_PROJECTIONS)]
    stacked = [(n, s) for n, s in params if n.startswith(EXPERTS)]
    if stacked:
        mlp_in = [s[0] for n, s in matrices if n.startswith(SHARED_EXPERT) and s[1] == hidden]
        experts = _experts(stacked, hidden, top_k, shared=max(mlp_in, default=0))
        intermediate = experts.intermediate
    else:
        mlp_in = [s[0] for n, s in matrices if n.startswith("mlp.") and s[1] == hidden]
        experts, intermediate = None, max(mlp_in, default=0)
    if not intermediate or len(outputs) != 1:
        raise ValueError(f"not a decoder layer with one attention output projection and an MLP: "
                         f"{[n for n, _ in matrices]}")
    return LayerShape(
        params=sum(math.prod(s) for _, s in params), hidden=hidden, intermediate=intermediate,
        mixer_in=sum(s[0] for n, s in mixer if s[1] == hidden and not n.endswith(OUTPUT_PROJECTIONS)),
        mixer_out=outputs[0][1], quadratic=quadratic,
        mlp_params=sum(math.prod(s) for n, s in params if n.startswith("mlp.")), experts=experts,
    )


def _experts(stacked: list[tuple[str, tuple[int, ...]]], hidden: int, top_k: int, shared: int) -> ExpertShape:
    """The `ExpertShape` of an MLP whose stacked expert weights are ``stacked``."""
    counts = {s[0] for _, s in stacked}
    per_expert = sum(math.prod(s[1:]) for _, s in stacked)
    if len(counts) != 1 or any(len(s) != 3 for _, s in stacked) or per_expert % (3 * hidden):
        raise ValueError(f"not stacked SwiGLU experts (num_experts, out, in) of width {hidden}: {stacked}")
    if top_k < 1:
        raise ValueError(f"an MoE layer ({counts.pop()} experts) needs its top_k (num_experts_per_tok) to be "
                         "estimated; pass layer_shape(..., top_k=)")
    return ExpertShape(num_experts=counts.pop(), top_k=top_k, intermediate=per_expert // (3 * hidden),
                       shared_intermediate=shared)


@dataclass(frozen=True, slots=True)
class _LayerTime:
    """A layer's forward milliseconds as `ShapeFit` terms: per token, per token and sequence
    position (attention scores), and per pass (launches; an MoE's expert weights read once)."""

    per_token: float
    per_token_seq: float
    const: float

    def ms(self, tokens: int, seq_len: int) -> float:
        return self.per_token * tokens + self.per_token_seq * tokens * seq_len + self.const


LAUNCH_MS = 0.2
"""A layer's forward launch overhead in the estimates."""


def _forward_time(shape: LayerShape, rate: float, hbm: float, dtype_bytes: int,
                  expert_efficiency: float = 1.0) -> _LayerTime:
    """`_LayerTime` of ``shape``'s forward at ``rate`` FLOPs/ms and ``hbm`` bytes/ms: 2 FLOPs per
    active parameter and token (a routed expert's at ``expert_efficiency`` of the rate:
    `MachineGuess.expert_gemm_efficiency`), attention scores, and for an MoE layer the
    permutation (its tokens gathered to their ``top_k`` experts and the outputs combined back:
    (2 k + 2) h values per token through memory) and every expert's weights read once."""
    attention = 2 * shape.mixer_out / rate if shape.quadratic else 0.0
    per_token, const = 2 * shape.active_params / rate, LAUNCH_MS
    if shape.experts is not None:
        routed = shape.experts.top_k * shape.experts.expert_params(shape.hidden)
        per_token += 2 * routed / rate * (1 / expert_efficiency - 1)
        per_token += (2 * shape.experts.top_k + 2) * shape.hidden * dtype_bytes / hbm
        const += shape.experts.num_experts * shape.experts.expert_params(shape.hidden) * dtype_bytes / hbm
    return _LayerTime(per_token=per_token, per_token_seq=attention, const=const)


def _estimated_layer(shape: LayerShape, tokens: int, seq_len: int, rate: float, hbm: float,
                     dtype_bytes: int, expert_efficiency: float = 1.0) -> LayerCosts:
    """`synthetic_cost_table`'s layer for any widths: the same saved tensors (the lean ops'),
    with the block's own projections in place of q, k, v and the attention output. An MoE
    layer's weights are all its experts', its times its active parameters' (`_forward_time`),
    and its MLP keeps `moe_saved_bytes_per_token` instead of a SwiGLU's gate and up outputs;
    it offers no ``mlp_up`` (the executor's experts are not a lean SwiGLU)."""
    h, i, mixed = shape.hidden, shape.intermediate, shape.mixer_in + shape.mixer_out
    b = dtype_bytes
    timing = _forward_time(shape, rate, hbm, b, expert_efficiency)
    forward_ms = timing.ms(tokens, seq_len)
    attention_flops = 2 * seq_len * shape.mixer_out if shape.quadratic else 0
    mixer_flops = 2 * shape.mixer_params + attention_flops
    if shape.experts is None:
        mlp_ms, mlp_saved, mlp_forward_work = tokens * 2 * 2 * h * i / rate, 2 * i * b, (3 * i + h) * b
        mlp_backward_work = (4 * i + 4 * h) * b
    else:
        e = shape.experts
        mlp_ms = forward_ms - tokens * mixer_flops / rate - LAUNCH_MS
        mlp_saved = moe_saved_bytes_per_token(e, h, b)
        # per chosen expert its permuted input, gate, up, activation and output; the router's fp32
        # logits and probabilities; the shared expert's gate, up and activation; the layer output
        mlp_forward_work = (e.top_k * (2 * h + 3 * i) + 3 * e.shared_intermediate + h) * b + 8 * e.num_experts
        # the gradients of all of those (the weight gradients are the simulator's, `grad_buffers`)
        mlp_backward_work = (e.top_k * (2 * h + 4 * i) + 4 * e.shared_intermediate + 4 * h) * b + 8 * e.num_experts
    options = {
        "mlp": RecomputeCosts(saved_bytes=round(tokens * ((2 * h + mixed) * b)), recompute_ms=mlp_ms,
                              backward_work_bytes=round(tokens * (mlp_backward_work + mlp_saved))),
        "attention": RecomputeCosts(saved_bytes=round(tokens * (2 * h * b + mlp_saved)),
                                    recompute_ms=tokens * mixer_flops / rate,
                                    backward_work_bytes=round(tokens * (mlp_backward_work + (h + shape.mixer_in) * b))),
    }
    if shape.experts is None:
        options["mlp_up"] = RecomputeCosts(saved_bytes=tokens * (2 * h + mixed + i) * b,
                                           recompute_ms=tokens * 2 * h * i / rate,
                                           backward_work_bytes=tokens * (5 * i + 4 * h) * b)
    return LayerCosts(
        params=shape.params, weight_bytes=shape.params * b, forward_ms=forward_ms, backward_ms=2 * forward_ms,
        recompute_ms=1.05 * forward_ms, input_bytes=tokens * h * b,
        saved_bytes=round(tokens * ((2 * h + mixed) * b + mlp_saved)),
        forward_work_bytes=round(tokens * mlp_forward_work), backward_work_bytes=round(tokens * mlp_backward_work),
        recompute_options=options,
    )


def estimated_cost_table(layer_types: Sequence[str], shapes: dict[str, LayerShape], *, vocab: int,
                         embed_params: int, final_params: int, batch_size: int, seq_len: int,
                         machine: MachineGuess | None = None, head_chunk_tokens: int = 4096,
                         device_state_bytes_per_param: float | None = None) -> CostTable:
    """An estimated `CostTable` for a model of any supported family, without profiling: each layer
    type's `LayerShape` (``shapes``), the embedding's and the final group's (norm, untied head)
    parameters, at (batch_size, seq_len) on ``machine``: times from FLOPs at its matmul rate,
    sizes from the tensors the lean ops save (bf16). With ``device_state_bytes_per_param`` (the
    master's and optimizer states' bytes a parameter stepped on the GPU keeps there; None: the
    optimizer has no GPU step) the GPU optimizer step at the machine's rate
    (`MachineGuess.device_step_ps_per_param`), so that plans may step the embedding and head,
    resident layers and streamed layers there; without it, none."""
    mc = machine or MachineGuess()
    tokens = batch_size * seq_len
    rate = mc.matmul_tflops * 1e12 / 1e3  # FLOPs per ms
    hbm = mc.hbm_gbps * 1e6  # bytes per ms
    h = next(iter(shapes.values())).hidden
    bf16 = 2
    eff = mc.expert_gemm_efficiency
    per_type = {kind: _estimated_layer(shape, tokens, seq_len, rate, hbm, bf16, eff) for kind, shape in shapes.items()}
    # the layers' time terms, averaged over the stack: one fit rescales every layer's times
    timings = [_forward_time(shapes[k], rate, hbm, bf16, eff) for k in layer_types]
    time_fit = ShapeFit(per_token=sum(t.per_token for t in timings) / len(timings),
                        per_token_seq=sum(t.per_token_seq for t in timings) / len(timings),
                        const=sum(t.const for t in timings) / len(timings))
    const = embed_params + final_params
    chunk = min(head_chunk_tokens, tokens)
    return CostTable.from_types(
        layer_types, per_type, batch_size=batch_size, seq_len=seq_len,
        embed_forward_ms=0.5 + tokens * h * bf16 / 2e9, embed_backward_ms=1.0 + tokens * h * 4 / 1e9,
        head_ms=6 * vocab * h * tokens / rate,
        head_work_bytes=chunk * vocab * 6 + tokens * h * 12, head_token_bytes=h * 12,
        embed_backward_work_bytes=(tokens * bf16 + min(tokens, vocab) * 4 + min(tokens, 8192) * 4) * h,
        head_chunk_tokens=head_chunk_tokens, const_params=const, head_params=final_params,
        const_weight_bytes=const * bf16, const_grad_bytes=const * bf16,
        h2d_gbps=mc.h2d_gbps, d2h_gbps=mc.d2h_gbps, bidir_gbps=mc.bidir_gbps,
        nvme_read_gbps=mc.nvme_read_gbps, nvme_write_gbps=mc.nvme_write_gbps,
        optimizer_ns_per_param=mc.optimizer_ns_per_param, copy_slowdown=mc.copy_slowdown,
        gpu_bytes=mc.gpu_bytes, gpu_fixed_bytes=2 * const * bf16 + mc.gpu_reserve_bytes,
        host_bytes=mc.host_bytes, nvme_bytes=mc.nvme_bytes,
        fits={"forward_ms": time_fit, "backward_ms": time_fit, "recompute_ms": time_fit},
        device=mc.device, notes={"estimate": True, "matmul_tflops": mc.matmul_tflops},
        **({} if device_state_bytes_per_param is None else {
            "const_update_ms": const * mc.device_step_ps_per_param * 1e-9,
            "const_update_bytes": round(const * device_state_bytes_per_param),
            "device_step_work_bytes": mc.device_step_work_bytes}),
    )

"""The `CostTable`: what one training step costs on this machine, layer by layer.

Plain data (no torch), round-trips to JSON. The runtime's profiler fills it from measurements
of the executor's own pieces (`lazytrain profile`); the simulator and the MILP read it. Costs
are per layer *type* (``layer_types``: one type for Qwen2/Qwen3/Llama, two for Qwen3.5's
linear- and full-attention layers): the profiler measures each type once and ``layers`` holds
each layer's own type's costs, so every reader takes layer i's numbers from ``layers[i]``.
Per-layer numbers are measured at one reference batch shape; `CostTable.at` rescales them to another
shape with fitted `ShapeFit` models, so the batch-size search does not re-profile.

Units: times in milliseconds, sizes in bytes, bandwidths in GB/s (1e9 bytes per second).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path

import numpy as np
from scipy.optimize import nnls

from lazytrain.errors import LazyTrainError
from lazytrain.plan.plan import RECOMPUTE

TABLE_VERSION = 2
"""What the profiler's fields mean. 1: a layer's ``backward_work_bytes`` left out the layer
output the backward starts from (it was in the profiler's base, and no saved tensor); `CostTable`
adds it (``input_bytes``, the output's size) to a version-1 table when it loads one."""

OLD_DEVICE_STEP_CHUNK = 1 << 23
"""The GPU optimizer step's piece in tables without ``device_step_chunk`` (before 2026-12-05)."""

GPU_RESERVE_FRACTION = 0.05
"""Share of a GPU memory capacity the planner leaves unplanned: the caching allocator's
fragmentation and small buffers the model does not count (on the H200 a solved plan
predicted at 97% of the card ran out of memory with 2.7 GiB reserved but unallocated)."""


class CostTableMismatch(LazyTrainError, ValueError):
    pass


ATTENTIONS = ("causal", "packed", "packed_varlen")
"""What a table's layers were profiled with (`CostTable.attention`)."""


def usable_gpu_bytes(capacity: int) -> int:
    """The part of ``capacity`` bytes a plan may fill."""
    return int(capacity * (1.0 - GPU_RESERVE_FRACTION))


@dataclass(kw_only=True, slots=True)
class ShapeFit:
    """How a quantity scales with the batch shape (b = batch size, s = sequence length):

    ``value(b, s) = per_token * b*s + per_token_seq * b*s*s + const``

    Matmuls are linear in tokens, attention scores are quadratic in ``s`` per sequence and
    launch overheads are constant. Only ratios between two shapes are used (the per-layer
    values are measured at the table's reference shape), so the coefficients need no unit.
    """

    per_token: float = 1.0
    per_token_seq: float = 0.0
    const: float = 0.0

    def __post_init__(self) -> None:
        coeffs = (self.per_token, self.per_token_seq, self.const)
        if min(coeffs) < 0 or max(coeffs) <= 0:
            raise ValueError(
                f"shape fit coefficients must be >= 0 and not all zero, got {coeffs}; "
                "refit with ShapeFit.fit on measurements at several batch shapes"
            )

    def __call__(self, batch: int, seq: int) -> float:
        tokens = batch * seq
        return self.per_token * tokens + self.per_token_seq * tokens * seq + self.const

    def ratio(self, batch: int, seq: int, ref_batch: int, ref_seq: int) -> float:
        """value(batch, seq) / value(ref_batch, ref_seq)."""
        return self(batch, seq) / self(ref_batch, ref_seq)

    @classmethod
    def fit(
        cls,
        samples: Sequence[tuple[int, int, float]],
        *,
        quadratic: bool = True,
        const: bool = True,
    ) -> ShapeFit:
        """Non-negative least squares through ``(batch, seq, value)`` measurements."""
        columns = [lambda b, s: b * s]
        if quadratic:
            columns.append(lambda b, s: b * s * s)
        if const:
            columns.append(lambda b, s: 1.0)
        if len(samples) < len(columns):
            raise ValueError(
                f"fitting {len(columns)} coefficients needs at least {len(columns)} "
                f"measurements, got {len(samples)}; profile more batch shapes"
            )
        a = np.array([[col(b, s) for col in columns] for b, s, _ in samples], dtype=float)
        y = np.array([v for _, _, v in samples], dtype=float)
        scale = a.max(axis=0)
        coef, _ = nnls(a / scale, y)
        coef = list(coef / scale)
        per_token = coef.pop(0)
        per_token_seq = coef.pop(0) if quadratic else 0.0
        constant = coef.pop(0) if const else 0.0
        return cls(per_token=per_token, per_token_seq=per_token_seq, const=constant)


UNIFORM_TYPE = "full_attention"
"""The layer type of a table without ``layer_types`` (every family before Qwen3.5)."""

TOKEN_LINEAR = ShapeFit()

FITTED = (
    "forward_ms",
    "backward_ms",
    "recompute_ms",
    "input_bytes",
    "saved_bytes",
    "forward_work_bytes",
    "backward_work_bytes",
    "embed_ms",
    "head_ms",
)
"""Quantities `CostTable.at` rescales; each has a `ShapeFit` in `CostTable.fits`."""


def default_fits() -> dict[str, ShapeFit]:
    """Everything linear in tokens."""
    return {name: replace(TOKEN_LINEAR) for name in FITTED}


RECOMPUTE_OPTIONS = tuple(r for r in RECOMPUTE if r != "none")
"""What a kept layer may recompute in its backward (``LayerPlan.recompute``): a block, or the
MLP's up projection."""


@dataclass(kw_only=True, slots=True)
class RecomputeCosts:
    """A kept layer that recomputes one block in its backward (``LayerPlan.recompute``)."""

    saved_bytes: int
    """What the layer keeps: the other blocks' saved tensors and this block's inputs."""
    recompute_ms: float
    """The block's re-forward under autograd (a lean SwiGLU's ``mlp``: its gate and up matmuls;
    ``mlp_up``: the up matmul), added to the layer's backward."""
    backward_work_bytes: int
    """Peak transient bytes during backward beyond ``saved_bytes`` (the recomputed block's
    tensors included)."""
    forward_work_bytes: int | None = None
    """Peak transient bytes of the kept layer's forward (under autograd) beyond the saved tensors
    it allocates, the output included. None: not measured (tables profiled before 2026-12-02);
    `LayerCosts.kept` then gives the no-grad forward's `LayerCosts.forward_work_bytes`, which
    over-counts: the no-grad peak holds intermediates that a kept forward counts among its
    saved tensors (on the H200's Qwen3.5-9B largest-batch runs kept layers' forward stages measured
    6.1-6.3 GB below the prediction on average, 35-44 KB/token, up to 28.5 GB)."""

    def __post_init__(self) -> None:
        if self.saved_bytes < 0 or self.recompute_ms < 0 or self.backward_work_bytes < 0 \
                or (self.forward_work_bytes or 0) < 0:
            raise ValueError(f"recompute costs must be >= 0, got {self}")


@dataclass(kw_only=True, slots=True)
class LayerCosts:
    """One decoder layer at the table's reference batch shape."""

    params: int
    """Parameters of the layer (the CPU optimizer steps them)."""
    weight_bytes: int
    """Bytes of the layer's streamed bf16 weights; its gradient has the same size."""
    forward_ms: float
    """Forward of the layer (also the no-grad re-forward that rebuilds a segment's inputs)."""
    backward_ms: float
    """Backward only, excluding any re-forward."""
    recompute_ms: float
    """Re-forward under autograd that recreates the saved tensors before backward."""
    input_bytes: int
    """The layer input: what a checkpoint keeps."""
    saved_bytes: int
    """All tensors autograd saves for the backward, the input included."""
    forward_work_bytes: int
    """Peak transient bytes of the no-grad forward (a checkpointed or dropped layer's, a
    segment's re-forward), the output included, beyond the input."""
    backward_work_bytes: int
    """Peak transient bytes during backward beyond the saved tensors: the layer output the
    backward starts from, the gradient flowing in, the gradients it produces (the layer's weight
    gradients among them: `CostTable.at` keeps those at their size)."""
    recompute_options: dict[str, RecomputeCosts] = field(default_factory=dict)
    """Per block of ``RECOMPUTE_OPTIONS`` the layer can recompute when kept (a table written
    before these existed has none: no plan recomputes a block)."""
    keep_forward_work_bytes: int | None = None
    """The forward's transient bytes when the layer is kept (``RecomputeCosts.forward_work_bytes``
    of the whole-layer keep); None: not measured, ``forward_work_bytes`` stands in."""

    def __post_init__(self) -> None:
        self.recompute_options = {
            k: v if isinstance(v, RecomputeCosts) else RecomputeCosts(**v)
            for k, v in self.recompute_options.items()
        }
        unknown = sorted(set(self.recompute_options) - set(RECOMPUTE_OPTIONS))
        if unknown:
            raise ValueError(f"recompute options {unknown} are not among {RECOMPUTE_OPTIONS}")
        for name in ("params", "weight_bytes", "input_bytes", "saved_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"layer {name} must be >= 0, got {getattr(self, name)}")
        for name in ("forward_ms", "backward_ms", "recompute_ms"):
            if getattr(self, name) < 0:
                raise ValueError(f"layer {name} must be >= 0, got {getattr(self, name)}")
        if self.forward_work_bytes < 0 or self.backward_work_bytes < 0 or (self.keep_forward_work_bytes or 0) < 0:
            raise ValueError("layer working-set bytes must be >= 0")
        if self.saved_bytes < self.input_bytes:
            raise ValueError(
                f"layer saved_bytes ({self.saved_bytes}) < input_bytes ({self.input_bytes}): "
                "saved tensors include the layer input; re-profile the layer"
            )

    def kept(self, recompute: str = "none") -> RecomputeCosts:
        """The layer kept, recomputing ``recompute`` (``none``: nothing) in its backward."""
        if recompute == "none":
            return RecomputeCosts(saved_bytes=self.saved_bytes, recompute_ms=0.0,
                                  backward_work_bytes=self.backward_work_bytes,
                                  forward_work_bytes=self._measured_or_no_grad(self.keep_forward_work_bytes))
        if recompute not in self.recompute_options:
            raise CostTableMismatch(
                f"the cost table has no costs for a kept layer recomputing {recompute!r} (it has "
                f"{sorted(self.recompute_options) or 'none'}); re-profile (`lazytrain profile`) "
                "or plan without sub-layer recompute"
            )
        option = self.recompute_options[recompute]
        return replace(option, forward_work_bytes=self._measured_or_no_grad(option.forward_work_bytes))

    def _measured_or_no_grad(self, forward_work: int | None) -> int:
        """A kept forward's transient bytes, or the no-grad forward's where none was measured."""
        return self.forward_work_bytes if forward_work is None else forward_work


@dataclass(kw_only=True, slots=True)
class CostTable:
    """Measured (or synthetic) costs of one training step, the planner's only input.

    Per-layer numbers hold at the reference shape ``(batch_size, seq_len)``; use `at` for
    another shape. The embedding, final norm and LM head are constant terms: resident on the
    GPU (inside ``gpu_fixed_bytes``), not streamed.
    """

    batch_size: int
    seq_len: int
    layers: list[LayerCosts]
    """Each decoder layer's costs: those of its type."""

    embed_forward_ms: float
    embed_backward_ms: float
    head_ms: float
    """Final norm + chunked LM head + loss, forward and backward together."""
    head_work_bytes: int
    """Peak transient bytes of the final norm, chunked head and loss (beyond its input) at
    the table's shape."""
    head_token_bytes: float
    """What ``head_work_bytes`` grows by per token: the final norm's and the hidden states'
    per-token tensors (the head's chunk of logits is the same at any batch that fills a
    chunk). The profiler measures the head at two token counts."""
    embed_backward_work_bytes: int
    """Peak transient bytes of the embedding's backward: the gradient flowing into it and the
    fp32 sums of the batch's tokens (`ModelAdapter.embed_backward`), beyond the resident
    weights and their gradients (``gpu_fixed_bytes``)."""
    const_params: int
    """Parameters outside the decoder layers (embedding, final norm, head)."""
    const_weight_bytes: int
    """bf16 bytes of those parameters: copied back to the GPU after each CPU step."""
    const_grad_bytes: int
    """Their gradient bytes, copied to the host at the end of backward."""
    head_params: int | None = None
    """Of ``const_params``, the last group's (final norm and, untied, the head): the overlapped
    CPU update steps it after the layers and the embedding before them (`HostUpdater`), so the
    head waits for it and the first forward does not. None (tables written before 2026-12-04):
    the step models update and upload all of ``const_params`` before the embedding."""

    const_update_ms: float | None = None
    """The AdamW step of the embedding and the final group together on the GPU (a plan's
    ``const_update="device"``), timed by the profiler with the run's optimizer; None (tables
    written before 2026-12-04, or an optimizer without a device step): the planner keeps them
    on the host."""
    const_update_bytes: int = 0
    """GPU bytes those groups' master remainder (or fp32 master) and optimizer state take
    while they are stepped there (through the whole step, beside ``gpu_fixed_bytes``)."""
    device_step_work_bytes: int = 0
    """GPU bytes a decoder layer's optimizer step on the GPU allocates while it runs (its
    temporaries, one piece at a time), beyond what it steps; counted for the streamed steps
    (`Plan.device_steps`), which run beside the forward. 0: not measured (tables written before
    2026-12-05, a CPU or multi-rank profile, an optimizer without a device step)."""
    device_step_chunk: int | None = None
    """Elements per piece of that step when ``const_update_ms`` and ``device_step_work_bytes``
    were measured (`HostOptimizer.device_step_chunk`); None: tables written before it was
    recorded, whose pieces were ``OLD_DEVICE_STEP_CHUNK`` (`for_device_step_chunk`)."""

    h2d_gbps: float
    d2h_gbps: float
    bidir_gbps: float
    """Per-direction bandwidth while host-to-device and device-to-host copies run together."""
    nvme_read_gbps: float
    nvme_write_gbps: float
    optimizer_ns_per_param: float
    """CPU optimizer step time per parameter (all worker threads)."""
    copy_slowdown: float = 1.0
    """Compute runs this many times slower while a PCIe copy is in flight (>= 1)."""

    gpu_bytes: int
    """GPU memory the step may use, the fixed part included (`usable_gpu_bytes` of the
    card or of the cap: the profiler leaves the allocator's reserve out)."""
    gpu_fixed_bytes: int
    """Resident for the whole step: embedding, head, final norm, allocator reserve, ..."""
    host_bytes: int
    """Pinned host memory available for activations beyond the fixed model state."""
    host_grads: bool = True
    """Whether that fixed state holds a host gradient buffer for every streamed decoder layer
    (True: as until 2026-12-06). False: the plan places them (`LayerPlan.grad`, the planner's
    ``memory.gradients``): ``host_bytes`` is the room beside the rest of the state, and each
    streamed layer whose gradient waits on the host takes its buffer from it."""
    nvme_bytes: int = 0
    """NVMe space for activations (0: no NVMe tier)."""
    head_chunk_tokens: int = 0
    """Tokens per head + loss chunk when ``head_work_bytes`` was measured (0: unknown)."""

    world_size: int = 1
    """Data-parallel ranks: each rank brings back 1/world_size of every gradient (reduce-
    scattered on the GPUs first) and steps 1/world_size of the parameters."""
    local_world_size: int = 1
    """Ranks per host, sharing its PCIe root complexes, memory bandwidth and cores: the
    bandwidths above are one rank's while this many copy at once, and
    ``optimizer_ns_per_param`` is per parameter of the model on this rank's share of cores
    and elements (see `for_ranks`)."""

    fits: dict[str, ShapeFit] = field(default_factory=default_fits)
    optimizer: str = ""
    """The CPU optimizer ``optimizer_ns_per_param`` was timed on (`optim.factory.describe`:
    fp32, hybrid8bit/nearest, hybrid8bit/stochastic, hybrid4bit/nearest, ...); empty in tables written before it was
    recorded."""
    attention: str = "causal"
    """The attention the layers were profiled with (`ATTENTIONS`): causal (unmasked rows, and
    rows padded on the right, which need no mask), packed (several documents per row,
    `data.packing`, through a block-diagonal mask) or packed_varlen (packed rows through flash
    attention's variable-length kernel, no mask), whose kernels differ in time and saved bytes
    (sdpa has no flash path for a dense mask)."""
    elementwise: str = ""
    """How the lean ops' elementwise parts ran when profiled (`model.fused_ops` as resolved:
    eager or compiled), which differ in time (a 7B layer 172 against 152 ms on the H200) and in
    a layer's working set; empty in tables written before it was recorded (eager)."""
    device: str = ""
    notes: dict = field(default_factory=dict)
    layer_types: list[str] = field(default_factory=list)
    """Each decoder layer's type (HF ``layer_types`` names); empty in tables written before
    types existed: one type, ``full_attention``."""
    version: int = TABLE_VERSION
    """What the measured fields mean (`TABLE_VERSION`); a file without it is version 1."""

    def __post_init__(self) -> None:
        if self.attention not in ATTENTIONS:
            raise CostTableMismatch(f"cost table attention must be one of {', '.join(ATTENTIONS)}, got "
                                    f"{self.attention!r}: the file was not written by `lazytrain profile`; "
                                    "profile again")
        self.layers = [lc if isinstance(lc, LayerCosts) else LayerCosts(**lc) for lc in self.layers]
        if self.version < 2:
            # the profiler's backward window started with the layer output allocated (in its
            # base): add it, a hidden state like the layer input (measured on the H200: every
            # checkpointed layer's backward 8.0-8.2 KB/token, one bf16 4096-wide state, above
            # the prediction)
            self.layers = [
                replace(lc, backward_work_bytes=lc.backward_work_bytes + lc.input_bytes,
                        recompute_options={k: replace(rc, backward_work_bytes=rc.backward_work_bytes + lc.input_bytes)
                                           for k, rc in lc.recompute_options.items()})
                for lc in self.layers
            ]
            self.version = 2
        if not self.layer_types:
            self.layer_types = [UNIFORM_TYPE] * len(self.layers)
        if len(self.layer_types) != len(self.layers):
            raise ValueError(
                f"cost table has {len(self.layers)} layers but {len(self.layer_types)} layer "
                "types; give one type per decoder layer"
            )
        fits = default_fits()
        fits.update(
            {k: v if isinstance(v, ShapeFit) else ShapeFit(**v) for k, v in self.fits.items()}
        )
        self.fits = fits
        if self.batch_size < 1 or self.seq_len < 1:
            raise ValueError(
                f"cost table batch_size and seq_len must be >= 1, got "
                f"{self.batch_size}, {self.seq_len}"
            )
        if not self.layers:
            raise ValueError("cost table has no layers; profile at least one decoder layer")
        for name in ("h2d_gbps", "d2h_gbps", "bidir_gbps", "nvme_read_gbps", "nvme_write_gbps"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        serial = self.h2d_gbps * self.d2h_gbps / (self.h2d_gbps + self.d2h_gbps)
        if not serial * (1 - 1e-9) <= self.bidir_gbps <= min(self.h2d_gbps, self.d2h_gbps):
            raise ValueError(
                f"bidir_gbps {self.bidir_gbps} must lie between {serial:.3f} (both directions "
                f"one after the other) and {min(self.h2d_gbps, self.d2h_gbps)} (the slower single "
                "direction); re-measure the concurrent copy bandwidth"
            )
        if self.copy_slowdown < 1:
            raise ValueError(f"copy_slowdown must be >= 1, got {self.copy_slowdown}")
        if self.const_update_ms is not None and self.const_update_ms < 0:
            raise ValueError(f"const_update_ms must be >= 0 or None, got {self.const_update_ms}")
        if self.const_update_bytes < 0:
            raise ValueError(f"const_update_bytes must be >= 0, got {self.const_update_bytes}")
        if self.device_step_work_bytes < 0:
            raise ValueError(f"device_step_work_bytes must be >= 0, got {self.device_step_work_bytes}")
        if self.optimizer_ns_per_param < 0:
            raise ValueError(
                f"optimizer_ns_per_param must be >= 0, got {self.optimizer_ns_per_param}"
            )
        for name in ("gpu_bytes", "gpu_fixed_bytes", "host_bytes", "nvme_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 1 <= self.local_world_size <= self.world_size or self.world_size % self.local_world_size:
            raise ValueError(
                f"local_world_size {self.local_world_size} must divide world_size {self.world_size}"
            )

    @property
    def mask_bytes(self) -> int:
        """Packed rows' attention mask, [B, 1, S, S] booleans on the GPU for the whole step (its
        attention layers read it; 64 MiB at 64 x 1024, 2 GiB at 2 x 32768); none unmasked or on
        the varlen path."""
        attention_layers = any(kind != "linear_attention" for kind in self.layer_types or ["full_attention"])
        return self.batch_size * self.seq_len**2 if self.attention == "packed" and attention_layers else 0

    @property
    def step_fixed_bytes(self) -> int:
        """GPU bytes held through the whole step from the head on: ``gpu_fixed_bytes`` and the
        attention mask (`mask_bytes`)."""
        return self.gpu_fixed_bytes + self.mask_bytes

    @property
    def forward_fixed_bytes(self) -> int:
        """What of `step_fixed_bytes` is resident before the head: the embedding's and the head's
        weights, not their gradients (the head's is allocated in the head, inside
        ``head_work_bytes``; both are held from then to the end of the step), and the mask."""
        return max(self.gpu_fixed_bytes - self.const_grad_bytes, 0) + self.mask_bytes

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def total_params(self) -> int:
        return sum(lc.params for lc in self.layers) + self.const_params

    @property
    def tokens(self) -> int:
        return self.batch_size * self.seq_len

    @property
    def layer_grad_bytes(self) -> float:
        """Bytes of this rank's host gradient buffers of every decoder layer."""
        return sum(lc.weight_bytes for lc in self.layers) * self.grad_share

    @property
    def grad_share(self) -> float:
        """Fraction of each gradient that one rank copies to the host."""
        return 1.0 / self.world_size

    @property
    def grad_buffers(self) -> float:
        """Layer gradients live on the GPU at once, in layer sizes: two (one being copied
        out while the next is produced); with several ranks also the flat buffer that is
        reduce-scattered and this rank's chunk of it."""
        return 2.0 if self.world_size == 1 else 3.0 + 1.0 / self.world_size

    def for_ranks(self, world_size: int, local_world_size: int) -> CostTable:
        """The table of one rank of ``world_size`` (``local_world_size`` per host).

        Bandwidths measured with ``self.local_world_size`` ranks copying at once are shared
        out among ``local_world_size`` (the host side of PCIe, not the GPU side, is what they
        share; a profile taken with every local rank copying needs no rescaling). A rank's
        CPU step covers 1/world_size of the elements on 1/local_world_size of the cores.
        """
        share = self.local_world_size / local_world_size
        return replace(
            self,
            h2d_gbps=self.h2d_gbps * share,
            d2h_gbps=self.d2h_gbps * share,
            bidir_gbps=self.bidir_gbps * share,
            optimizer_ns_per_param=self.optimizer_ns_per_param / share * self.world_size / world_size,
            # the executor steps the resident groups on the GPU in a single process only
            const_update_ms=self.const_update_ms if world_size == 1 else None,
            world_size=world_size,
            local_world_size=local_world_size,
            layers=[replace(lc) for lc in self.layers],
            fits={k: replace(v) for k, v in self.fits.items()},
            notes=dict(self.notes),
        )

    def for_device_step_chunk(self, chunk: int | None) -> CostTable:
        """This table for a GPU optimizer step in pieces of ``chunk`` elements (the run's
        optimizer's `device_step_chunk`), where it was measured with other pieces: the
        temporaries (``device_step_work_bytes``, one piece's) scaled by the elements of a layer's
        piece (the same kernels, the same bytes per element), the step's time
        (``const_update_ms``) kept (each piece costs the host its launches: an upper bound where
        the pieces grew). Itself where the pieces match or nothing was measured."""
        measured = self.device_step_chunk or OLD_DEVICE_STEP_CHUNK
        if chunk is None or chunk == measured or not self.device_step_work_bytes:
            return self
        layer = max(lc.params for lc in self.layers)
        scale = min(chunk, layer) / min(measured, layer)
        return replace(self, device_step_work_bytes=round(self.device_step_work_bytes * scale),
                       device_step_chunk=chunk, layers=[replace(lc) for lc in self.layers],
                       fits={k: replace(v) for k, v in self.fits.items()},
                       notes={**self.notes, "device_step_chunk": (
                           f"device_step_work_bytes measured in pieces of {measured} elements, scaled to {chunk}")})

    def const_split(self) -> tuple[tuple[float, float], tuple[float, float]]:
        """((params, weight bytes) updated and uploaded before the forward, (the same) before
        the head): the embedding's, then the last group's (`head_params`)."""
        head = self.head_params or 0
        if not 0 <= head <= self.const_params:
            raise CostTableMismatch(f"head_params {head} is outside 0..const_params ({self.const_params}): "
                                    "the table is inconsistent; profile again")
        head_bytes = self.const_weight_bytes * head / self.const_params if self.const_params else 0.0
        return ((self.const_params - head, self.const_weight_bytes - head_bytes), (head, head_bytes))

    @property
    def optimizer_ms(self) -> float:
        """CPU step over all parameters."""
        return self.optimizer_ns_per_param * self.total_params * 1e-6

    @classmethod
    def uniform(cls, num_layers: int, layer: LayerCosts, **kwargs) -> CostTable:
        """A table whose decoder layers all cost the same (one layer type)."""
        return cls(layers=[replace(layer) for _ in range(num_layers)], **kwargs)

    @classmethod
    def from_types(cls, layer_types: Sequence[str], costs: dict[str, LayerCosts], **kwargs) -> CostTable:
        """A table whose layer i costs ``costs[layer_types[i]]``."""
        missing = sorted(set(layer_types) - set(costs))
        if missing:
            raise ValueError(f"no costs for layer types {missing}; profile every type the model has")
        return cls(layers=[replace(costs[t]) for t in layer_types], layer_types=list(layer_types), **kwargs)

    def check_optimizer(self, optimizer: str, source: str = "the cost table") -> None:
        """Raise `CostTableMismatch` unless this table's optimizer time is ``optimizer``'s (a
        table from before it was recorded passes)."""
        if self.optimizer and optimizer != self.optimizer:
            raise CostTableMismatch(
                f"{source} timed the CPU optimizer as {self.optimizer}, this run steps {optimizer} "
                "(optimizer.kind, optimizer.state_rounding), whose step takes another time; profile "
                "with this run's optimizer settings (`lazytrain profile`) or drop plan.costs"
            )

    def check_const_update(self, const_update: str) -> None:
        """Raise `CostTableMismatch` if a plan's ``const_update`` needs a time this table lacks."""
        if const_update == "device" and self.const_update_ms is None:
            raise CostTableMismatch(
                "const_update='device' steps the embedding and head on the GPU, but the cost table has no "
                "const_update_ms (written before 2026-12-04, for several ranks, or with an optimizer without "
                "a device step); profile again (`lazytrain profile`, optimizer.kind=hybrid8bit, one process) "
                "or use const_update=host"
            )

    def device_update_ms(self, device_layers: int = 0) -> float:
        """The GPU step of the embedding and head and of the first ``device_layers`` decoder layers
        (`Plan.device_layers`): elementwise, so ``const_update_ms`` scaled by parameters."""
        self.check_const_update("device")
        return self.const_update_ms * (1 + self._resident_share(device_layers))

    def device_resident_bytes(self, device_layers: int = 0) -> float:
        """GPU bytes the first ``device_layers`` decoder layers hold through the step when they are
        resident and stepped there: their weights, master remainders and optimizer states
        (``const_update_bytes`` scaled by parameters); their gradients come on top from their
        backward on."""
        weights = sum(lc.weight_bytes for lc in self.layers[:device_layers])
        return weights + self.const_update_bytes * self._resident_share(device_layers)

    def streamed_step_ms(self, layer: int) -> float:
        """The GPU step of streamed layer ``layer`` (`Plan.device_steps`): ``const_update_ms``
        scaled by its parameters, as for a resident layer."""
        self.check_const_update("device")
        return self.const_update_ms * self._layer_share(layer)

    def streamed_out_bytes(self, layer: int) -> float:
        """Bytes streamed layer ``layer``'s GPU step (`Plan.device_steps`) copies back to the
        host: its weights (the split master's bf16 half) and its master remainder and optimizer
        state (``const_update_bytes`` scaled by parameters)."""
        return self.layers[layer].weight_bytes + self.const_update_bytes * self._layer_share(layer)

    def streamed_in_bytes(self, layer: int) -> float:
        """Bytes streamed layer ``layer``'s GPU step copies in: what it copies out, and the
        gradient (which went to the host in the backward, as every streamed layer's does)."""
        return self.streamed_out_bytes(layer) + self.layers[layer].weight_bytes * self.grad_share

    def _layer_share(self, layer: int) -> float:
        if self.const_params <= 0:
            raise CostTableMismatch("device_steps scales the GPU step of the embedding and head by parameters, "
                                    "but the table has no const_params; profile again")
        return self.layers[layer].params / self.const_params

    def _resident_share(self, device_layers: int) -> float:
        if not device_layers:
            return 0.0
        if not 0 <= device_layers <= self.num_layers:
            raise ValueError(f"device_layers must be in 0..{self.num_layers} (the table's layers), got {device_layers}")
        if self.const_params <= 0:
            raise CostTableMismatch("device_layers scales the GPU step of the embedding and head by parameters, "
                                    "but the table has no const_params; profile again")
        return sum(lc.params for lc in self.layers[:device_layers]) / self.const_params

    def check_attention(self, attention: str, source: str = "the cost table") -> None:
        """Raise `CostTableMismatch` unless this table was profiled with ``attention``."""
        if attention != self.attention:
            raise CostTableMismatch(
                f"{source} was profiled with {self.attention} attention, this run's batches take "
                f"{attention} attention (data.packing={'false' if attention == 'causal' else 'true'}; packed "
                "rows take varlen or the mask by model.packed_attention, the device and the dtype), whose "
                "kernels cost other times and bytes; profile with this run's settings (`lazytrain "
                "profile`) or drop plan.costs"
            )

    def check_elementwise(self, kind: str, source: str = "the cost table") -> None:
        """Raise `CostTableMismatch` unless this table's layers ran ``kind`` elementwise ops."""
        if kind != (self.elementwise or "eager"):
            raise CostTableMismatch(
                f"{source} was profiled with {self.elementwise or 'eager'} elementwise ops, this run's layers "
                f"run {kind} ones (model.fused_ops, and the device), whose layers take other times and "
                "working memory; profile with this run's settings (`lazytrain profile`), set "
                f"model.fused_ops={self.elementwise or 'eager'}, or drop plan.costs"
            )

    def check_layers(self, layer_types: Sequence[str], source: str = "the cost table") -> None:
        """Raise `CostTableMismatch` unless this table describes a stack of ``layer_types``."""
        if list(layer_types) != self.layer_types:
            raise CostTableMismatch(
                f"{source} is for {self.num_layers} layers of types {sorted(set(self.layer_types))}, "
                f"the model has {len(layer_types)} of types {sorted(set(layer_types))}; profile "
                "this model (`lazytrain profile`) or drop plan.costs"
            )

    def type_costs(self) -> dict[str, LayerCosts]:
        """Each layer type's costs (those of its first layer), in order of first appearance."""
        out: dict[str, LayerCosts] = {}
        for kind, lc in zip(self.layer_types, self.layers):
            out.setdefault(kind, lc)
        return out

    def at(self, batch_size: int, seq_len: int) -> CostTable:
        """The same machine and model at another batch shape, rescaled with `fits`."""
        if batch_size < 1 or seq_len < 1:
            raise ValueError(f"batch shape must be >= 1, got ({batch_size}, {seq_len})")
        ref = (self.batch_size, self.seq_len)

        def ratio(name: str) -> float:
            return self.fits[name].ratio(batch_size, seq_len, *ref)

        scaled = {name: ratio(name) for name in FITTED}

        def forward_work(nbytes: int | None) -> int | None:
            return None if nbytes is None else round(nbytes * scaled["forward_work_bytes"])

        def backward_work(lc: LayerCosts, nbytes: int) -> int:
            # the layer's weight gradients are in the backward's working set at their own size
            grads = min(lc.weight_bytes, nbytes)
            return grads + round((nbytes - grads) * scaled["backward_work_bytes"])

        layers = [
            replace(
                lc,
                forward_ms=lc.forward_ms * scaled["forward_ms"],
                backward_ms=lc.backward_ms * scaled["backward_ms"],
                recompute_ms=lc.recompute_ms * scaled["recompute_ms"],
                input_bytes=round(lc.input_bytes * scaled["input_bytes"]),
                saved_bytes=max(
                    round(lc.saved_bytes * scaled["saved_bytes"]),
                    round(lc.input_bytes * scaled["input_bytes"]),
                ),
                forward_work_bytes=round(lc.forward_work_bytes * scaled["forward_work_bytes"]),
                keep_forward_work_bytes=forward_work(lc.keep_forward_work_bytes),
                backward_work_bytes=backward_work(lc, lc.backward_work_bytes),
                recompute_options={
                    k: RecomputeCosts(
                        saved_bytes=round(rc.saved_bytes * scaled["saved_bytes"]),
                        recompute_ms=rc.recompute_ms * scaled["recompute_ms"],
                        backward_work_bytes=backward_work(lc, rc.backward_work_bytes),
                        forward_work_bytes=forward_work(rc.forward_work_bytes),
                    )
                    for k, rc in lc.recompute_options.items()
                },
            )
            for lc in self.layers
        ]
        return replace(
            self,
            batch_size=batch_size,
            seq_len=seq_len,
            layers=layers,
            embed_forward_ms=self.embed_forward_ms * scaled["embed_ms"],
            embed_backward_ms=self.embed_backward_ms * scaled["embed_ms"],
            head_ms=self.head_ms * scaled["head_ms"],
            head_work_bytes=max(0, round(self.head_work_bytes
                                         + self.head_token_bytes * (batch_size * seq_len - self.tokens))),
            embed_backward_work_bytes=round(
                self.embed_backward_work_bytes * TOKEN_LINEAR.ratio(batch_size, seq_len, *ref)),
            fits={k: replace(v) for k, v in self.fits.items()},
            notes=dict(self.notes),
            layer_types=list(self.layer_types),
        )

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> CostTable:
        required = {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}
        d = {"version": 1, **d}
        missing = sorted(required - set(d))
        if missing:
            raise CostTableMismatch(
                f"the cost table has no {', '.join(missing)}: it was written by an older LazyTrain; "
                "profile again (`lazytrain profile`), or drop plan.costs"
            )
        return cls(**d)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> CostTable:
        return cls.from_dict(json.loads(Path(path).read_text()))

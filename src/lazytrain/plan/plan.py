"""The `Plan`: what the executor does with every layer in one training step.

Plain data (no torch), round-trips to JSON. Baseline policies are plans too, so every
comparison runs through the same executor.

Per layer, exactly one mode:

- ``keep``: the layer's autograd-saved tensors are kept (on ``tier``) from forward to
  backward; backward needs no recompute.
- ``checkpoint``: only the layer's input is kept (on ``tier``); backward recomputes the layer.
- ``drop``: nothing is kept; backward regenerates the input by re-running the forward from
  the previous checkpoint (segment recompute). A ``drop`` layer must follow a
  ``checkpoint`` or another ``drop`` layer.

A ``keep`` layer may also recompute one block (``LayerPlan.recompute``): ``mlp``, or
``attention`` (the token mixer: self-attention, or Gated-DeltaNet linear attention). That
block's inputs are kept instead of its saved tensors, and the layer's backward re-runs it. Or
``mlp_up``: the MLP's up projection only (its output is not kept; backward recomputes it from
the MLP's input, which is kept anyway).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from lazytrain.errors import LazyTrainError

MODES = ("keep", "checkpoint", "drop")
TIERS = ("gpu", "host", "nvme")
RECOMPUTE = ("none", "mlp", "attention", "mlp_up")
GRAD_PLACES = ("host", "gpu")
"""Where a streamed layer's gradient waits from its backward to its optimizer step
(`LayerPlan.grad`)."""
DEVICE_STEPPED = {
    "device_layers": "steps layers on the GPU beside the embedding and head",
    "device_steps": "steps streamed layers on the GPU beside the embedding and head",
}
"""The plan's counts of decoder layers stepped on the GPU, which need ``const_update="device"``
(`Plan.device_layers`, `Plan.device_steps`), and what each does, for the errors that say so."""

CONST_UPDATES = ("host", "device")
"""Where the embedding and the final norm + head (the groups resident on the GPU) take their
AdamW step: with the decoder layers on the host CPU, or on the executor's device."""


class PlanError(LazyTrainError, ValueError):
    """A plan that cannot run this model."""


@dataclass(kw_only=True, slots=True)
class LayerPlan:
    mode: str = "checkpoint"
    """keep | checkpoint | drop (see the module docstring)."""
    tier: str = "gpu"
    """Where the kept tensors (keep) or the layer input (checkpoint) live: gpu | host | nvme."""
    prefetch: int = 1
    """Backward: how many layers ahead tensors on host/nvme are fetched back to the GPU."""
    recompute: str = "none"
    """keep layers: none | mlp | attention, a block whose saved tensors are not kept but
    recomputed in the layer's backward from its inputs (which are kept, on ``tier``); mlp_up,
    the MLP's up projection recomputed so."""
    grad: str = "host"
    """Where the layer's gradient waits from its backward until the step's clip coefficient is
    known (`GRAD_PLACES`): ``host``, copied out in the backward to its pinned host buffer (as
    until 2026-12-06); ``gpu``, held on the GPU, then stepped there (a ``device_steps`` layer:
    no copy in) or copied home through a small pinned ring and stepped by the CPU worker. A layer
    whose gradient is held on the GPU has no host gradient buffer. Resident ``device_layers``
    hold theirs on the GPU whatever this says. Exact either way: the same gradient bits reach
    the same step."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"layer mode {self.mode!r} is not one of {MODES}")
        if self.tier not in TIERS:
            raise ValueError(f"activation tier {self.tier!r} is not one of {TIERS}")
        if self.prefetch < 1:
            raise ValueError(f"prefetch distance must be >= 1, got {self.prefetch}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"layer recompute {self.recompute!r} is not one of {RECOMPUTE}")
        if self.grad not in GRAD_PLACES:
            raise ValueError(f"layer grad {self.grad!r} is not one of {GRAD_PLACES}")
        if self.recompute != "none" and self.mode != "keep":
            raise ValueError(
                f"recompute={self.recompute!r} is for 'keep' layers; a {self.mode!r} layer "
                "recomputes the whole layer already (set recompute='none')"
            )


def is_offload_window(value: object) -> bool:
    """Whether ``value`` can be a `Plan.offload_window`: an integer >= 1 (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(kw_only=True, slots=True)
class Plan:
    policy: str
    """Name of the policy that made the plan: solved | megatrain | keep_all | ..."""
    batch_size: int
    seq_len: int
    layers: list[LayerPlan]
    head_chunk_tokens: int = 4096
    """Tokens per chunk of the LM head + cross-entropy (the full logits never exist)."""
    weight_prefetch: int = 1
    """How many layers ahead weights are copied to the GPU (1 = double buffering)."""
    const_update: str = "host"
    """Where the resident groups (embedding, final norm + head) take their optimizer step
    (`CONST_UPDATES`): ``host``, the CPU optimizer with the layers (their gradients copied out,
    their new weights copied back); ``device``, the GPU, where their master remainder and
    optimizer state then live (`CostTable.const_update_bytes`): no copies, and no CPU time
    before the first layer's and after the last layer's update (`runtime.update`)."""
    device_layers: int = 0
    """With ``const_update="device"``: the first ``device_layers`` decoder layers are resident on
    the GPU too (weights not streamed) and stepped there with the embedding and head, so the
    CPU optimizer starts on the layers after them as the forward starts on layer 0."""
    device_steps: int = 0
    """With ``const_update="device"``: the ``device_steps`` decoder layers after the device layers
    (``device_layers .. device_layers + device_steps - 1``) are streamed like the rest but stepped
    on the GPU: at the update their weights, gradients (on the host since the backward), master
    remainders and optimizer states are copied in from pinned host memory, stepped, and copied
    back, the gradients excepted (`runtime.update`). That takes them off the CPU, as resident
    layers do, without holding anything of theirs on the GPU through the step."""
    offload_window: int = 1
    """The forward stages a host-tier layer's offload (its saved tensors' copy out, issued in
    the stage after its forward) may take before the model waits for it, its GPU memory counted
    through them: 1, each copy within one stage (the planner's model until 2026-12-05); more,
    copies that outlast a layer's forward run on beside the next ones (the executor waits for
    no offload: it runs every plan alike; the field is how the plan was solved and is
    predicted, `simulate`)."""
    predicted_step_time_s: float | None = None
    notes: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.layers = [lp if isinstance(lp, LayerPlan) else LayerPlan(**lp) for lp in self.layers]
        if self.const_update not in CONST_UPDATES:
            raise ValueError(f"plan const_update {self.const_update!r} is not one of {CONST_UPDATES}")
        for name, what in DEVICE_STEPPED.items():
            value = getattr(self, name)
            if value < 0:
                raise ValueError(f"plan {name} must be >= 0, got {value}")
            if value and self.const_update != "device":
                raise ValueError(f"plan {name}={value} {what}: it needs const_update='device', got "
                                 f"{self.const_update!r}")
        if self.batch_size < 1 or self.seq_len < 1:
            raise ValueError(
                f"plan batch_size and seq_len must be >= 1, got {self.batch_size}, {self.seq_len}"
            )
        if self.head_chunk_tokens < 1:
            raise ValueError(f"head_chunk_tokens must be >= 1, got {self.head_chunk_tokens}")
        if self.weight_prefetch < 1:
            raise ValueError(f"weight_prefetch must be >= 1, got {self.weight_prefetch}")
        if not is_offload_window(self.offload_window):
            raise ValueError(f"plan offload_window must be an integer >= 1, got {self.offload_window!r}")
        if self.layers and self.layers[0].mode == "drop":
            raise ValueError("layer 0 cannot be 'drop': a recompute segment starts at a checkpoint")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def segments(self) -> list[tuple[int, int]]:
        """Recompute segments as [start, end) ranges: a checkpoint followed by its drop layers."""
        out: list[tuple[int, int]] = []
        for i, lp in enumerate(self.layers):
            if lp.mode == "drop":
                start, _ = out[-1]
                out[-1] = (start, i + 1)
            elif lp.mode == "checkpoint":
                out.append((i, i + 1))
            else:
                out.append((i, i + 1))
        return out

    def max_segment(self) -> int:
        return max((end - start for start, end in self.segments()), default=1)

    def check(self, num_layers: int) -> None:
        """Raise if this plan cannot run a model with ``num_layers`` decoder layers."""
        if len(self.layers) != num_layers:
            raise PlanError(
                f"plan has {len(self.layers)} layers, the model has {num_layers}; "
                "re-run `lazytrain plan` for this model"
            )
        if self.device_layers > num_layers:
            raise PlanError(f"plan device_layers={self.device_layers} exceeds the model's {num_layers} layers")
        if self.device_layers + self.device_steps > num_layers:
            raise PlanError(
                f"plan device_layers={self.device_layers} + device_steps={self.device_steps} exceeds the model's "
                f"{num_layers} layers"
            )
        for i, lp in enumerate(self.layers):
            if lp.mode == "drop" and self.layers[i - 1].mode == "keep":
                raise PlanError(
                    f"layer {i} is 'drop' after a 'keep' layer: a drop layer must follow a "
                    "checkpoint or another drop layer"
                )

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Plan:
        return cls(**d)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        return cls.from_dict(json.loads(Path(path).read_text()))


def megatrain_plan(
    num_layers: int, batch_size: int, seq_len: int, every: int = 4, head_chunk_tokens: int = 4096
) -> Plan:
    """MegaTrain-style: every ``every``-th layer input kept on the GPU, the rest recomputed."""
    if every < 1:
        raise ValueError(f"megatrain checkpoint interval must be >= 1, got {every}")
    layers = [
        LayerPlan(mode="checkpoint" if i % every == 0 else "drop", tier="gpu")
        for i in range(num_layers)
    ]
    return Plan(
        policy="megatrain",
        batch_size=batch_size,
        seq_len=seq_len,
        layers=layers,
        head_chunk_tokens=head_chunk_tokens,
        notes={"every": every},
    )


def keep_all_plan(
    num_layers: int, batch_size: int, seq_len: int, head_chunk_tokens: int = 4096
) -> Plan:
    """No recompute: every layer's saved tensors stay on the GPU."""
    return Plan(
        policy="keep_all",
        batch_size=batch_size,
        seq_len=seq_len,
        layers=[LayerPlan(mode="keep", tier="gpu") for _ in range(num_layers)],
        head_chunk_tokens=head_chunk_tokens,
    )


def checkpoint_all_plan(
    num_layers: int, batch_size: int, seq_len: int, tier: str = "gpu", head_chunk_tokens: int = 4096
) -> Plan:
    """Every layer input checkpointed on ``tier``; each layer recomputed once in backward."""
    return Plan(
        policy=f"checkpoint_{tier}",
        batch_size=batch_size,
        seq_len=seq_len,
        layers=[LayerPlan(mode="checkpoint", tier=tier) for _ in range(num_layers)],
        head_chunk_tokens=head_chunk_tokens,
    )


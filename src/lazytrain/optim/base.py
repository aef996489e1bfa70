"""The interface between the executor and a CPU optimizer.

The host store keeps, per parameter group (the embedding, each decoder layer, the final norm
and head), one flat fp32 master tensor, a ``SplitMaster`` (the streamed bf16 weight plus a
16-bit remainder, ``split.py``) that the optimizer reconstructs exactly, steps and writes back,
or a ``Bf16Master`` (the streamed bf16 weight alone, written with stochastic rounding; not
exact: ``master.py``). A group's parameters are laid out so that the ones
that take weight decay come first: ``decay_numel[g]`` elements with decay, then the rest
(norms, biases) without.

The executor calls ``step_group`` once per group and step, in the order the next forward
needs the groups, possibly from a worker thread. The optimizer reads the flat gradient (bf16
or fp32, on the CPU), multiplies it by ``clip_coef``, updates the master and its own state,
and writes the new weights, cast to ``weight_out.dtype``, into ``weight_out`` (the group's
pinned streaming buffer). A split master's weight half, or a bf16 master, is that buffer: it
is written with the master, and ``weight_out`` must then be None or that same tensor.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from lazytrain.config import AdamWConfig
from lazytrain.optim.master import Bf16Master, Master
from lazytrain.optim.split import SplitMaster


class HostOptimizer(ABC):
    """AdamW over flat fp32 master groups on the CPU."""

    def __init__(
        self, masters: list[Master], decay_numel: list[int], config: AdamWConfig
    ):
        if len(masters) != len(decay_numel):
            raise ValueError("one decay_numel per master group is needed")
        for g, (m, d) in enumerate(zip(masters, decay_numel)):
            if isinstance(m, SplitMaster):
                if m.weight.device.type != "cpu" or m.remainder.device.type != "cpu":
                    raise ValueError(f"split master group {g} must be on the CPU")
            elif isinstance(m, Bf16Master):
                if m.weight.device.type != "cpu":
                    raise ValueError(f"bf16 master group {g} must be on the CPU")
            elif m.dtype != torch.float32 or m.dim() != 1 or m.device.type != "cpu":
                raise ValueError(f"master group {g} must be a flat fp32 CPU tensor, a SplitMaster or a Bf16Master")
            if not 0 <= d <= m.numel():
                raise ValueError(f"decay_numel[{g}]={d} outside [0, {m.numel()}]")
        self.masters = list(masters)
        """Each group's master: the host store's, or while the group is on a device
        (`to_device`) its copy there."""
        self.decay_numel = decay_numel
        self.config = config
        self.steps = [0] * len(masters)

    def _check_weight_out(self, group: int, weight_out: torch.Tensor | None) -> None:
        master = self.masters[group]
        if isinstance(master, (SplitMaster, Bf16Master)) and weight_out is not None and not (
            weight_out.data_ptr() == master.weight.data_ptr() and weight_out.numel() == master.numel()
        ):
            what = "split, so its weight half" if isinstance(master, SplitMaster) else "bf16, so it"
            raise ValueError(
                f"group {group}: the master is {what} is the streamed weight; pass weight_out=None or that "
                "weight tensor"
            )

    @abstractmethod
    def step_group(
        self,
        group: int,
        grad: torch.Tensor,
        clip_coef: float,
        lr: float,
        weight_out: torch.Tensor | None,
    ) -> None:
        """One AdamW step of ``group`` with gradient ``grad * clip_coef`` at learning rate ``lr``."""

    device_step = False
    """Whether `to_device` can move a group to a GPU and step it there."""

    @property
    def device_step_chunk(self) -> int | None:
        """Elements per piece of a step on a GPU (its temporaries are one piece's), None without
        a device step."""
        return None

    @property
    def device_groups(self) -> frozenset[int]:
        """Groups stepped on a device (`to_device`) until `to_host`."""
        return frozenset()

    def to_device(self, group: int, weight: torch.Tensor) -> None:
        """Step ``group`` on ``weight``'s device until `to_host` (an optimizer that can: see
        `Hybrid8bitAdamW.to_device`)."""
        raise ValueError(
            f"the {type(self).__name__} optimizer steps on the CPU only; the groups resident on the GPU "
            "can be stepped there with optimizer.kind=hybrid8bit (or set plan.const_update=host)"
        )

    def to_host(self) -> None:
        """Bring every group stepped on a device back to its host tensors (none here)."""

    def streamed_bytes(self, group: int) -> int:
        """Device bytes `stream_in` needs for ``group`` (an optimizer with a device step: see
        `Hybrid8bitAdamW.streamed_bytes`)."""
        raise ValueError(f"the {type(self).__name__} optimizer steps on the CPU only: it streams nothing to a GPU")

    def stream_in(self, group: int, weight: torch.Tensor, scratch: torch.Tensor) -> None:
        """`to_device` for one step, into ``scratch`` (see `Hybrid8bitAdamW.stream_in`)."""
        self.to_device(group, weight)  # raises: CPU only

    def stream_out(self, group: int) -> None:
        """Bring ``group`` back from `stream_in` without waiting (see `Hybrid8bitAdamW.stream_out`)."""

    def discard_device(self, group: int) -> None:
        """Forget ``group``'s device copy without bringing it back (see
        `Hybrid8bitAdamW.discard_device`); none here."""
        raise ValueError(f"group {group} is not on a device: the {type(self).__name__} optimizer steps on the CPU only")

    @abstractmethod
    def state_dict(self) -> dict:
        """Everything needed to resume (not the masters, which the host store saves)."""

    @abstractmethod
    def load_state_dict(self, state: dict) -> None: ...

    def state_bytes(self) -> int:
        """Bytes of optimizer state held (not counting the masters)."""
        return 0

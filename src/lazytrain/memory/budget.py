"""Host memory, component by component, against the budget and the machine.

Everything LazyTrain holds in host memory for a run: streamed weights, masters (fp32, the
remainders of a split master, or nothing for a bf16 master), gradients, optimizer states, host-tier activations and the
pinned staging buffers of the NVMe tier. The model state is known before anything is
allocated, so a model that cannot fit fails there, naming the smallest change that makes it
fit; the activations are the plan's (the solved plan keeps them within what the state leaves
of ``memory.host_limit_gb``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace

import torch

from lazytrain.memory.host_store import (
    HostBytes,
    HostMemoryError,
    default_host_limit,
    host_memory_total,
)

GIB = 2**30


def optimizer_bytes_per_param(kind: str, numels: Sequence[int], fp32_groups: Collection[int] = ()) -> float:
    """State bytes per parameter of optimizer ``kind`` (fp32, hybrid8bit or hybrid4bit) over these groups."""
    if kind == "hybrid4bit":
        from lazytrain.optim.hybrid4bit import state_bytes_per_param as four_bit

        return four_bit(numels, fp32_groups)
    if kind != "hybrid8bit":
        return 8.0
    from lazytrain.optim.hybrid8bit import state_bytes_per_param

    return state_bytes_per_param(numels, fp32_groups)


@dataclass(frozen=True, slots=True)
class HostSettings:
    """The choices that set the model state's host bytes."""

    dtype: torch.dtype
    master: str
    """fp32, split or bf16 (memory.master resolved: `train.session.resolve_master`)."""
    optimizer_kind: str
    fp32_groups: tuple[int, ...] = ()
    held_grads: tuple[int, ...] = ()
    """Groups whose gradients wait on the GPU (`LayerPlan.grad`): no host buffer, and the
    pinned ring that brings them home (`host_store.grad_ring_bytes`) instead."""
    baseline_policy: str | None = None
    """The baseline ``plan.policy`` the run starts with, if any: it holds a gradient on the GPU
    only with ``memory.gradients=gpu`` (auto leaves each in a host buffer)."""

    def holding_layer_grads(self, num_groups: int) -> HostSettings:
        """These settings with every decoder layer's gradient held on the GPU (groups 1 ..
        num_groups - 2: ``memory.gradients=gpu``, or the least a plan of ``auto`` can need)."""
        return replace(self, held_grads=tuple(range(1, num_groups - 1)))


@dataclass(slots=True)
class HostBudget:
    state: HostBytes
    activations: int
    """Host-tier activations at the plan's peak (pinned, whole 4 KiB pages)."""
    staging: int
    """Pinned staging buffers beyond the activations (the NVMe tier's write-behind and
    read-ahead buffers)."""
    limit: int
    """Bytes LazyTrain may use (``memory.host_limit_gb``, or the machine less a reserve)."""
    machine: int

    def components(self) -> dict[str, int]:
        s = self.state
        return {"weights": s.weights, "masters": s.masters, "gradients": s.grads, "optimizer": s.optimizer,
                "activations": self.activations, "staging": self.staging}

    @property
    def total(self) -> int:
        return sum(self.components().values())

    @property
    def fits(self) -> bool:
        return self.total <= self.limit

    def table(self) -> str:
        """One line per component, then the total against the budget and the machine."""
        n = max(self.state.num_params, 1)
        lines = [f"  {name:12s} {nbytes / GIB:9.2f} GiB  {nbytes / n:6.3f} B/param"
                 for name, nbytes in self.components().items()]
        verdict = "fits" if self.fits else f"does NOT fit ({(self.total - self.limit) / GIB:.2f} GiB over)"
        lines.append(f"  {'total':12s} {self.total / GIB:9.2f} GiB  {self.total / n:6.3f} B/param: {verdict} "
                     f"in the budget of {self.limit / GIB:.2f} GiB (machine {self.machine / GIB:.2f} GiB)")
        return "\n".join(lines)


def host_budget(
    numels: Sequence[int],
    settings: HostSettings,
    *,
    activations: int = 0,
    staging: int = 0,
    limit: int | None = None,
) -> HostBudget:
    held = set(settings.held_grads)
    state = HostBytes.predict(
        sum(numels), settings.dtype, settings.master,
        optimizer_bytes_per_param(settings.optimizer_kind, numels, settings.fp32_groups),
        host_grad_numel=sum(n for g, n in enumerate(numels) if g not in held),
        ring_numel=max((numels[g] for g in held), default=0),
    )
    return HostBudget(state=state, activations=activations, staging=staging,
                      limit=limit or default_host_limit(), machine=host_memory_total())


@dataclass(frozen=True, slots=True)
class _Change:
    setting: str
    """The config key it sets (one value per key in a combination)."""
    value: str
    exact: bool
    """Whether every number of the run stays what it was (a split master, held gradients)."""
    apply: Callable[[HostSettings], HostSettings]
    note: str = ""


def _changes(numels: Sequence[int], settings: HostSettings) -> list[_Change]:
    """Every single change of settings that lowers the model state's host bytes, exact ones
    first, then by how far they move the run from ordinary training."""
    out: list[_Change] = []
    bf16 = settings.dtype == torch.bfloat16
    n = len(numels)
    if bf16 and settings.master == "fp32":
        out.append(_Change("memory.master", "split", True, lambda s: replace(s, master="split")))
    if len(settings.held_grads) < max(n - 2, 0):
        if settings.baseline_policy:  # auto would leave every gradient on the host
            out.append(_Change("memory.gradients", "gpu", True, lambda s: s.holding_layer_grads(n),
                               f"plan.policy={settings.baseline_policy} holds each layer's gradient on the GPU "
                               "until its update only with gpu; or set plan.policy=auto, whose solved plan places "
                               "each one against the GPU and host budgets"))
        else:
            # auto, not gpu: the same least host memory here, and the plan then holds on the GPU
            # only what the host has no room for (gpu holds all: 61 GB of Qwen3-30B-A3B's
            # gradients, more than an H100 has beside the rest)
            out.append(_Change("memory.gradients", "auto", True, lambda s: s.holding_layer_grads(n),
                               "the plan then holds each layer's gradient on the GPU until its update, or puts "
                               "it in a host buffer where the host has room"))
    if settings.fp32_groups:
        out.append(_Change("optimizer.fp32_embedding_states", "false", False, lambda s: replace(s, fp32_groups=())))
    if settings.optimizer_kind == "fp32":
        out.append(_Change("optimizer.kind", "hybrid8bit", False, lambda s: replace(s, optimizer_kind="hybrid8bit")))
    if bf16 and settings.master != "bf16":
        out.append(_Change("memory.master", "bf16", False, lambda s: replace(s, master="bf16")))
    if settings.optimizer_kind != "hybrid4bit":
        out.append(_Change("optimizer.kind", "hybrid4bit", False, lambda s: replace(s, optimizer_kind="hybrid4bit")))
    return out


def smallest_fix(numels: Sequence[int], settings: HostSettings, budget: HostBudget) -> str | None:
    """The least intrusive change of settings after which ``budget`` fits, as config overrides:
    exact changes first (the split master and gradients placed by the plan change no number), then
    fewer host-tier activations, then combinations with the fewest inexact changes (8-bit
    states, a bf16 master, 4-bit states); None when
    none does. An inexact change is named so."""
    changes = _changes(numels, settings)
    combos = [c for k in range(1, len(changes) + 1) for c in itertools.combinations(changes, k)
              if len({ch.setting for ch in c}) == k]
    combos.sort(key=lambda c: (sum(not ch.exact for ch in c), len(c)))  # stable: the listed order on a tie
    fewer = "no host-tier activations (lower training.batch_size, or set memory.nvme_dir for the NVMe tier)"
    exact = [c for c in combos if all(ch.exact for ch in c)]
    inexact = [c for c in combos if not all(ch.exact for ch in c)]
    for combo in [*exact, None, *inexact]:
        if combo is None:  # exact too, and each step's numbers stay: after the exact setting changes
            if budget.activations and host_budget(numels, settings, staging=budget.staging, limit=budget.limit).fits:
                return fewer
            continue
        candidate = settings
        for change in combo:
            candidate = change.apply(candidate)
        trial = host_budget(numels, candidate, activations=budget.activations, staging=budget.staging,
                            limit=budget.limit)
        if trial.fits:
            text = " ".join(f"{ch.setting}={ch.value}" for ch in combo)
            names = [f"{ch.setting}={ch.value}" for ch in combo if not ch.exact]
            notes = [ch.note for ch in combo if ch.note]
            if names:
                notes.append(f"not exact: {', '.join(names)}, see docs/memory.md and docs/optimizer.md")
            return text + (f" ({'; '.join(notes)})" if notes else "")
    return None


def check_host_fit(numels: Sequence[int], settings: HostSettings, budget: HostBudget) -> None:
    """Raise `HostMemoryError` with the per-component table and the smallest fix unless it fits."""
    if budget.fits:
        return
    fix = smallest_fix(numels, settings, budget)
    advice = (f"set {fix}" if fix else "no setting makes it fit: use a smaller model, a machine with "
              "more memory, or raise memory.host_limit_gb if the budget is too cautious")
    raise HostMemoryError(
        f"host memory: {budget.total / GIB:.1f} GiB needed, {budget.limit / GIB:.1f} GiB usable "
        f"(memory.host_limit_gb; the machine has {budget.machine / GIB:.1f} GiB):\n{budget.table()}\n"
        f"smallest change that fits: {advice}"
    )

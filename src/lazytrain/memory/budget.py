"""Host memory, component by component, against the budget and the machine.

Everything LazyTrain holds in host memory for a run: streamed weights, masters (fp32, the
remainders of a split master, or nothing for a bf16 master), gradients, optimizer states, host-tier activations and the
pinned staging buffers of the NVMe tier. The model state is known before anything is
allocated, so a model that cannot fit fails there, naming the smallest change that makes it
fit; the activations are the plan's (the solved plan keeps them within what the state leaves
of ``memory.host_limit_gb``).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
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
    state = HostBytes.predict(
        sum(numels), settings.dtype, settings.master,
        optimizer_bytes_per_param(settings.optimizer_kind, numels, settings.fp32_groups),
    )
    return HostBudget(state=state, activations=activations, staging=staging,
                      limit=limit or default_host_limit(), machine=host_memory_total())


def smallest_fix(numels: Sequence[int], settings: HostSettings, budget: HostBudget) -> str | None:
    """The least intrusive change of settings after which ``budget`` fits, as config overrides
    (exact changes first: the split master changes no number; then 8-bit states; then fewer
    host activations), or None when none does."""
    options: list[tuple[str, HostSettings, bool]] = []
    bf16 = settings.dtype == torch.bfloat16
    if bf16 and settings.master == "fp32":
        options.append(("memory.master=split", replace(settings, master="split"), False))
    if settings.fp32_groups:
        options.append(("optimizer.fp32_embedding_states=false", replace(settings, fp32_groups=()), False))
    if settings.optimizer_kind != "hybrid8bit":
        options.append(("optimizer.kind=hybrid8bit", replace(settings, optimizer_kind="hybrid8bit"), False))
        if bf16 and settings.master == "fp32":
            options.append(("memory.master=split optimizer.kind=hybrid8bit",
                            replace(settings, master="split", optimizer_kind="hybrid8bit"), False))
    if budget.activations:
        fewer = ("no host-tier activations (lower training.batch_size, or set memory.nvme_dir for the "
                 "NVMe tier)")
        options.append((fewer, settings, True))
    for text, candidate, drop_activations in options:
        trial = host_budget(numels, candidate, activations=0 if drop_activations else budget.activations,
                            staging=budget.staging, limit=budget.limit)
        if trial.fits:
            return text
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

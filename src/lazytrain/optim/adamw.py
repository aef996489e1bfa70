"""fp32 AdamW on the CPU: torch's fused kernel over the flat master groups.

torch's fused CPU AdamW needs parameter, gradient and states of one dtype, so a bf16
gradient is cast into a reused fp32 buffer per worker, ``CHUNK`` elements at a time: no
full-model (or full-group) fp32 gradient ever exists. A split master (``split.py``) is joined
into a second such buffer, stepped by the same fused kernel and split back, chunk by chunk, so
its masters stay bit-for-bit those of an unsplit run (the update is elementwise). A bf16 master
(``master.py``) is widened into that buffer, stepped, and rounded back stochastically under
``seed`` (not exact).
"""

from __future__ import annotations

import itertools
import threading

import torch
from torch.optim.adam import adam

from lazytrain.optim.base import AdamWConfig, HostOptimizer
from lazytrain.optim.master import Bf16Master, Master, store_master_chunk
from lazytrain.optim.quant import weight_rounding_key
from lazytrain.optim.split import SplitMaster

CHUNK = 1 << 20
"""Elements per call of torch's fused step: its fp32 scratch buffers stay at 4 MiB each."""


class FusedAdamW(HostOptimizer):
    """fp32 states (8 bytes per parameter); the comparison path for the 8-bit optimizer."""

    def __init__(
        self, masters: list[Master], decay_numel: list[int], config: AdamWConfig, seed: int = 0
    ):
        super().__init__(masters, decay_numel, config)
        self.seed = int(seed)
        """Keys a bf16 master's stochastic rounding (``quant.weight_rounding_key``)."""
        self.exp_avg = [torch.zeros(m.numel()) for m in masters]
        self.exp_avg_sq = [torch.zeros(m.numel()) for m in masters]
        self._step_tensors = [torch.zeros((), dtype=torch.float32) for _ in masters]
        self._scratch = threading.local()

    def _buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This thread's fp32 (gradient, master) scratch of CHUNK elements each."""
        bufs = getattr(self._scratch, "bufs", None)
        if bufs is None:
            bufs = self._scratch.bufs = (torch.empty(CHUNK), torch.empty(CHUNK))
        return bufs

    def step_group(
        self,
        group: int,
        grad: torch.Tensor,
        clip_coef: float,
        lr: float,
        weight_out: torch.Tensor | None,
    ) -> None:
        master = self.masters[group]
        n = master.numel()
        if grad.numel() != n:
            raise ValueError(f"group {group}: gradient has {grad.numel()} elements, master {n}")
        self._check_weight_out(group, weight_out)
        grad = grad.reshape(-1)
        grad_buf, master_buf = self._buffers()
        # the clip coefficient rides in the fused kernel (it divides the gradient by
        # grad_scale), in fp32: multiplying the bf16 gradient first would round in bf16
        grad_scale = None if clip_coef == 1.0 else torch.tensor(1.0 / clip_coef, dtype=torch.float32)
        decay_end = self.decay_numel[group]
        m, v, step = self.exp_avg[group], self.exp_avg_sq[group], self._step_tensors[group]
        cfg = self.config
        bounds = sorted({*range(0, n, CHUNK), decay_end, n})
        for lo, hi in itertools.pairwise(bounds):
            if isinstance(master, SplitMaster):
                half = SplitMaster(master.weight[lo:hi], master.remainder[lo:hi])
                chunk = half.fp32(master_buf[: hi - lo])
            elif isinstance(master, Bf16Master):
                chunk = master_buf[: hi - lo].copy_(master.weight[lo:hi])
            else:
                chunk = master[lo:hi]
            g32 = grad_buf[: hi - lo]
            g32.copy_(grad[lo:hi])
            # fused Adam increments the step tensor it is given; all chunks share one count
            step_view = step.clone()
            adam(
                [chunk],
                [g32],
                [m[lo:hi]],
                [v[lo:hi]],
                [],
                [step_view],
                fused=True,
                grad_scale=grad_scale,
                decoupled_weight_decay=True,
                amsgrad=False,
                beta1=cfg.betas[0],
                beta2=cfg.betas[1],
                lr=lr,
                weight_decay=cfg.weight_decay if lo < decay_end else 0.0,
                eps=cfg.eps,
                maximize=False,
            )
            if isinstance(master, SplitMaster):
                half.assign(chunk)
            elif isinstance(master, Bf16Master):
                store_master_chunk(master, chunk, None, lo, hi,
                                   (weight_rounding_key(self.seed, group, self.steps[group] + 1), 0))
            elif weight_out is not None:
                weight_out[lo:hi].copy_(chunk)
        step.add_(1)
        self.steps[group] = int(step.item())

    def state_dict(self) -> dict:
        return {
            "kind": "fp32",
            "steps": list(self.steps),
            "exp_avg": self.exp_avg,
            "exp_avg_sq": self.exp_avg_sq,
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != "fp32":
            raise ValueError(
                f"optimizer state is of kind {state.get('kind')!r}, this optimizer is 'fp32'; "
                "resume with the optimizer the checkpoint was made with"
            )
        for dst, src in zip(self.exp_avg + self.exp_avg_sq, state["exp_avg"] + state["exp_avg_sq"]):
            dst.copy_(src)
        self.steps = list(state["steps"])
        for t, s in zip(self._step_tensors, self.steps):
            t.fill_(s)

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.exp_avg + self.exp_avg_sq)

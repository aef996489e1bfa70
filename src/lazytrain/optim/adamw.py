"""fp32 AdamW on the CPU: torch's fused kernel over the flat master groups.

torch's fused CPU AdamW needs parameter, gradient and states of one dtype, so a bf16
gradient is cast (and multiplied by the clip coefficient) into one reused fp32 buffer per
worker, one group at a time: no full-model fp32 gradient ever exists.
"""

from __future__ import annotations

import threading

import torch
from torch.optim.adam import adam

from lazytrain.optim.base import AdamWConfig, HostOptimizer


class FusedAdamW(HostOptimizer):
    """fp32 states (8 bytes per parameter); the comparison path for the 8-bit optimizer."""

    def __init__(self, masters: list[torch.Tensor], decay_numel: list[int], config: AdamWConfig):
        super().__init__(masters, decay_numel, config)
        self.exp_avg = [torch.zeros_like(m) for m in masters]
        self.exp_avg_sq = [torch.zeros_like(m) for m in masters]
        self._step_tensors = [torch.zeros((), dtype=torch.float32) for _ in masters]
        self._scratch = threading.local()

    def _fp32_grad(self, grad: torch.Tensor) -> torch.Tensor:
        buf = getattr(self._scratch, "buf", None)
        if buf is None or buf.numel() < grad.numel():
            buf = torch.empty(grad.numel(), dtype=torch.float32)
            self._scratch.buf = buf
        out = buf[: grad.numel()]
        out.copy_(grad.reshape(-1))
        return out

    def step_group(
        self,
        group: int,
        grad: torch.Tensor,
        clip_coef: float,
        lr: float,
        weight_out: torch.Tensor | None,
    ) -> None:
        master = self.masters[group]
        if grad.numel() != master.numel():
            raise ValueError(
                f"group {group}: gradient has {grad.numel()} elements, master {master.numel()}"
            )
        g32 = self._fp32_grad(grad)
        # the clip coefficient rides in the fused kernel (it divides the gradient by
        # grad_scale), in fp32: multiplying the bf16 gradient first would round in bf16
        grad_scale = None if clip_coef == 1.0 else torch.tensor(1.0 / clip_coef, dtype=torch.float32)
        split = self.decay_numel[group]
        m, v, step = self.exp_avg[group], self.exp_avg_sq[group], self._step_tensors[group]
        cfg = self.config
        for lo, hi, wd in ((0, split, cfg.weight_decay), (split, master.numel(), 0.0)):
            if hi <= lo:
                continue
            # fused Adam increments the step tensor it is given; both halves share one count
            step_view = step.clone()
            adam(
                [master[lo:hi]],
                [g32[lo:hi]],
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
                weight_decay=wd,
                eps=cfg.eps,
                maximize=False,
            )
        step.add_(1)
        self.steps[group] = int(step.item())
        if weight_out is not None:
            weight_out.copy_(master)

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

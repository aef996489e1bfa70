"""The fp32 CPU AdamW (torch fused) against float64 math, with a bf16 gradient and clipping."""

import torch

from lazytrain.optim.adamw import FusedAdamW
from lazytrain.optim.base import AdamWConfig


def test_fused_adamw_matches_float64_with_bf16_grad_and_clip():
    torch.manual_seed(0)
    n, decay_n, lr, clip = 1000, 600, 1e-2, 0.37
    master = torch.randn(n)
    ref = master.double().clone()
    opt = FusedAdamW([master], [decay_n], AdamWConfig(lr=lr, betas=(0.9, 0.95), weight_decay=0.1))
    weights = torch.empty(n, dtype=torch.bfloat16)
    m = torch.zeros(n, dtype=torch.float64)
    v = torch.zeros(n, dtype=torch.float64)
    wd = torch.cat([torch.full((decay_n,), 0.1), torch.zeros(n - decay_n)]).double()
    for t in range(1, 6):
        g = torch.randn(n).bfloat16()
        opt.step_group(0, g, clip, lr, weights)
        gd = g.double() * clip
        m = 0.9 * m + 0.1 * gd
        v = 0.95 * v + 0.05 * gd * gd
        ref = ref * (1 - lr * wd) - lr * (m / (1 - 0.9**t)) / ((v / (1 - 0.95**t)).sqrt() + 1e-8)
    torch.testing.assert_close(master.double(), ref, rtol=0, atol=2e-6)
    assert torch.equal(weights, master.bfloat16())
    assert opt.steps == [5]


def test_state_round_trip():
    masters = [torch.randn(50), torch.randn(7)]
    opt = FusedAdamW(masters, [50, 0], AdamWConfig(lr=1e-3))
    for g in range(2):
        opt.step_group(g, torch.randn(masters[g].numel()), 1.0, 1e-3, None)
    clone = FusedAdamW([m.clone() for m in masters], [50, 0], AdamWConfig(lr=1e-3))
    clone.load_state_dict(opt.state_dict())
    grad = torch.randn(50)
    opt.step_group(0, grad, 1.0, 1e-3, None)
    clone.step_group(0, grad, 1.0, 1e-3, None)
    assert torch.equal(opt.masters[0], clone.masters[0])

"""The mixture-of-experts compute: how the experts run (grouped GEMMs or a loop) is chosen once
per device, and both give the same values and gradients (an expert without tokens: zero)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import make_hf_model, random_batch
from test_executor_parity import assert_grads_equal, reference_grads, streamed

from lazytrain.model.moe import experts_forward, select_experts_kernel
from lazytrain.plan.plan import megatrain_plan
from lazytrain.runtime.executor import Executor

CPU = torch.device("cpu")


def _grouped_mm_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """torch._grouped_mm computes forward and backward on ``device`` in ``dtype`` (the CPU has
    kernels from torch 2.9 or so; on the GPU the selection decides)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        x = torch.randn(4, 16, device=device, dtype=dtype, requires_grad=True)
        w = torch.randn(2, 16, 8, device=device, dtype=dtype, requires_grad=True)
        out = torch._grouped_mm(x, w, offs=torch.tensor([1, 4], device=device, dtype=torch.int32))
        torch.autograd.grad(out, [x, w], torch.randn_like(out))
    except (RuntimeError, NotImplementedError):
        return False
    return True


def test_the_loop_runs_off_hopper_and_unaligned_experts():
    assert select_experts_kernel(CPU, torch.bfloat16, [0]) == "loop"
    if torch.cuda.is_available():
        cuda = torch.device("cuda")
        hopper = torch.cuda.get_device_capability(cuda) >= (9, 0) and hasattr(torch, "_grouped_mm")
        assert select_experts_kernel(cuda, torch.bfloat16, [0, 4096]) == (
            "grouped_mm" if hopper else "loop"
        )
        assert (
            select_experts_kernel(cuda, torch.bfloat16, [0, 4098]) == "loop"
        )  # not 16-byte aligned
        assert select_experts_kernel(cuda, torch.float32, [0]) == "loop"


def _experts_case(device: torch.device, dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    tokens, hidden, inter, experts, top_k = 37, 32, 16, 6, 2
    x = torch.randn(tokens, hidden, generator=g)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5
    down = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    # every token: one of experts 0-3 at random, then expert 5; expert 4 is routed no token
    indices = torch.stack(
        [torch.randint(0, 4, (tokens,), generator=g), torch.full((tokens,), 5)], dim=1
    )
    weights = torch.rand(tokens, top_k, generator=g)
    return [
        t.to(device, dtype).requires_grad_(t.is_floating_point())
        if t.is_floating_point()
        else t.to(device)
        for t in (x, gate_up, down, indices, weights)
    ]


@pytest.mark.parametrize(
    "device",
    [
        pytest.param(
            "cpu",
            marks=pytest.mark.skipif(
                not _grouped_mm_runs(CPU, torch.float32),
                reason="torch._grouped_mm has no CPU kernel in this torch",
            ),
        ),
        pytest.param(
            "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
        ),
    ],
)
def test_grouped_gemms_equal_the_loop_over_experts(device):
    """Values and every gradient (tokens, stacked weights, routing weights) of the grouped path
    equal the loop's: fp32 on the CPU, bf16 on a GPU (to its rounding). An expert no token
    reached gets an exactly zero gradient either way."""
    device = torch.device(device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    if device.type == "cuda" and not _grouped_mm_runs(device, dtype):
        pytest.skip("torch._grouped_mm does not run on this GPU")
    results = []
    for kernel in ("loop", "grouped_mm"):
        x, gate_up, down, indices, weights = _experts_case(device, dtype)
        out = experts_forward(x, gate_up, down, indices, weights, F.silu, kernel)
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(device, dtype)
        results.append([out, *torch.autograd.grad(out, [x, gate_up, down, weights], grad)])
        assert not results[-1][2][4].any() and not results[-1][3][4].any()  # expert 4: no tokens
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    for loop, grouped in zip(*results):
        torch.testing.assert_close(grouped.float(), loop.float(), **tol)


@pytest.mark.skipif(
    not _grouped_mm_runs(CPU, torch.float32), reason="torch._grouped_mm has no CPU kernel here"
)
def test_the_executor_with_grouped_gemms_matches_hf_autograd(tmp_path):
    """The grouped path through the executor (run on the CPU where torch has the kernel):
    Qwen3.5-MoE with its shared expert, padded, kept and recomputed layers."""
    model = make_hf_model(
        "qwen3_5_moe", layers=3, output_router_logits=True, router_aux_loss_coef=0.1
    )
    model.save_pretrained(tmp_path)
    adapter, store = streamed(tmp_path)
    adapter.routing.kernel = "grouped_mm"
    ids, labels, mask = random_batch(3, 13, adapter.vocab_size, padded=True)
    ref_loss, ref = reference_grads(model, ids, labels, mask)
    stats = Executor(adapter, store, megatrain_plan(3, 3, 13, every=2), CPU).forward_backward(
        ids, labels, mask
    )
    assert stats.loss == pytest.approx(ref_loss, rel=1e-5)
    assert_grads_equal(adapter, store, ref)

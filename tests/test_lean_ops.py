"""model/lean.py: the lean SwiGLU and RMSNorm give HF's outputs and gradients and save less."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from torch.autograd.graph import saved_tensors_hooks

from lazytrain.model import lean
from lazytrain.model.adapter import ModelAdapter
from lazytrain.model.build import model_config
from lazytrain.model.lean import (
    LeanRMSNorm,
    LeanRotary,
    LeanSwiGLU,
    apply_lean_ops,
    recomputable_outputs,
    recomputing_mlp,
)
from lazytrain.model.pointwise import EAGER

torch.manual_seed(0)


SMALL = {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
             "num_hidden_layers": 1, "vocab_size": 50}


def _layer(shape: str, dtype=torch.float32) -> torch.nn.Module:
    """The first decoder layer of a small model of ``shape``'s family, with non-trivial weights."""
    if shape == "qwen3":
        config = transformers.Qwen3Config(**SMALL)
    elif shape == "llama":
        config = transformers.LlamaConfig(**SMALL)
    else:  # built-in tiny shapes
        config = model_config(f"builtin:{shape}", vocab_size=300).get_text_config()
    layer = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).model.layers[0]
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.2)  # zero-initialised norms (Qwen3.5) would hide the weight's gradient
    return layer


def _grads(module: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor):
    x = x.detach().clone().requires_grad_()
    out = module(x)
    out.backward(grad)
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in module.named_parameters()}


def _saved_bytes(module: torch.nn.Module, x: torch.Tensor) -> int:
    weights = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in weights:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        module(x.detach().clone().requires_grad_())
    return sum(seen.values())


@pytest.mark.parametrize("shape, part", [("tiny", "mlp"), ("tiny", "input_layernorm"), ("qwen3", "self_attn.q_norm"),
                                         ("llama", "post_attention_layernorm"), ("llama", "mlp"), ("tiny-hybrid", "mlp"),
                                         ("tiny-hybrid", "input_layernorm")])
def test_lean_module_equals_hf_in_fp32(shape, part):
    layer = _layer(shape)
    hf = layer.get_submodule(part)
    lean = copy.deepcopy(hf)
    assert apply_lean_ops(lean) == [""]  # the module itself was swapped
    width = hf.weight.shape[-1] if "norm" in part else hf.gate_proj.in_features
    x, grad = torch.randn(3, 7, width), torch.randn(3, 7, width if "norm" in part else hf.down_proj.out_features)
    ref, got = _grads(hf, x, grad), _grads(lean, x, grad)
    assert torch.equal(ref[0], got[0])  # the same forward, bit for bit
    torch.testing.assert_close(got[1], ref[1], rtol=1e-5, atol=1e-6)
    for name in ref[2]:
        torch.testing.assert_close(got[2][name], ref[2][name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", ["qwen2", "qwen3_5"])
def test_lean_attention_equals_hf_and_leaves_other_models_alone(family, monkeypatch):
    """The attention's rotary embedding through LeanRotary (Qwen3.5: partial): HF's forward bit
    for bit and its gradients in fp32; HF's own modules, called outside a lean attention, keep
    HF's function."""
    from conftest import make_hf_model

    model = make_hf_model(family, layers=4)
    attention = next(layer.self_attn for layer in model.model.layers if hasattr(layer, "self_attn"))
    lean = copy.deepcopy(attention)
    assert apply_lean_ops(lean)[0] == ""  # the attention itself (and Qwen3.5's query/key norms)
    calls = []
    monkeypatch.setattr(LeanRotary, "apply", lambda *a: calls.append(1) or torch.autograd.Function.apply.__func__(
        LeanRotary, *a))
    x = torch.randn(2, 9, model.config.hidden_size)
    position_ids = torch.arange(9).expand(2, -1)
    rope = model.model.rotary_emb(x, position_ids[None].expand(3, -1, -1) if family == "qwen3_5" else position_ids)

    def run(module):
        h = x.detach().clone().requires_grad_()
        out = module(h, position_embeddings=rope, attention_mask=None)[0]
        out.backward(torch.ones_like(out))
        return out.detach(), h.grad, {n: p.grad.clone() for n, p in module.named_parameters()}

    ref = run(attention)
    assert not calls  # HF's module: HF's rotary function
    got = run(lean)
    assert len(calls) == 1
    assert torch.equal(ref[0], got[0])
    torch.testing.assert_close(got[1], ref[1], rtol=1e-5, atol=1e-6)
    for name in ref[2]:
        torch.testing.assert_close(got[2][name], ref[2][name], rtol=1e-5, atol=1e-6)
    run(attention)
    assert len(calls) == 1


@pytest.mark.parametrize("zero_centered", [False, True])
def test_lean_ops_in_bf16_stay_within_bf16_rounding_of_fp32(zero_centered):
    # bf16 gradients of the lean and HF modules against an fp32 reference: the lean ones are no
    # further from it than HF's own bf16 gradients (times a small slack)
    layer = _layer("tiny-hybrid" if zero_centered else "tiny")
    for part in ("mlp", "post_attention_layernorm"):
        ref32 = layer.get_submodule(part)
        width = ref32.weight.shape[-1] if "norm" in part else ref32.gate_proj.in_features
        out_w = width if "norm" in part else ref32.down_proj.out_features
        x, grad = torch.randn(4, 16, width), torch.randn(4, 16, out_w)
        exact = _grads(ref32, x, grad)
        hf16 = copy.deepcopy(ref32).to(torch.bfloat16)
        lean16 = copy.deepcopy(hf16)
        apply_lean_ops(lean16)
        hf, lean = _grads(hf16, x.bfloat16(), grad.bfloat16()), _grads(lean16, x.bfloat16(), grad.bfloat16())
        assert torch.equal(hf[0], lean[0])
        for ref_t, hf_t, lean_t in [(exact[1], hf[1], lean[1])] + [(exact[2][n], hf[2][n], lean[2][n]) for n in exact[2]]:
            err_hf = (hf_t.float() - ref_t).norm() / ref_t.norm()
            err_lean = (lean_t.float() - ref_t).norm() / ref_t.norm()
            assert err_lean <= 1.5 * err_hf + 1e-3, (part, err_lean, err_hf)


def test_lean_swiglu_saves_the_input_and_two_matmul_outputs_only():
    layer = _layer("tiny")
    hf = layer.mlp
    lean = copy.deepcopy(hf)
    apply_lean_ops(lean)
    x = torch.randn(2, 10, hf.gate_proj.in_features)
    tokens, inter = 20, hf.gate_proj.out_features
    assert _saved_bytes(lean, x) == 4 * tokens * (hf.gate_proj.in_features + 2 * inter)
    assert _saved_bytes(hf, x) >= 4 * tokens * (hf.gate_proj.in_features + 4 * inter)


def test_lean_rmsnorm_saves_its_input_and_one_value_per_row():
    norm = _layer("tiny").post_attention_layernorm.to(torch.bfloat16)
    lean = copy.deepcopy(norm)
    apply_lean_ops(lean)
    x = torch.randn(2, 10, norm.weight.shape[0], dtype=torch.bfloat16)
    assert _saved_bytes(lean, x) == x.numel() * 2 + 20 * 4
    assert _saved_bytes(norm, x) >= x.numel() * (4 + 2)  # HF: an fp32 copy and the bf16 normalised value


def test_the_adapter_swaps_what_it_recognises_and_the_switch_turns_it_off():
    hybrid = ModelAdapter(model_config("builtin:tiny-hybrid", vocab_size=300), torch.device("cpu"), torch.float32)
    assert set(hybrid.lean_ops["linear_attention"]) == {"mlp", "input_layernorm", "post_attention_layernorm"}
    # the gated norm inside the linear attention keeps HF's forward (another formula)
    assert "linear_attn.norm" not in hybrid.lean_ops["linear_attention"]
    assert {"self_attn.q_norm", "self_attn.k_norm", "mlp"} <= set(hybrid.lean_ops["full_attention"])
    plain = ModelAdapter(model_config("builtin:tiny", vocab_size=300), torch.device("cpu"), torch.float32, lean_ops=False)
    assert plain.lean_ops == {"full_attention": []}
    assert "forward" not in vars(plain.templates["full_attention"].mlp)


def test_a_module_with_biases_keeps_hf_forward():
    layer = _layer("tiny")
    mlp = copy.deepcopy(layer.mlp)
    mlp.gate_proj = torch.nn.Linear(mlp.gate_proj.in_features, mlp.gate_proj.out_features, bias=True)
    assert apply_lean_ops(mlp) == []


def test_functions_take_no_gradient_for_what_does_not_need_one():
    x = torch.randn(2, 3, 8, requires_grad=True)
    w = [torch.randn(12, 8), torch.randn(12, 8), torch.randn(8, 12)]
    LeanSwiGLU.apply(x, *w, EAGER).sum().backward()
    assert x.grad is not None and all(t.grad is None for t in w)
    weight = torch.randn(8, requires_grad=True)
    LeanRMSNorm.apply(x.detach(), weight, 1e-6, False, EAGER).sum().backward()
    assert weight.grad is not None


@pytest.mark.parametrize("projections", [("up",), ("gate", "up")], ids=["up", "gate+up"])
def test_recomputing_projections_saves_the_others_only_and_gives_the_same_gradients(projections):
    """``mlp_up`` saves the input and the gate's output; ``mlp`` (a lean SwiGLU's) the input."""
    hf = _layer("tiny").mlp
    mlp = copy.deepcopy(hf)
    apply_lean_ops(mlp)
    x = torch.randn(2, 10, hf.gate_proj.in_features)
    grad = torch.randn(2, 10, hf.down_proj.out_features)
    tokens, inter = 20, hf.gate_proj.out_features
    with recomputing_mlp(projections):
        assert _saved_bytes(mlp, x) == 4 * tokens * (hf.gate_proj.in_features + inter * (2 - len(projections)))
        out, gx, gw = _grads(mlp, x, grad)
    mlp.zero_grad(set_to_none=True)
    ref_out, ref_gx, ref_gw = _grads(mlp, x, grad)
    # a projection recomputed is the forward's matmul again: the same bits
    assert torch.equal(out, ref_out) and torch.equal(gx, ref_gx)
    assert all(torch.equal(gw[n], ref_gw[n]) for n in ref_gw)
    _, hf_gx, _ = _grads(hf, x, grad)
    torch.testing.assert_close(gx, hf_gx, rtol=1e-5, atol=1e-6)


def test_recomputing_mlp_names_projections_it_has():
    for bad in ((), ("down",), ("gate", "down")):
        with pytest.raises(ValueError, match="projections must be some of"), recomputing_mlp(bad):
            pass


class _TwoReaders(torch.nn.Module):
    """A norm whose output two matmuls read (the q/k/v projections' pattern)."""

    def __init__(self, width: int = 16, ops=EAGER):
        super().__init__()
        self.norm = copy.deepcopy(_layer("tiny").input_layernorm)
        self.q = torch.nn.Linear(self.norm.weight.shape[0], width, bias=False)
        self.k = torch.nn.Linear(self.norm.weight.shape[0], width, bias=False)
        apply_lean_ops(self, ops)

    def forward(self, x):
        with recomputable_outputs():
            n = self.norm(x)
            return self.q(n) * self.k(n)


@pytest.mark.parametrize("device, dtype, kind", [
    ("cpu", torch.float32, "eager"),
    pytest.param("cuda", torch.bfloat16, "compiled",
                 marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))])
def test_a_norm_output_under_a_pack_hook_is_recomputed_from_the_norm_input(monkeypatch, device, dtype, kind):
    """The profiler's count (the executor's pack hook does the same): the normed tensor two
    matmuls save costs nothing beyond the norm's own input; backward recomputes it once, and the
    gradients are the bits of autograd's (on a GPU with the compiled kernels, in bf16)."""
    from lazytrain.model.pointwise import compiled
    from lazytrain.runtime.profiler import saved_tensor_bytes

    block = _TwoReaders(ops=compiled() if kind == "compiled" else EAGER).to(device, dtype)
    x = torch.randn(3, 7, block.norm.weight.shape[0], device=device, dtype=dtype).requires_grad_()
    weights = tuple(block.parameters())
    calls = []
    real = lean._norm_output
    monkeypatch.setattr(lean, "_norm_output", lambda *a, **k: calls.append(1) or real(*a, **k))
    out, recomputed = saved_tensor_bytes(lambda: block(x), weights)
    grads = torch.autograd.grad(out.sum(), [x, *weights])
    assert calls == [1]
    ref = block(x)
    assert torch.equal(out, ref)
    ref_grads = torch.autograd.grad(ref.sum(), [x, *weights])
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
    # without the registry the normed tensor is stored: x.numel() floats more
    monkeypatch.setattr(lean, "_register", lambda *a, **k: None)
    _, stored = saved_tensor_bytes(lambda: block(x), weights)
    size = x.element_size()
    assert stored - recomputed == size * x.numel()
    assert recomputed == size * x.numel() + 4 * 21 + 2 * size * 21 * 16  # x, rstd (fp32), the product's inputs


def test_a_changed_or_unregistered_output_has_no_recipe():
    norm = copy.deepcopy(_layer("tiny").input_layernorm)
    apply_lean_ops(norm)
    x = torch.randn(2, 5, norm.weight.shape[0], requires_grad=True)
    assert lean.saved_recipe(norm(x)) is None  # no registry open
    with recomputable_outputs():
        out = norm(x)
        recipe = lean.saved_recipe(out)
        assert recipe is not None and torch.equal(recipe.fn(*recipe.inputs), out)
        assert lean.saved_recipe(out[0]) is recipe  # a view of it
        assert lean.saved_recipe(x) is None
        assert lean.saved_recipe(torch._neg_view(out)) is None  # a lazy negation of it
        with torch.no_grad():
            out.mul_(2)  # changed in place: no longer the norm of x
        assert lean.saved_recipe(out) is None
        # an output that dies takes its entry along, and the inputs it held: a q/k norm's input
        # is the q/k projection's output, which a layer recomputing its attention frees
        y = torch.randn(2, 5, norm.weight.shape[0], requires_grad=True) * 1.0
        registered = len(lean._OUTPUTS.get())
        norm(y)
        assert len(lean._OUTPUTS.get()) == registered
        kept = norm(y)
        assert len(lean._OUTPUTS.get()) == registered + 1
        del kept
        assert len(lean._OUTPUTS.get()) == registered
        with torch.no_grad():
            assert lean.saved_recipe(norm(x)) is None  # no graph: nothing saves it
    assert lean.saved_recipe(out) is None  # the registry is closed

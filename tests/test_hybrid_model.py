"""Qwen3.5/3.6 model structure: the built-in shapes, the per-type layouts and what is refused."""

import pytest
import torch

from lazytrain.model.adapter import ModelAdapter, UnsupportedModelError, load_hf_config
from lazytrain.model.build import model_config
from lazytrain.model.flops import model_flops

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    "name,layers,hidden,params_b",
    [("qwen3.6-27b", 64, 5120, 26.9), ("qwen3.5-9b", 32, 4096, 8.95)],
)
def test_builtin_hybrid_shapes(name, layers, hidden, params_b):
    adapter = ModelAdapter(model_config(f"builtin:{name}"), CPU, torch.bfloat16)
    assert adapter.num_layers == layers and adapter.hidden_size == hidden and not adapter.tied
    assert adapter.layer_types == ["linear_attention"] * 3 + ["full_attention"] + adapter.layer_types[4:]
    assert adapter.layer_types.count("full_attention") * 4 == layers
    assert adapter.num_params() / 1e9 == pytest.approx(params_b, abs=0.01)
    assert adapter.vocab_size == 248320
    # partial rotary: a quarter of each 256-wide head
    cos, _ = adapter.rotary_embeddings(torch.arange(4)[None], torch.float32)
    assert cos.shape[-1] == 64
    # each layer's group has its own type's parameters; the slots are sized by the largest
    sizes = {kind: adapter.layouts[adapter.layer_types.index(kind) + 1].numel for kind in adapter.templates}
    assert sizes["linear_attention"] != sizes["full_attention"]
    assert any(p.name.startswith("linear_attn.") for p in adapter.layer_layouts[0].params)
    assert any(p.name.startswith("self_attn.") for p in adapter.layer_layouts[3].params)
    # the model FLOPs count linear layers' state work, not attention's seq-long term
    tokens = 1024
    attention_only = 6 * adapter.num_nonembedding_params() + 12 * layers * adapter.attention_dim() * 1024
    assert model_flops(adapter, tokens, 1024) < attention_only * tokens


@pytest.mark.parametrize(("config", "match"), [
    ({"model_type": "qwen3_moe", "mlp_only_layers": [1]}, r"mlp_only_layers=\[1\]: LazyTrain trains stacks whose every"),
    ({"model_type": "qwen3_moe", "decoder_sparse_step": 2}, r"decoder_sparse_step=2: .* every layer is a mixture"),
    ({"model_type": "qwen3_moe", "use_sliding_window": True}, r"use_sliding_window=true: sliding-window"),
    ({"model_type": "qwen3_5_moe_text", "num_experts": 0}, r"num_experts=0, num_experts_per_tok=8: .* at least one"),
    ({"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"]},
     r"'GptOssForCausalLM' is not supported; LazyTrain supports .*Qwen3MoeForCausalLM"),
])
def test_an_unsupported_mixture_of_experts_is_one_clear_error(config, match):
    """Dense layers among MoE ones (Qwen3-MoE's ``mlp_only_layers``, ``decoder_sparse_step``),
    sliding windows and MoE families without an adapter are refused, naming the key and value."""
    with pytest.raises(UnsupportedModelError, match=match):
        load_hf_config({"hidden_size": 32, "num_hidden_layers": 2, **config})


def test_mixture_of_experts_families_are_supported():
    """Qwen3-MoE and both forms of Qwen3.5-MoE load; the experts are stacked in each layer's
    group, and a ConditionalGeneration folder's language model sits under its prefix."""
    for model_type, arch in (("qwen3_moe", "Qwen3MoeForCausalLM"), ("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM"),
                             ("qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration")):
        config = load_hf_config({"model_type": model_type, "architectures": [arch]})
        assert config.architectures == [arch]
    text = {"hidden_size": 32, "num_hidden_layers": 2, "num_experts": 8, "moe_intermediate_size": 16,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "vocab_size": 64,
            "layer_types": ["linear_attention", "full_attention"]}
    adapter = ModelAdapter(load_hf_config({"model_type": "qwen3_5_moe", "text_config": text}), CPU, torch.float32)
    assert adapter.routing.num_experts == 8 and adapter.routing.kernel == "loop"
    assert adapter.routing.aux_coef is None  # HF's default: no load-balancing loss
    layout = adapter.layer_layouts[1]
    stacked = {p.name: p.shape for p in layout.params if p.name.startswith("mlp.experts.")}
    assert stacked == {"mlp.experts.gate_up_proj": (8, 32, 32), "mlp.experts.down_proj": (8, 32, 16)}
    assert layout.hf_prefix == "model.language_model.layers.1."
    # checkpoint files hold one tensor per expert and projection, at their places in the stack
    gate_up = next(p for p in layout.params if p.name == "mlp.experts.gate_up_proj")
    pieces = layout.hf_file_pieces(gate_up)
    assert [(n, s) for n, s, _ in pieces[:3]] == [
        ("model.language_model.layers.1.mlp.experts.0.gate_proj.weight", 0),
        ("model.language_model.layers.1.mlp.experts.0.up_proj.weight", 16 * 32),
        ("model.language_model.layers.1.mlp.experts.1.gate_proj.weight", 32 * 32)]
    assert len(pieces) == 16 and all(shape == (16, 32) for _, _, shape in pieces)


@pytest.mark.parametrize(("extra", "match"), [
    ({"layer_types": ["sliding_attention", "full_attention"]}, r"sliding-window attention is not supported"),
    ({"num_experts": 4}, r"with experts \(num_experts=4\): a dense class's config with experts"),
])
def test_an_unsupported_qwen35_text_config_is_one_clear_error(extra, match):
    """Layer types other than Gated-DeltaNet and full attention, and experts in a dense class's
    config, are refused with what to change, before any weight is read."""
    with pytest.raises(UnsupportedModelError, match=match):
        load_hf_config({"model_type": "qwen3_5_text", "hidden_size": 32, "num_hidden_layers": 2,
                        "architectures": ["Qwen3_5ForCausalLM"], **extra})

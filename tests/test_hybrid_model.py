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


def test_mixture_of_experts_is_one_clear_error():
    with pytest.raises(UnsupportedModelError, match="mixture-of-experts"):
        load_hf_config({"model_type": "qwen3_5_moe_text", "hidden_size": 32, "num_hidden_layers": 2})
    # as published: the ConditionalGeneration architecture of the MoE family
    with pytest.raises(UnsupportedModelError, match="'Qwen3_5MoeForConditionalGeneration' is not supported.*"
                       "mixture-of-experts"):
        load_hf_config({"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"]})


@pytest.mark.parametrize(("extra", "match"), [
    ({"layer_types": ["sliding_attention", "full_attention"]}, r"sliding-window attention is not supported"),
    ({"num_experts": 4}, r"with experts \(num_experts=4\): only dense"),
])
def test_an_unsupported_qwen35_text_config_is_one_clear_error(extra, match):
    """Layer types other than Gated-DeltaNet and full attention, and experts in a dense class's
    config, are refused with what to change, before any weight is read."""
    with pytest.raises(UnsupportedModelError, match=match):
        load_hf_config({"model_type": "qwen3_5_text", "hidden_size": 32, "num_hidden_layers": 2,
                        "architectures": ["Qwen3_5ForCausalLM"], **extra})

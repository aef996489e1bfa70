"""Turn a Hugging Face decoder-only model into the pieces the executor streams.

The executor never builds the full HF model with real weights. It builds one model on the
``meta`` device to read the structure, keeps one *stateless* decoder layer as a template
(its parameters are supplied per call as views of a GPU weight slot), and the embedding,
final norm, LM head and rotary embedding as small functions of resident weights.

Parameters are grouped: group 0 is the embedding, groups 1..L the decoder layers, group
L+1 the final norm and (untied) LM head. Within a group, parameters that take weight decay
(matrices) come first, then norms and biases, so the optimizer can split each flat buffer in
two.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers

from lazytrain.errors import LazyTrainError

SUPPORTED_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM")


class UnsupportedModelError(LazyTrainError, ValueError):
    pass


@dataclass(frozen=True, slots=True)
class ParamSlot:
    name: str
    """Name inside the group (``self_attn.q_proj.weight``); the HF name adds the group prefix."""
    shape: tuple[int, ...]
    offset: int
    decay: bool

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, slots=True)
class GroupLayout:
    """Where each parameter of one group lives in the group's flat buffer."""

    name: str
    hf_prefix: str
    params: tuple[ParamSlot, ...]

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def decay_numel(self) -> int:
        return sum(p.numel for p in self.params if p.decay)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        return {p.name: flat[p.offset : p.offset + p.numel].view(p.shape) for p in self.params}

    def leaves(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of ``flat`` as autograd leaves: ``torch.autograd.grad`` with respect to them
        gives each parameter's gradient, and the GPU slot itself never enters the graph."""
        return {name: view.detach().requires_grad_() for name, view in self.views(flat.detach()).items()}

    def hf_names(self) -> list[str]:
        return [self.hf_prefix + p.name for p in self.params]


def _layout(name: str, hf_prefix: str, named_shapes: list[tuple[str, tuple[int, ...]]]) -> GroupLayout:
    # decay for matrices and embeddings; norms and biases (1-D) without
    ordered = [ns for ns in named_shapes if len(ns[1]) >= 2] + [
        ns for ns in named_shapes if len(ns[1]) < 2
    ]
    params, offset = [], 0
    for pname, shape in ordered:
        slot = ParamSlot(name=pname, shape=tuple(shape), offset=offset, decay=len(shape) >= 2)
        params.append(slot)
        offset += slot.numel
    return GroupLayout(name=name, hf_prefix=hf_prefix, params=tuple(params))


def load_hf_config(source: str | Path | dict | transformers.PretrainedConfig) -> transformers.PretrainedConfig:
    """An HF config from a local folder, a dict, or a config object; never from the hub."""
    if isinstance(source, transformers.PretrainedConfig):
        config = source
    elif isinstance(source, dict):
        d = dict(source)
        model_type = d.pop("model_type", None)
        if model_type is None:
            raise UnsupportedModelError(
                "model config dict has no 'model_type'; set it to one of qwen2, qwen3, llama"
            )
        config = transformers.AutoConfig.for_model(model_type, **d)
    else:
        path = Path(source).expanduser()
        if not path.exists():
            raise UnsupportedModelError(
                f"model path {str(source)!r} does not exist. LazyTrain loads models from a local "
                "folder (config.json + *.safetensors) and does not download from the hub; "
                "download it first (e.g. `huggingface-cli download <id> --local-dir DIR`) and "
                "pass DIR"
            )
        if path.is_file():
            path = path.parent
        if not (path / "config.json").exists():
            raise UnsupportedModelError(f"{path} has no config.json: it is not an HF model folder")
        config = transformers.AutoConfig.from_pretrained(path)
    archs = getattr(config, "architectures", None) or []
    arch = archs[0] if archs else _default_arch(config.model_type)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"architecture {arch!r} is not supported; LazyTrain supports "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    config.architectures = [arch]
    layer_types = getattr(config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        raise UnsupportedModelError(
            f"layer types {sorted(set(layer_types))}: sliding-window attention is not supported; "
            "set use_sliding_window=false in config.json"
        )
    config._attn_implementation = "sdpa"
    return config


def _default_arch(model_type: str) -> str:
    return {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}.get(
        model_type, f"<model_type {model_type}>"
    )


class ModelAdapter:
    """Structure and stateless compute pieces of one supported HF model."""

    def __init__(self, config: transformers.PretrainedConfig, device: torch.device, dtype: torch.dtype):
        self.config = config
        self.device = device
        self.dtype = dtype
        self.arch = config.architectures[0]
        self.num_layers = config.num_hidden_layers
        self.hidden_size = config.hidden_size
        self.vocab_size = config.vocab_size
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        with torch.device("meta"):
            meta = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
        layer = meta.model.layers[0]
        # The template is stateless: every parameter is supplied per call by functional_call.
        self.template = layer
        self.template.requires_grad_(False)
        self.norm_module = meta.model.norm
        self.rotary = type(meta.model.rotary_emb)(config=config).to(device)

        self.embed_layout = _layout("embed", "model.", [("embed_tokens.weight", (self.vocab_size, self.hidden_size))])
        self.layer_layouts = [
            _layout(
                f"layer{i}",
                f"model.layers.{i}.",
                [(n, tuple(p.shape)) for n, p in layer.named_parameters()],
            )
            for i in range(self.num_layers)
        ]
        final = [("model.norm.weight", (self.hidden_size,))]
        if not self.tied:
            final.append(("lm_head.weight", (self.vocab_size, self.hidden_size)))
        self.final_layout = _layout("final", "", final)

    # -- structure --------------------------------------------------------------------------

    @property
    def layouts(self) -> list[GroupLayout]:
        return [self.embed_layout, *self.layer_layouts, self.final_layout]

    def num_params(self) -> int:
        return sum(g.numel for g in self.layouts)

    def num_nonembedding_params(self) -> int:
        """Parameters in the model TFLOPS formula: all but the input embedding (unless tied)."""
        n = sum(g.numel for g in self.layer_layouts) + self.final_layout.numel
        return n + (self.embed_layout.numel if self.tied else 0)

    def attention_dim(self) -> int:
        head_dim = getattr(self.config, "head_dim", None) or self.hidden_size // self.config.num_attention_heads
        return head_dim * self.config.num_attention_heads

    def init_value(self, group: GroupLayout, param: ParamSlot, generator: torch.Generator | None,
                   device: torch.device) -> torch.Tensor:
        """Random init as HF does for these families: N(0, initializer_range), norms 1, biases 0."""
        if param.name.endswith("norm.weight") or param.name == "model.norm.weight":
            return torch.ones(param.shape, device=device)
        if param.name.endswith("bias"):
            return torch.zeros(param.shape, device=device)
        std = getattr(self.config, "initializer_range", 0.02)
        return torch.empty(param.shape, device=device).normal_(0.0, std, generator=generator)

    # -- compute pieces (weights are passed in) --------------------------------------------

    def rotary_embeddings(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        probe = torch.empty(0, device=position_ids.device, dtype=dtype)
        return self.rotary(probe, position_ids)

    def layer_forward(
        self,
        params: dict[str, torch.Tensor],
        hidden: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        return torch.func.functional_call(
            self.template,
            params,
            (hidden,),
            {"attention_mask": attention_mask, "position_embeddings": position_embeddings},
            strict=True,
        )

    def embed(self, weight: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, weight)

    def embed_backward(self, input_ids: torch.Tensor, grad: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """The fp32 gradient of ``embed``'s weight given the gradient of its output.

        Each token's row sums that token's gradient over the whole batch (hundreds of terms
        for a frequent token); autograd sums in the weight's dtype, and in bf16 that was 9.5% off
        fp32 (relative norm) on the built-in default (`tests/test_precision.py`).
        """
        rows = grad.reshape(-1, grad.shape[-1]).float()
        return torch.zeros(shape, dtype=torch.float32, device=grad.device).index_add_(0, input_ids.reshape(-1), rows)

    def final_norm(self, weight: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(self.norm_module, {"weight": weight}, (hidden,))

    def head_weight(self, embed_params: dict[str, torch.Tensor], final_params: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.tied:
            return embed_params["embed_tokens.weight"]
        return final_params["lm_head.weight"]


def attention_mask_4d(attention_mask: torch.Tensor, queries: int | None = None) -> torch.Tensor:
    """Causal + key-padding mask for sdpa, built on ``attention_mask``'s device.

    ``attention_mask`` is [B, keys] (1 = real token); the mask is for the last ``queries``
    positions (all of them by default; 1 when decoding with a KV cache). Only for padded
    batches: an unpadded one passes None and takes sdpa's is_causal path.

    A boolean [B, 1, queries, keys] mask, True where a query may attend. HF layers called
    directly need this 4-D form: a 2-D tokenizer mask would be misread. A query row with no
    allowed key (a padded position before any real token) may attend to itself, so sdpa never
    sees an all-masked row (which gives NaN); such positions carry no loss and are never read.
    """
    keys = attention_mask.shape[1]
    queries = keys if queries is None else queries
    device = attention_mask.device
    causal = torch.ones(queries, keys, dtype=torch.bool, device=device).tril_(keys - queries)
    mask = causal[None, None] & attention_mask.bool()[:, None, None, :]
    diagonal = torch.zeros(queries, keys, dtype=torch.bool, device=device)
    diagonal[torch.arange(queries), torch.arange(keys - queries, keys)] = True
    return mask | diagonal[None, None]

"""Turn a Hugging Face decoder-only model into the pieces the executor streams.

The executor never builds the full HF model with real weights. It builds one model on the
``meta`` device to read the structure, keeps one *stateless* decoder layer as a template
(its parameters are supplied per call as views of a GPU weight slot), and the embedding,
final norm, LM head and rotary embedding as small functions of resident weights.

Parameters are grouped: group 0 is the embedding, groups 1..L the decoder layers, group
L+1 the final norm and (untied) LM head. Within a group, parameters that take weight decay
(matrices) come first, then norms and biases, so the optimizer can split each flat buffer in
two.

A stack may mix layer types (Qwen3.5/3.6: Gated-DeltaNet ``linear_attention`` layers and gated
``full_attention`` layers). Each layer has a type (``layer_types``); there is one template per
type, and each type gets its own mask (``layer_masks``): a 4-D causal mask for attention, the
2-D padding mask for linear attention (which zeroes padded positions, as HF does).

Packed rows (several samples per row, ``document_ids``) are cut into segments
(`packed_segments`). Attention layers run flash attention's variable-length kernel over them
where the device has it (CUDA, bf16), else a block-diagonal causal mask through sdpa, exact on
every device (`lazytrain.model.packed_attention`). Linear-attention layers get the segments too,
with which their convolution and recurrent state restart at each sample
(`lazytrain.model.kernels`).
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers

from lazytrain.errors import LazyTrainError
from lazytrain.model.kernels import KernelChoice, select_linear_attention_kernels
from lazytrain.model.lean import apply_lean_ops, recomputable_outputs
from lazytrain.model.moe import (
    EXPERT_TENSORS,
    Routing,
    apply_moe,
    expert_pieces,
    select_experts_kernel,
)
from lazytrain.model.packed_attention import (
    PACKED_ATTENTION,
    PackedAttentionError,
    VarlenKernel,
    select_packed_attention,
    torch_varlen_kernel,
    use_varlen,
)
from lazytrain.model.pointwise import EAGER, Pointwise, select_pointwise
from lazytrain.model.sublayer import recomputing

SUPPORTED_ARCHITECTURES = (
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "LlamaForCausalLM",
    "Qwen3_5ForCausalLM",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3MoeForCausalLM",
    "Qwen3_5MoeForCausalLM",
    "Qwen3_5MoeForConditionalGeneration",
)
HYBRID_ARCHITECTURES = ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForCausalLM",
                        "Qwen3_5MoeForConditionalGeneration")
"""Stacks of Gated-DeltaNet (``linear_attention``) and gated ``full_attention`` layers."""
MULTIMODAL_ARCHITECTURES = ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")
"""Folders whose language model sits under ``model.language_model.``; the other tensors (the
vision tower, multi-token-prediction heads) are carried through untrained."""
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")
"""Mixture-of-experts stacks: every decoder layer's MLP is a routed set of experts
(`lazytrain.model.moe`)."""
_LAYER_TYPES = {"full_attention"}
_HYBRID_LAYER_TYPES = {"full_attention", "linear_attention"}
EMBED_BACKWARD_CHUNK = 8192
"""Gradient rows of the embedding converted to fp32 at a time in `ModelAdapter.embed_backward`."""


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
    hf_rename: tuple[str, str] = ("", "")
    """(old, new): an HF name starting with ``old`` has it replaced by ``new`` (the final norm
    of a ConditionalGeneration folder is ``model.language_model.norm.weight``)."""

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

    def hf_name(self, param: ParamSlot) -> str:
        name = self.hf_prefix + param.name
        old, new = self.hf_rename
        if old and name.startswith(old):
            name = new + name[len(old):]
        return name

    def hf_names(self) -> list[str]:
        return [self.hf_name(p) for p in self.params]

    def hf_file_pieces(self, param: ParamSlot) -> list[tuple[str, int, tuple[int, ...]]]:
        """How ``param`` is written in HF checkpoint files: (name, first element within the
        parameter, shape) per tensor. One tensor named `hf_name`, except stacked experts, which
        files hold one tensor per expert and projection (`lazytrain.model.moe.expert_pieces`)."""
        name = self.hf_name(param)
        return expert_pieces(name, param.shape) or [(name, 0, param.shape)]


def _layout(name: str, hf_prefix: str, named_shapes: list[tuple[str, tuple[int, ...]]],
            hf_rename: tuple[str, str] = ("", "")) -> GroupLayout:
    # decay for matrices and embeddings; norms and biases (1-D) without
    ordered = [ns for ns in named_shapes if len(ns[1]) >= 2] + [
        ns for ns in named_shapes if len(ns[1]) < 2
    ]
    params, offset = [], 0
    for pname, shape in ordered:
        slot = ParamSlot(name=pname, shape=tuple(shape), offset=offset, decay=len(shape) >= 2)
        params.append(slot)
        offset += slot.numel
    return GroupLayout(name=name, hf_prefix=hf_prefix, params=tuple(params), hf_rename=hf_rename)


def load_hf_config(source: str | Path | dict | transformers.PretrainedConfig) -> transformers.PretrainedConfig:
    """An HF config from a local folder, a dict, or a config object; never from the hub."""
    if isinstance(source, transformers.PretrainedConfig):
        config = source
    elif isinstance(source, dict):
        d = dict(source)
        model_type = d.pop("model_type", None)
        if model_type is None:
            raise UnsupportedModelError(
                "model config dict has no 'model_type'; set it to one of qwen2, qwen3, llama, "
                "qwen3_5_text, qwen3_5, qwen3_moe, qwen3_5_moe_text, qwen3_5_moe"
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
        try:
            config = transformers.AutoConfig.from_pretrained(path)
        except (OSError, ValueError) as error:
            raise UnsupportedModelError(f"{path / 'config.json'} cannot be read: {error}") from None
    archs = getattr(config, "architectures", None) or []
    arch = archs[0] if archs else _default_arch(config.model_type)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"architecture {arch!r} is not supported; LazyTrain supports {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    config.architectures = [arch]
    text = config.get_text_config()
    layer_types = getattr(text, "layer_types", None) or []
    allowed = _HYBRID_LAYER_TYPES if arch in HYBRID_ARCHITECTURES else _LAYER_TYPES
    if any(t not in allowed for t in layer_types):
        raise UnsupportedModelError(
            f"layer types {sorted(set(layer_types))}: {arch} supports {sorted(allowed)} "
            "(sliding-window attention is not supported; set use_sliding_window=false in "
            "config.json)"
        )
    if arch in MOE_ARCHITECTURES:
        _check_experts(arch, text)
    elif getattr(text, "mlp_only_layers", None) or getattr(text, "num_experts", 0):
        raise UnsupportedModelError(
            f"{arch} with experts (num_experts={getattr(text, 'num_experts', 0)}): a dense class's config "
            "with experts; a mixture-of-experts model's config.json names its MoE class (e.g. "
            "Qwen3_5MoeForCausalLM, model_type qwen3_5_moe_text)"
        )
    config._attn_implementation = "sdpa"
    text._attn_implementation = "sdpa"
    return config


def _check_experts(arch: str, text: transformers.PretrainedConfig) -> None:
    """Refuse what the MoE layers here do not do: layers without experts among MoE ones, and
    Qwen3-MoE's sliding-window attention."""
    experts = getattr(text, "num_experts", 0) or 0
    if experts < 1 or getattr(text, "num_experts_per_tok", 0) < 1:
        raise UnsupportedModelError(
            f"{arch} with num_experts={experts}, num_experts_per_tok={getattr(text, 'num_experts_per_tok', 0)}: "
            "a mixture-of-experts model needs at least one expert and one per token")
    if getattr(text, "mlp_only_layers", None):
        raise UnsupportedModelError(
            f"{arch} with mlp_only_layers={list(text.mlp_only_layers)}: LazyTrain trains stacks whose every "
            "layer is a mixture of experts (dense layers among them are not supported); set mlp_only_layers=[] "
            "in config.json only if the checkpoint has experts in those layers")
    if getattr(text, "decoder_sparse_step", 1) != 1:
        raise UnsupportedModelError(
            f"{arch} with decoder_sparse_step={text.decoder_sparse_step}: LazyTrain trains stacks whose every "
            "layer is a mixture of experts (decoder_sparse_step=1); dense layers among them are not supported")
    if getattr(text, "sliding_window", None) is not None and getattr(text, "use_sliding_window", False):
        raise UnsupportedModelError(
            f"{arch} with use_sliding_window=true: sliding-window attention is not supported; set "
            "use_sliding_window=false in config.json")


def _default_arch(model_type: str) -> str:
    return {
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
        "llama": "LlamaForCausalLM",
        "qwen3_5_text": "Qwen3_5ForCausalLM",
        "qwen3_5": "Qwen3_5ForConditionalGeneration",
        "qwen3_moe": "Qwen3MoeForCausalLM",
        "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
        "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
    }.get(model_type, f"<model_type {model_type}>")


class ModelAdapter:
    """Structure and stateless compute pieces of one supported HF model."""

    def __init__(self, config: transformers.PretrainedConfig, device: torch.device, dtype: torch.dtype,
                 *, lean_ops: bool = True, fused_ops: str = "auto"):
        self.hf_config = config
        """The folder's config (with the vision part for a ConditionalGeneration folder)."""
        self.arch = config.architectures[0]
        self.config = config.get_text_config()
        """The language model's config: what the layers, rotary and caches are built from."""
        self.device = device
        self.dtype = dtype
        text = self.config
        self.num_layers = text.num_hidden_layers
        self.hidden_size = text.hidden_size
        self.vocab_size = text.vocab_size
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        self.layer_types: list[str] = list(getattr(text, "layer_types", None) or ["full_attention"] * self.num_layers)
        with torch.device("meta"):
            meta = transformers.AutoModelForCausalLM.from_config(text, dtype=dtype)
        # One stateless template per layer type: every parameter is supplied per call by
        # functional_call. Each is the first layer of its type.
        self.templates: dict[str, torch.nn.Module] = {}
        for i, kind in enumerate(self.layer_types):
            if kind not in self.templates:
                self.templates[kind] = meta.model.layers[i].requires_grad_(False)
        self.pointwise: Pointwise = select_pointwise(device, fused_ops) if lean_ops else EAGER
        """How the lean ops' elementwise parts run (``model.fused_ops``): eager or compiled."""
        self.lean_ops = {kind: apply_lean_ops(t, self.pointwise) if lean_ops else []
                         for kind, t in self.templates.items()}
        """Per layer type, the modules running `model.lean` forwards (fewer saved tensors)."""
        self.norm_module = meta.model.norm
        self.rotary = type(meta.model.rotary_emb)(config=text).to(device)
        self.kernels: KernelChoice | None = (
            select_linear_attention_kernels(device) if "linear_attention" in self.layer_types else None
        )
        """The Gated-DeltaNet kernels in use (None: no linear-attention layers)."""
        self.packed_attention = "mask"
        """How attention layers keep packed rows' samples apart (`lazytrain.model.packed_attention`):
        ``varlen`` (flash attention cut at the segments) or ``mask`` (a block-diagonal mask)."""
        self.set_packed_attention(select_packed_attention(device, dtype))
        self.zero_centered_norms = self.arch in HYBRID_ARCHITECTURES
        """Qwen3.5 RMSNorms scale by (1 + weight): HF initialises their weights to 0."""

        prefix = "model.language_model." if self.arch in MULTIMODAL_ARCHITECTURES else "model."
        self.embed_layout = _layout("embed", prefix, [("embed_tokens.weight", (self.vocab_size, self.hidden_size))])
        shapes = {kind: [(n, tuple(p.shape)) for n, p in t.named_parameters()] for kind, t in self.templates.items()}
        self.layer_layouts = [
            _layout(f"layer{i}", f"{prefix}layers.{i}.", shapes[kind])
            for i, kind in enumerate(self.layer_types)
        ]
        final = [("model.norm.weight", (self.hidden_size,))]
        if not self.tied:
            final.append(("lm_head.weight", (self.vocab_size, self.hidden_size)))
        self.final_layout = _layout("final", "", final, hf_rename=("model.", prefix))
        self.routing: Routing | None = None
        """The mixture-of-experts layers' kernel and load-balancing loss (None: no experts)."""
        if self.arch in MOE_ARCHITECTURES:
            itemsize = torch.empty((), dtype=dtype).element_size()
            expert_offsets = [p.offset * itemsize for layout in self.layer_layouts for p in layout.params
                              if p.name.endswith(EXPERT_TENSORS)]
            text = self.config
            self.routing = Routing(
                num_experts=text.num_experts, top_k=text.num_experts_per_tok,
                aux_coef=float(text.router_aux_loss_coef) if getattr(text, "output_router_logits", False) else None,
                kernel=select_experts_kernel(device, dtype, expert_offsets))
            for template in self.templates.values():
                if not apply_moe(template, self.routing):
                    raise UnsupportedModelError(f"{self.arch}: a decoder layer without a sparse-MoE block")

    def set_packed_attention(self, kind: str, kernel: VarlenKernel | None = None) -> None:
        """Run packed rows' attention as ``kind`` (``varlen``: with ``kernel``, torch's
        ``varlen_attn`` by default; ``mask``)."""
        if kind not in PACKED_ATTENTION:
            raise ValueError(f"packed attention must be one of {list(PACKED_ATTENTION)}, got {kind!r}")
        if kind == "varlen":
            if kernel is None and select_packed_attention(self.device, self.dtype) != "varlen":
                raise PackedAttentionError(
                    f"model.packed_attention=varlen needs flash attention's kernel: CUDA and bf16 or fp16 "
                    f"(this run: {self.device.type}, {self.dtype}); set model.packed_attention=mask or auto")
            kernel = kernel or torch_varlen_kernel()
            if kernel is None:
                raise PackedAttentionError(f"model.packed_attention=varlen: torch {torch.__version__} has no "
                                           "torch.nn.attention.varlen_attn with a causal window; set "
                                           "model.packed_attention=mask or auto")
            use_varlen(self.config, [t.self_attn for k, t in self.templates.items() if k != "linear_attention"],
                       kernel)
        else:
            self.config._attn_implementation = "sdpa"
        self.packed_attention = kind

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

    @property
    def multimodal(self) -> bool:
        """The folder is a ConditionalGeneration one (tensors outside the language model)."""
        return self.arch in MULTIMODAL_ARCHITECTURES

    @property
    def cache_kwarg(self) -> str:
        """The decoder layers' cache argument: ``cache`` from transformers 5.24 (which warns
        about ``past_key_values``, gone in 5.40), ``past_key_values`` before."""
        template = next(iter(self.templates.values()))
        return "cache" if "cache" in inspect.signature(template.forward).parameters else "past_key_values"

    def layer_type_names(self) -> list[str]:
        """The distinct layer types, in order of first appearance."""
        return list(self.templates)

    def attention_dim(self) -> int:
        head_dim = getattr(self.config, "head_dim", None) or self.hidden_size // self.config.num_attention_heads
        return head_dim * self.config.num_attention_heads

    def init_value(self, group: GroupLayout, param: ParamSlot, generator: torch.Generator | None,
                   device: torch.device) -> torch.Tensor:
        """Random init as HF does for these families: N(0, initializer_range), norms 1 (0 where
        the norm scales by 1 + weight), biases 0; Gated-DeltaNet ``dt_bias`` 1 and ``A_log`` the
        log of U(0.01, 16)."""
        if param.name.endswith("norm.weight") or param.name == "model.norm.weight":
            zero = self.zero_centered_norms and not param.name.endswith("linear_attn.norm.weight")
            return torch.zeros(param.shape, device=device) if zero else torch.ones(param.shape, device=device)
        if param.name.endswith("bias"):
            return torch.zeros(param.shape, device=device)
        if param.name.endswith("dt_bias"):
            return torch.ones(param.shape, device=device)
        if param.name.endswith("A_log"):
            return torch.empty(param.shape, device=device).uniform_(0.01, 16, generator=generator).log_()
        std = getattr(self.config, "initializer_range", 0.02)
        return torch.empty(param.shape, device=device).normal_(0.0, std, generator=generator)

    # -- compute pieces (weights are passed in) --------------------------------------------

    def rotary_embeddings(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        probe = torch.empty(0, device=position_ids.device, dtype=dtype)
        if self.kernels is not None and position_ids.dim() == 2:
            # Qwen3.5's multimodal rotary takes (3, batch, positions): the same text positions
            # on each axis (transformers 5.17 indexes three axes; later versions expand 2-D ids)
            position_ids = position_ids[None].expand(3, -1, -1)
        return self.rotary(probe, position_ids)

    def layer_masks(self, attention_mask: torch.Tensor | None, queries: int | None = None,
                    document_ids: torch.Tensor | None = None) -> dict[str, LayerMask]:
        """The mask each layer type takes, from the [B, keys] padding mask (None: unpadded).

        Attention layers get `attention_mask_4d`; linear-attention layers the 2-D mask of the
        last ``queries`` positions (their input is zeroed there, so padding never enters the
        recurrent state), or None for one-token decoding, as HF does. ``document_ids`` [B, keys]
        (packed rows, trained whole; 0 is padding) make the attention mask block-diagonal, and
        give linear-attention layers the rows' segments too (`packed_segments`).
        """
        if document_ids is not None:
            if queries is not None and queries != document_ids.shape[1]:
                raise ValueError("packed rows (document_ids) are trained whole, not decoded")
            # from the CPU copy the executor passes: no step waits on the GPU for them
            segments = packed_segments(document_ids)
            cu_cpu = segments["cu_seq_lens_q"].cpu()
            hybrid = "linear_attention" in self.templates
            if hybrid or self.packed_attention == "mask":
                on_device = document_ids.to(self.device, non_blocking=True)
                padding = on_device != 0
            if self.packed_attention == "varlen":
                attention: LayerMask = {
                    "attention_mask": None,
                    "lazytrain_cu_seqlens": cu_cpu.to(torch.int32).to(self.device, non_blocking=True),
                    "lazytrain_max_seqlen": int(cu_cpu.diff().max())}
            else:
                attention = attention_mask_4d(padding, None, on_device)
            masks = {kind: attention for kind in self.templates if kind != "linear_attention"}
            if hybrid:
                masks["linear_attention"] = {
                    "attention_mask": padding, "cu_seqlens_cpu": cu_cpu,
                    **{name: t.to(self.device, non_blocking=True) for name, t in segments.items()}}
            return masks
        masks: dict[str, LayerMask] = {}
        for kind in self.templates:
            if attention_mask is None:
                masks[kind] = None
            elif kind == "linear_attention":
                q = attention_mask.shape[1] if queries is None else queries
                masks[kind] = attention_mask[:, -q:].contiguous() if q > 1 else None
            else:
                masks[kind] = attention_mask_4d(attention_mask, queries)
        return masks

    def layer_forward(
        self,
        layer: int,
        params: dict[str, torch.Tensor],
        hidden: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        masks: dict[str, LayerMask],
        recompute: str = "none",
        **kwargs,
    ) -> torch.Tensor:
        """Decoder layer ``layer`` on ``hidden`` with ``params`` (views of its weight slot);
        ``masks`` from `layer_masks`; ``kwargs`` go to the HF layer (a cache when generating).

        ``recompute`` (``mlp`` | ``attention`` | ``mlp_up``; under autograd): that block keeps
        only its inputs and is re-run in backward (a lean SwiGLU MLP: its gate and up
        projections), or the MLP its up projection (`lazytrain.model.sublayer`)."""
        kind = self.layer_types[layer]
        template = self.templates[kind]
        # a cache is indexed by the layer's own index: the shared template takes it per call
        mixer = template.linear_attn if kind == "linear_attention" else template.self_attn
        mixer.layer_idx = layer
        # the lean norms' outputs may be recomputed rather than stored (`lean.saved_recipe`)
        with recomputing(template, kind, recompute, params), recomputable_outputs():
            return torch.func.functional_call(
                template,
                params,
                (hidden,),
                {**layer_mask_kwargs(masks[kind]), "position_embeddings": position_embeddings, **kwargs},
                strict=True,
            )

    def embed(self, weight: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, weight)

    def embed_backward(self, input_ids: torch.Tensor, grad: torch.Tensor, out: torch.Tensor,
                       chunk_tokens: int = EMBED_BACKWARD_CHUNK) -> torch.Tensor:
        """Add the gradient of ``embed``'s weight, given the gradient of its output, into
        ``out`` (the weight's shape and dtype: zeros, or the tied head's gradient) and return it.

        Each token's row sums that token's gradient over the whole batch (hundreds of terms
        for a frequent token); autograd sums in the weight's dtype, and in bf16 that was 9.5% off
        fp32 (relative norm) on the built-in default (`tests/test_precision.py`). Here the rows
        of the tokens present are summed in fp32, ``chunk_tokens`` gradient rows converted at a
        time, then added to ``out``'s rows and rounded once. The fp32 working set is (distinct
        tokens + ``chunk_tokens``) x hidden, not vocab x hidden (4 GB for Qwen3.5-9B's vocab).
        """
        ids = input_ids.reshape(-1)
        rows = grad.reshape(-1, grad.shape[-1])
        present, inverse = torch.unique(ids, return_inverse=True)
        sums = torch.zeros(present.numel(), rows.shape[1], dtype=torch.float32, device=rows.device)
        for a in range(0, rows.shape[0], chunk_tokens):
            sums.index_add_(0, inverse[a : a + chunk_tokens], rows[a : a + chunk_tokens].float())
        sums += out.index_select(0, present)
        return out.index_copy_(0, present, sums.to(out.dtype))

    def final_norm(self, weight: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(self.norm_module, {"weight": weight}, (hidden,))

    def head_weight(self, embed_params: dict[str, torch.Tensor], final_params: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.tied:
            return embed_params["embed_tokens.weight"]
        return final_params["lm_head.weight"]


LayerMask = torch.Tensor | dict[str, torch.Tensor | int | None] | None
"""What `ModelAdapter.layer_masks` gives a layer type: its ``attention_mask`` (None: none), or
for packed linear-attention layers the keyword arguments ``attention_mask``, ``seq_idx`` and
``cu_seq_lens_q`` (`packed_segments`, on the device) and ``cu_seqlens_cpu`` (a CPU copy of the
offsets, for kernels that need them on the host: `lazytrain.model.kernels`), or for packed
attention layers on the varlen path ``lazytrain_cu_seqlens`` (int32, on the device) and
``lazytrain_max_seqlen`` (`lazytrain.model.packed_attention`)."""


def layer_mask_kwargs(mask: LayerMask) -> dict[str, torch.Tensor | None]:
    """The HF layer's keyword arguments for a `LayerMask`."""
    return dict(mask) if isinstance(mask, dict) else {"attention_mask": mask}


def mask_tensors(masks: dict[str, LayerMask]) -> list[torch.Tensor]:
    """Every tensor in ``masks`` (constants of a step: the executor saves references to them)."""
    return [t for mask in masks.values() for t in layer_mask_kwargs(mask).values() if isinstance(t, torch.Tensor)]


def packed_segments(document_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The segments of packed rows, as the Gated-DeltaNet kernels take them, on
    ``document_ids``' device (on a GPU this waits for it): a segment is a run of one
    ``document_ids`` value within a row (a sample, or the row's padding), and each row starts
    one. ``seq_idx`` [B, S]: each token's segment, numbered 0.. over the rows in order;
    ``cu_seq_lens_q`` [segments + 1]: where each segment starts in the rows laid end to end, and
    their total length (int64, as fla's variable-length kernels take offsets)."""
    batch, length = document_ids.shape
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    flat = starts.reshape(-1)
    total = torch.tensor([batch * length], device=document_ids.device)
    return {"seq_idx": (flat.cumsum(0) - 1).view(batch, length),
            "cu_seq_lens_q": torch.cat([flat.nonzero().squeeze(1), total])}


def right_padded(attention_mask: torch.Tensor) -> bool:
    """Whether every row of a [B, S] padding mask (1 = real token) is its real tokens followed
    by padding only. Trained whole, such rows need no mask in any layer here: every layer type
    is causal (attention, the gated delta rule's recurrence and its short convolution), so no
    real position reads a later one, and the padding positions' outputs reach no loss."""
    real = attention_mask.bool()
    return bool((real[:, :-1] | ~real[:, 1:]).all())


def attention_mask_4d(attention_mask: torch.Tensor, queries: int | None = None,
                      document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Causal + key-padding mask for sdpa, built on ``attention_mask``'s device.

    ``attention_mask`` is [B, keys] (1 = real token); the mask is for the last ``queries``
    positions (all of them by default; 1 when decoding with a KV cache). Only for padded
    batches: an unpadded one passes None and takes sdpa's is_causal path. With
    ``document_ids`` [B, keys] (packed rows), a query attends only to keys of its own document.

    A boolean [B, 1, queries, keys] mask, True where a query may attend. HF layers called
    directly need this 4-D form: a 2-D tokenizer mask would be misread. A query row with no
    allowed key (a padded position before any real token) may attend to itself, so sdpa never
    sees an all-masked row (which gives NaN); real queries never attend to it, and the executor
    rejects a target predicted from it, so its value reaches no loss or gradient.
    """
    keys = attention_mask.shape[1]
    queries = keys if queries is None else queries
    device = attention_mask.device
    causal = torch.ones(queries, keys, dtype=torch.bool, device=device).tril_(keys - queries)
    mask = causal[None, None] & attention_mask.bool()[:, None, None, :]
    if document_ids is not None:
        mask &= (document_ids[:, -queries:, None] == document_ids[:, None, :])[:, None]
    diagonal = torch.zeros(queries, keys, dtype=torch.bool, device=device)
    diagonal[torch.arange(queries), torch.arange(keys - queries, keys)] = True
    return mask | diagonal[None, None]

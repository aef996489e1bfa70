"""Mixture-of-experts models on the planning side: the built-in shapes, FLOPs by active
parameters, the estimated cost tables of MoE layers, where an MoE step's time goes and the
batch at which it stops being bound by the update."""

from __future__ import annotations

import pytest
import torch
import transformers

from lazytrain.cli.main import main
from lazytrain.model.adapter import ModelAdapter, load_hf_config
from lazytrain.model.flops import (
    active_nonembedding_params,
    flops_6nt,
    flops_active,
    model_flops,
    moe_flops,
    moe_shape,
    token_mixing_flops_per_token,
)
from lazytrain.model.shapes import SHAPES
from lazytrain.plan.render import format_plan_table
from lazytrain.plan.search import search_batch
from lazytrain.plan.simulate import BOUND_RESOURCES, simulate
from lazytrain.plan.synthetic import (
    ExpertShape,
    MachineGuess,
    estimated_cost_table,
    layer_shape,
    moe_saved_bytes_per_token,
)

CPU = torch.device("cpu")


def hf_config(name: str, **changes) -> transformers.PretrainedConfig:
    """The built-in shape ``name`` as transformers builds its config (vocab 1000 where the shape
    takes the tokenizer's)."""
    entry = {"vocab_size": 1000, **SHAPES[name], **changes}
    config = transformers.AutoConfig.for_model(entry.pop("model_type"), **entry)
    config.architectures = SHAPES[name]["architectures"]
    return config


def meta_model(config: transformers.PretrainedConfig) -> torch.nn.Module:
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def experts_numel(layer: torch.nn.Module) -> int:
    """The stacked experts' parameters of an HF decoder layer (0: a dense MLP)."""
    experts = getattr(layer.mlp, "experts", None)
    return sum(p.numel() for p in experts.parameters()) if experts is not None else 0


def active_from_model(model: torch.nn.Module, top_k: int, num_experts: int) -> int:
    """Every parameter of ``model`` but the experts a token is not routed to, counted from the
    model's own tensors (not from the config)."""
    total = sum(p.numel() for p in model.parameters())
    return total - sum(
        experts_numel(layer) * (num_experts - top_k) // num_experts for layer in model.model.layers
    )


@pytest.mark.parametrize(
    "name,total_b,active_b",
    [
        # the published figures: 30.5B in total and 3.3B activated (Qwen3-30B-A3B's model card);
        # Qwen3.5-35B-A3B's 35B counts its vision tower too: its language model alone is 34.66B
        ("qwen3-30b-a3b", 30.53, 3.35),
        ("qwen3.5-35b-a3b", 34.66, 3.45),
    ],
)
def test_builtin_moe_shapes_have_the_published_parameter_counts(name, total_b, active_b):
    config = hf_config(name)
    model = meta_model(config)
    assert type(model).__name__ == SHAPES[name]["architectures"][0]
    moe = moe_shape(config)
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(total_b, abs=0.01)
    assert active_from_model(model, moe.top_k, moe.num_experts) / 1e9 == pytest.approx(
        active_b, abs=0.01
    )
    # the adapter's count (from its layouts) is the model's, and the FLOPs' active count agrees
    adapter = ModelAdapter(config, CPU, torch.bfloat16)
    assert adapter.num_params() == sum(p.numel() for p in model.parameters())
    assert flops_active(adapter, 1) == 6 * active_from_model(model, moe.top_k, moe.num_experts)
    assert flops_6nt(adapter, 1) == 6 * adapter.num_params()


@pytest.mark.parametrize(
    "name,changes",
    [
        ("tiny-moe", {}),
        ("tiny-moe", {"num_hidden_layers": 5, "decoder_sparse_step": 2, "mlp_only_layers": [3]}),
        ("tiny-hybrid-moe", {}),
    ],
)
def test_moe_shape_reads_which_layers_are_moe_and_their_active_parameters_from_the_config(
    name, changes
):
    config = hf_config(name, **changes)
    model = meta_model(config)
    moe = moe_shape(config)
    assert list(moe.moe_layers) == [experts_numel(layer) > 0 for layer in model.model.layers]
    if changes:
        assert moe.moe_layers == (False, True, False, False, False)  # layer 3 is listed dense
    for layer, is_moe in zip(model.model.layers, moe.moe_layers, strict=True):
        if is_moe:
            mlp = sum(p.numel() for p in layer.mlp.parameters())
            assert (
                moe.router_params + moe.num_experts * moe.expert_params + moe.shared_params == mlp
            )
            assert (
                moe.inactive_params
                == experts_numel(layer) * (moe.num_experts - moe.top_k) // moe.num_experts
            )
    assert (moe.shared_intermediate > 0) == (name == "tiny-hybrid-moe")
    if changes:  # dense and MoE layers of one attention type: the adapter's templates are per type
        return
    # the model FLOPs: 6 N_active (input embedding out, tied here) + token mixing, per token
    adapter = ModelAdapter(config, CPU, torch.float32)
    embedding = 0 if adapter.tied else adapter.embed_layout.numel
    n_active = active_from_model(model, moe.top_k, moe.num_experts) - embedding
    assert active_nonembedding_params(adapter) == n_active < adapter.num_nonembedding_params()
    mixing = sum(token_mixing_flops_per_token(adapter, kind, 64) for kind in adapter.layer_types)
    assert model_flops(adapter, 128, 64) == (6 * n_active + mixing) * 128
    assert moe_flops(adapter, 128) == {"active": flops_active(adapter, 128)}


def test_dense_models_have_no_moe_figures():
    adapter = ModelAdapter(
        load_hf_config({**SHAPES["tiny"], "vocab_size": 1000}), CPU, torch.float32
    )
    assert moe_shape(adapter.config) is None and moe_flops(adapter, 10) == {}
    assert active_nonembedding_params(adapter) == adapter.num_nonembedding_params()
    assert flops_active(adapter, 10) == flops_6nt(adapter, 10)


def test_a_bad_top_k_is_a_clear_error():
    with pytest.raises(
        ValueError, match="num_experts_per_tok=9 must be between 1 and num_experts=8"
    ):
        moe_shape(hf_config("tiny-moe", num_experts_per_tok=9))


# -- estimated cost tables -------------------------------------------------------------------


def layer_types(config: transformers.PretrainedConfig) -> list[str]:
    return getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers


def layer_params(
    config: transformers.PretrainedConfig,
) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    """Each layer type's first layer's parameters (name, shape), as the adapter's templates have them."""
    model = meta_model(config)
    out: dict[str, list] = {}
    for kind, layer in zip(layer_types(config), model.model.layers, strict=True):
        out.setdefault(kind, [(n, tuple(p.shape)) for n, p in layer.named_parameters()])
    return out


def moe_table(name: str, batch: int, seq: int, **machine):
    config = hf_config(name)
    moe = moe_shape(config)
    shapes = {
        kind: layer_shape(
            params, config.hidden_size, quadratic=kind == "full_attention", top_k=moe.top_k
        )
        for kind, params in layer_params(config).items()
    }
    vocab, h = config.vocab_size, config.hidden_size
    table = estimated_cost_table(
        layer_types(config),
        shapes,
        vocab=vocab,
        embed_params=vocab * h,
        final_params=vocab * h + h,
        batch_size=batch,
        seq_len=seq,
        machine=MachineGuess(**machine),
    )
    return table, shapes, moe


def test_an_moe_layer_streams_all_its_experts_and_computes_with_its_active_parameters():
    """Qwen3-30B-A3B's layer: weights by every expert (~11x its active parameters), forward time
    by the active ones, plus the permutation and one read of every expert's weights; its saved
    bytes hold the routing state (the formula of `moe_saved_bytes_per_token`, written out here)."""
    tokens, seq = 64 * 1024, 1024
    table, shapes, moe = moe_table("qwen3-30b-a3b", 64, seq)
    shape, layer = shapes["full_attention"], table.layers[0]
    h, k, e, i, b = 2048, 8, 128, 768, 2
    assert shape.experts == ExpertShape(num_experts=e, top_k=k, intermediate=i)
    assert shape.params == moe.router_params + e * moe.expert_params + shape.mixer_params
    assert shape.active_params == shape.mixer_params + e * h + k * 3 * h * i
    assert shape.params / shape.active_params > 10
    assert layer.weight_bytes == b * shape.params and layer.params == shape.params
    mc = MachineGuess()
    rate, hbm = mc.matmul_tflops * 1e9, mc.hbm_gbps * 1e6  # per ms
    # the routed experts' grouped GEMMs at a share of the dense rate (an H100's profile)
    routed = k * 3 * h * i
    matmuls = tokens * (2 * (shape.active_params - routed) + 2 * routed / mc.expert_gemm_efficiency
                        + 2 * seq * shape.mixer_out) / rate
    permutation = tokens * (2 * k + 2) * h * b / hbm
    expert_reads = e * 3 * h * i * b / hbm
    assert layer.forward_ms == pytest.approx(matmuls + permutation + expert_reads + 0.2, rel=1e-9)
    assert layer.forward_ms < 0.25 * tokens * 2 * shape.params / rate  # not by all its parameters
    per_token_moe = k * (2 * h + 2 * i) * b + 4 * e + 20 * k
    assert moe_saved_bytes_per_token(shape.experts, h, b) == per_token_moe
    mixed = shape.mixer_in + shape.mixer_out
    assert layer.saved_bytes == tokens * ((2 * h + mixed) * b + per_token_moe)
    # the executor's experts are no lean SwiGLU: no mlp_up; recomputing the MoE block keeps its inputs
    assert set(layer.recompute_options) == {"mlp", "attention"}
    assert layer.recompute_options["mlp"].saved_bytes == tokens * (2 * h + mixed) * b
    assert layer.recompute_options["mlp"].recompute_ms == pytest.approx(
        layer.forward_ms
        - 0.2
        - tokens * (2 * shape.mixer_params + 2 * seq * shape.mixer_out) / rate
    )


def test_a_hybrid_moe_stack_has_a_table_per_layer_type_with_the_shared_expert():
    table, shapes, moe = moe_table("tiny-hybrid-moe", 4, 256)
    types = table.type_costs()
    assert set(types) == {"linear_attention", "full_attention"}
    assert types["linear_attention"].forward_ms != types["full_attention"].forward_ms
    for kind, shape in shapes.items():
        assert shape.experts == ExpertShape(
            num_experts=8, top_k=2, intermediate=64, shared_intermediate=64
        )
        assert shape.active_params == shape.mixer_params + moe.active_mlp_params
        per_token = moe_saved_bytes_per_token(shape.experts, 128, 2)
        assert per_token == 2 * (2 * 128 + 2 * 64) * 2 + 4 * 8 + 20 * 2 + (2 * 64 + 128 + 1) * 2
        mixed = shape.mixer_in + shape.mixer_out
        assert types[kind].saved_bytes == 4 * 256 * ((2 * 128 + mixed) * 2 + per_token)


def test_an_moe_layer_needs_its_top_k():
    params = layer_params(hf_config("tiny-moe"))["full_attention"]
    with pytest.raises(ValueError, match="needs its top_k"):
        layer_shape(params, 128, quadratic=True)


# -- where the time goes, and the batch search -----------------------------------------------


def test_an_moe_step_is_update_bound_until_the_batch_makes_compute_bind():
    """On a Qwen3-30B-A3B-like table (8 of its layers, a GPU that fits every batch tried): the
    weight traffic and the CPU update do not grow with the batch, compute does, so tokens/s
    rises with the batch; while the update binds the step time hardly moves, and from the batch
    where compute binds on it does. The search keeps the fastest; the MILP's prediction of it
    is the simulator's."""
    config = hf_config("qwen3-30b-a3b", num_hidden_layers=8)
    moe = moe_shape(config)
    shape = layer_shape(
        layer_params(config)["full_attention"], 2048, quadratic=True, top_k=moe.top_k
    )
    table = estimated_cost_table(
        ["full_attention"] * 8,
        {"full_attention": shape},
        vocab=151936,
        embed_params=151936 * 2048,
        final_params=151936 * 2048 + 2048,
        batch_size=1,
        seq_len=1024,
        machine=MachineGuess(gpu_bytes=10**13),
    )
    result = search_batch(
        table,
        1024,
        batch_sizes=[1, 2, 4, 8, 16, 32, 64, 128, 256],
        const_update="host",
        optimizer_overlap=True,
        recompute=(),
    )
    tried = result.tried
    assert all(t["feasible"] for t in tried)
    speeds = [t["tokens_per_s"] for t in tried]
    assert speeds == sorted(speeds) and speeds[-1] > 20 * speeds[0]
    bounds = [t["bound"] for t in tried]
    assert bounds[0] == "cpu_update" and bounds[-1] == "compute"
    knee = bounds.index("compute")
    assert set(bounds[knee:]) == {"compute"} and "compute" not in bounds[:knee]
    assert tried[knee - 1]["step_time_s"] < 1.5 * tried[0]["step_time_s"]  # update-bound: flat
    for t in tried:
        assert sum(
            t[f"{part}_s"] for part in ("compute", "h2d", "d2h", "cpu_update", "nvme", "other")
        ) == (pytest.approx(t["step_time_s"]))
    assert result.plan.batch_size == 256 and result.sim.bound == "compute"
    assert result.plan.predicted_step_time_s == pytest.approx(result.sim.step_time_s, rel=1e-3)


def test_the_plan_table_says_where_the_time_goes_and_what_binds():
    table, _, _ = moe_table("tiny-hybrid-moe", 2, 128)
    result = search_batch(table, 128, batch_sizes=[2], const_update="host", optimizer_overlap=True)
    sim = simulate(result.plan, result.costs, optimizer_overlap=True)
    parts = sim.time_breakdown()
    assert sum(parts.values()) == pytest.approx(sim.step_time_s)
    assert sim.bound in BOUND_RESOURCES and parts[sim.bound] == max(
        parts[k] for k in BOUND_RESOURCES
    )
    text = format_plan_table(result.plan, sim, result.costs)
    assert (
        f"where the time goes: step {sim.step_time_s:.3f} s = compute {parts['compute']:.3f} s"
        in text
    )
    assert f"bound by {BOUND_RESOURCES[sim.bound]}" in text


# -- lazytrain plan --------------------------------------------------------------------------


def test_lazytrain_plan_names_the_smallest_host_fix_and_sweeps_the_batch(tmp_path, capsys):
    """A model whose state is over the host budget: the output says so and names the settings
    that fit (`memory.budget.smallest_fix`); plan.batch_sweep prints each batch's time and the
    fastest."""
    args = [
        "plan",
        "model.source=builtin:qwen2.5-0.5b",
        "memory.host_limit_gb=4",
        "training.batch_size=2",
        "data.max_seq_len=128",
        "plan.batch_sweep=4",
        f"training.output_dir={tmp_path}",
    ]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "host memory does NOT fit" in printed
    assert "smallest change that fits: set optimizer.kind=hybrid8bit (not exact" in printed
    assert "batch sweep (plan.batch_sweep=4, seq 128" in printed and "fastest: batch 4" in printed
    for batch in (1, 2, 3, 4):
        assert f"\n{batch:>6}  " in printed


@pytest.mark.parametrize("name", ["tiny-moe", "tiny-hybrid-moe"])
def test_lazytrain_plan_plans_an_moe_model_from_its_shape(tmp_path, capsys, name):
    args = [
        "plan",
        f"model.source=builtin:{name}",
        "training.batch_size=2",
        "data.max_seq_len=64",
        "memory.gpu_gb=4",
        "memory.host_limit_gb=2",
        "plan.batch_sweep=2",
        f"training.output_dir={tmp_path}",
    ]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert (
        "MoE permutation" in printed
        and "where the time goes" in printed
        and "fastest: batch" in printed
    )

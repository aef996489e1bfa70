"""The streamed loss and every parameter gradient equal plain HF autograd (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch
from conftest import HYBRID_FAMILIES, make_hf_model, random_batch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lazytrain.memory.host_store import HostStore
from lazytrain.memory.nvme import NvmeStore
from lazytrain.model.adapter import ModelAdapter, load_hf_config
from lazytrain.model.loading import load_safetensors
from lazytrain.plan.plan import (
    RECOMPUTE,
    LayerPlan,
    Plan,
    checkpoint_all_plan,
    keep_all_plan,
    megatrain_plan,
)
from lazytrain.runtime.executor import Executor

CPU = torch.device("cpu")


def streamed(folder, lean_ops: bool = True):
    adapter = ModelAdapter(load_hf_config(folder), CPU, torch.float32, lean_ops=lean_ops)
    store = HostStore(adapter.layouts, torch.float32, pin=False)
    load_safetensors(adapter, store, folder)
    return adapter, store


def reference_grads(model, ids, labels, mask):
    model.zero_grad(set_to_none=True)
    seq = ids.shape[1]
    out = model(
        input_ids=ids,
        attention_mask=mask,
        labels=labels,
        position_ids=torch.arange(seq).expand(ids.shape[0], -1),
    )
    out.loss.backward()
    return out.loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_grads_equal(adapter, store, ref_grads):
    for g, layout in enumerate(adapter.layouts):
        for p in layout.params:
            name = layout.hf_prefix + p.name
            got = store.grads[g][p.offset : p.offset + p.numel].view(p.shape)
            torch.testing.assert_close(got, ref_grads[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("policy", ["megatrain", "keep_all"])
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
def test_baselines_match_hf_autograd(hf_folder, policy, padded):
    model, folder = hf_folder
    adapter, store = streamed(folder)
    ids, labels, mask = random_batch(3, 13, adapter.vocab_size, padded)
    ref_loss, ref = reference_grads(model, ids, labels, mask)
    L = adapter.num_layers
    plan = (
        megatrain_plan(L, 3, 13, every=2, head_chunk_tokens=7)
        if policy == "megatrain"
        else keep_all_plan(L, 3, 13, head_chunk_tokens=5)
    )
    stats = Executor(adapter, store, plan, CPU).forward_backward(ids, labels, mask if padded else None)
    assert stats.loss == pytest.approx(ref_loss, rel=1e-5)
    assert_grads_equal(adapter, store, ref)
    total = sum(float(g.square().sum()) for g in ref.values()) ** 0.5
    assert stats.grad_norm == pytest.approx(total, rel=1e-5)


def test_checkpoint_on_host_matches(hf_folder):
    model, folder = hf_folder
    adapter, store = streamed(folder)
    ids, labels, mask = random_batch(2, 9, adapter.vocab_size, padded=True)
    _, ref = reference_grads(model, ids, labels, mask)
    plan = checkpoint_all_plan(adapter.num_layers, 2, 9, tier="host")
    Executor(adapter, store, plan, CPU).forward_backward(ids, labels, mask)
    assert_grads_equal(adapter, store, ref)


@st.composite
def random_plans(draw, num_layers: int):
    layers = []
    for i in range(num_layers):
        modes = ["keep", "checkpoint"]
        if i > 0 and layers[-1].mode != "keep":
            modes.append("drop")
        mode = draw(st.sampled_from(modes))
        layers.append(LayerPlan(mode=mode,
                                tier=draw(st.sampled_from(["gpu", "host", "nvme"])),
                                prefetch=draw(st.integers(1, 3)),
                                recompute=draw(st.sampled_from(RECOMPUTE)) if mode == "keep" else "none"))
    return Plan(
        policy="random",
        batch_size=2,
        seq_len=11,
        layers=layers,
        head_chunk_tokens=draw(st.integers(1, 30)),
        weight_prefetch=draw(st.integers(1, 3)),
    )


@pytest.fixture(scope="module")
def nvme(tmp_path_factory):
    from lazytrain.memory.nvme import NvmeStore

    return NvmeStore(tmp_path_factory.mktemp("nvme"))


@pytest.mark.parametrize("policy", ["megatrain", "keep_all"])
def test_the_unfused_path_matches_hf_autograd(hf_folder, policy):
    """``model.lean_ops=false`` (transformers' own norms and MLP, not the memory-lean ops): the
    path kept beside the lean one, for every family, padded."""
    model, folder = hf_folder
    adapter = ModelAdapter(load_hf_config(folder), CPU, torch.float32, lean_ops=False)
    assert not any(adapter.lean_ops.values())
    store = HostStore(adapter.layouts, torch.float32, pin=False)
    load_safetensors(adapter, store, folder)
    ids, labels, mask = random_batch(3, 13, adapter.vocab_size, padded=True)
    ref_loss, ref = reference_grads(model, ids, labels, mask)
    L = adapter.num_layers
    plan = megatrain_plan(L, 3, 13, every=2, head_chunk_tokens=7) if policy == "megatrain" \
        else keep_all_plan(L, 3, 13, head_chunk_tokens=5)
    stats = Executor(adapter, store, plan, CPU).forward_backward(ids, labels, mask)
    assert stats.loss == pytest.approx(ref_loss, rel=1e-5)
    assert_grads_equal(adapter, store, ref)


def _setup(tmp_path_factory, family: str):
    folder = tmp_path_factory.mktemp(family) / "model"
    model = make_hf_model(family, layers=6)
    model.save_pretrained(folder)
    adapter, store = streamed(folder)
    ids, labels, mask = random_batch(2, 11, adapter.vocab_size, padded=True, seed=3)
    ref_loss, ref = reference_grads(model, ids, labels, mask)
    return adapter, store, (ids, labels, mask), ref_loss, ref


@pytest.fixture(scope="module")
def qwen2_setup(tmp_path_factory):
    return _setup(tmp_path_factory, "qwen2")


@pytest.fixture(scope="module", params=HYBRID_FAMILIES)
def hybrid_setup(tmp_path_factory, request):
    """Qwen3.5: linear- and full-attention layers, a padded batch; untied with a 3:2 pattern and
    odd head counts, and tied with the published 3:1 pattern."""
    return _setup(tmp_path_factory, request.param)


def _check_random_plan(setup, nvme, data) -> None:
    adapter, store, batch, ref_loss, ref = setup
    plan = data.draw(random_plans(adapter.num_layers))
    for g in store.grads:
        g.fill_(float("nan"))
    stats = Executor(adapter, store, plan, CPU, nvme=nvme).forward_backward(*batch)
    assert stats.loss == pytest.approx(ref_loss, rel=1e-5)
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in ref.values()]))
    assert stats.grad_norm == pytest.approx(float(norm), rel=1e-5)
    assert_grads_equal(adapter, store, ref)
    assert not list(nvme.folder.glob("*.act")), "activation files must be removed after backward"


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_plans_match_hf_autograd(qwen2_setup, nvme, data):
    _check_random_plan(qwen2_setup, nvme, data)


# fewer draws: the torch reference of the chunked delta rule pads each sequence to a chunk
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_plans_match_hf_autograd_hybrid(hybrid_setup, nvme, data):
    _check_random_plan(hybrid_setup, nvme, data)


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "unfused"])
@pytest.mark.parametrize("recompute", ["mlp", "attention"])
def test_sublayer_recompute_matches_hf_autograd(hf_folder, recompute, lean):
    """Every family (Qwen3.5: Gated-DeltaNet and gated attention blocks), every tier, a kept
    layer next to one that recomputes a block, padded; a lean SwiGLU recomputes its two
    projections (`sublayer.recomputing`), any other MLP (unfused, or experts) is checkpointed."""
    model, folder = hf_folder
    adapter, store = streamed(folder, lean_ops=lean)
    ids, labels, mask = random_batch(3, 13, adapter.vocab_size, padded=True)
    ref_loss, ref = reference_grads(model, ids, labels, mask)
    tiers = ["host", "gpu", "nvme"]
    layers = [LayerPlan(mode="keep", tier=tiers[i % 3], recompute=recompute if i % 2 == 0 else "none")
              for i in range(adapter.num_layers)]
    plan = Plan(policy="x", batch_size=3, seq_len=13, layers=layers, head_chunk_tokens=7)
    nvme = NvmeStore(folder.parent / "nvme")
    stats = Executor(adapter, store, plan, CPU, nvme=nvme).forward_backward(ids, labels, mask)
    assert stats.loss == pytest.approx(ref_loss, rel=1e-5)
    assert_grads_equal(adapter, store, ref)


def test_sublayer_recompute_reads_the_backward_weight_slot(qwen2_setup):
    """Layer 0's forward slot holds another layer by its backward (a recompute segment was
    loaded in between): a recompute with the forward's weight views gets wrong gradients."""
    adapter, store, batch, _, ref = qwen2_setup
    keep, checkpoint, drop = (LayerPlan(mode="keep", recompute="mlp"), LayerPlan(mode="checkpoint"),
                              LayerPlan(mode="drop"))
    plan = Plan(policy="x", batch_size=2, seq_len=11, layers=[keep, checkpoint, drop, drop, keep, keep])
    Executor(adapter, store, plan, CPU).forward_backward(*batch)
    assert_grads_equal(adapter, store, ref)


def test_sublayer_recompute_keeps_fewer_bytes(qwen2_setup):
    adapter, store, batch, _, _ = qwen2_setup
    kept = {}
    for recompute in RECOMPUTE:
        layers = [LayerPlan(mode="keep", tier="host", recompute=recompute) for _ in range(adapter.num_layers)]
        plan = Plan(policy="x", batch_size=2, seq_len=11, layers=layers)
        kept[recompute] = Executor(adapter, store, plan, CPU).forward_backward(*batch).peak_activation_bytes["host"]
    assert kept["mlp"] < kept["none"] and kept["attention"] < kept["none"] and kept["mlp_up"] < kept["none"]
    tokens, inter = 2 * 11, adapter.config.intermediate_size
    assert kept["none"] - kept["mlp_up"] == adapter.num_layers * tokens * inter * 4  # the up projection's output
    assert kept["none"] - kept["mlp"] == adapter.num_layers * tokens * inter * 4 * 2  # and the gate's


def test_a_lean_mlp_recomputes_its_two_projections_not_the_down_one(qwen2_setup, monkeypatch):
    """``mlp`` in a layer with a lean SwiGLU: its backward runs the gate and up matmuls again,
    not the block (a checkpoint of it re-ran the down projection too: 43 against 14 ms for the
    up projection alone at 7B on the H200)."""
    from lazytrain.model import lean

    adapter, store, batch, _, ref = qwen2_setup
    inter, hidden = adapter.config.intermediate_size, adapter.config.hidden_size
    kinds = {(inter, hidden): "gate/up", (hidden, inter): "down"}
    calls = {}
    phase = ["forward"]
    linear = lean.F.linear

    def counted(x, weight, *rest):
        kind = kinds.get(tuple(weight.shape))
        if kind:
            calls[phase[0], kind] = calls.get((phase[0], kind), 0) + 1
        return linear(x, weight, *rest)

    monkeypatch.setattr(lean.F, "linear", counted)
    real_head = Executor.head_loss_backward
    monkeypatch.setattr(Executor, "head_loss_backward", lambda self, *a, **k: (phase.__setitem__(0, "backward"),
                                                                                real_head(self, *a, **k))[1])
    layers = [LayerPlan(mode="keep", tier="host", recompute="mlp") for _ in range(adapter.num_layers)]
    Executor(adapter, store, Plan(policy="x", batch_size=2, seq_len=11, layers=layers), CPU).forward_backward(*batch)
    n = adapter.num_layers
    assert calls == {("forward", "gate/up"): 2 * n, ("forward", "down"): n, ("backward", "gate/up"): 2 * n}
    assert_grads_equal(adapter, store, ref)


def test_kept_layers_store_the_norms_inputs_not_their_outputs(qwen2_setup, monkeypatch):
    """A kept layer's two norm outputs (the attention's and the MLP's inputs) are recomputed in
    backward from the norms' inputs, which are stored anyway: two [tokens, hidden] tensors
    fewer per layer, and HF's gradients."""
    from lazytrain.model import lean

    adapter, store, batch, _, ref = qwen2_setup
    plan = Plan(policy="x", batch_size=2, seq_len=11,
                layers=[LayerPlan(mode="keep", tier="host") for _ in range(adapter.num_layers)])
    lean_bytes = Executor(adapter, store, plan, CPU).forward_backward(*batch).peak_activation_bytes["host"]
    assert_grads_equal(adapter, store, ref)
    monkeypatch.setattr(lean, "_register", lambda *a, **k: None)
    stored = Executor(adapter, store, plan, CPU).forward_backward(*batch).peak_activation_bytes["host"]
    assert stored - lean_bytes == adapter.num_layers * 2 * (2 * 11 * adapter.hidden_size * 4)


@pytest.mark.parametrize("tier", ["gpu", "host"])
def test_kept_tensors_are_let_go_during_their_layers_backward(qwen2_setup, tier):
    """A kept layer's saved tensors leave the activation store as its backward reads each for
    the last time, as autograd frees them without hooks (the profiler's measurement): held to
    the end of the layer's backward they peaked 8-14 GB above the plan on the H200 (9B). The
    gradients stay HF's."""
    adapter, store, batch, _, ref = qwen2_setup
    layers = [LayerPlan(mode="keep", tier=tier, recompute=("none", "mlp", "attention")[i % 3])
              for i in range(adapter.num_layers)]
    executor = Executor(adapter, store, Plan(policy="x", batch_size=2, seq_len=11, layers=layers), CPU)
    seen: dict[int, list[int]] = {}
    real = executor._unpack

    def unpack(packed):
        out = real(packed)
        for layer in executor._bwd_slot:  # the kept layer whose backward runs
            seen.setdefault(layer, []).append(executor.activations.bytes_by_tier[tier])
        return out

    executor._unpack = unpack
    executor.forward_backward(*batch)
    assert_grads_equal(adapter, store, ref)
    assert sorted(seen) == list(range(adapter.num_layers))
    for layer, held in seen.items():  # falls within the layer's backward, not only after it
        assert held[-1] < held[0], (layer, held)
    assert executor.activations.bytes_by_tier[tier] == 0


def test_recompute_is_for_keep_layers():
    with pytest.raises(ValueError, match="recompute='mlp' is for 'keep' layers"):
        LayerPlan(mode="checkpoint", recompute="mlp")
    with pytest.raises(ValueError, match="not one of"):
        LayerPlan(mode="keep", recompute="norm")


def test_weights_cross_at_most_twice(qwen2_setup):
    adapter, store, batch, _, _ = qwen2_setup
    layer_bytes = store.weights[1].numel() * store.weights[1].element_size()
    for plan in (
        megatrain_plan(adapter.num_layers, 2, 11, every=3),
        keep_all_plan(adapter.num_layers, 2, 11),
        checkpoint_all_plan(adapter.num_layers, 2, 11),
    ):
        stats = Executor(adapter, store, plan, CPU).forward_backward(*batch)
        assert stats.h2d_weight_bytes <= 2 * adapter.num_layers * layer_bytes


def test_drop_after_keep_is_rejected():
    layers = [LayerPlan(mode="keep"), LayerPlan(mode="drop")]
    with pytest.raises(ValueError, match="drop layer must follow"):
        Plan(policy="x", batch_size=1, seq_len=4, layers=layers).check(2)
    with pytest.raises(ValueError, match="layer 0 cannot be 'drop'"):
        Plan(policy="x", batch_size=1, seq_len=4, layers=[LayerPlan(mode="drop")])


def test_plan_json_round_trip(tmp_path):
    plan = megatrain_plan(7, 4, 64, every=3)
    plan.layers[1] = LayerPlan(mode="keep", tier="host", recompute="mlp")
    plan.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json") == plan


def test_plan_json_without_recompute_loads(tmp_path):
    """A plan.json written before sub-layer recompute existed: every layer recomputes nothing."""
    import json

    d = keep_all_plan(3, 2, 8).to_dict()
    for layer in d["layers"]:
        del layer["recompute"]
    (tmp_path / "plan.json").write_text(json.dumps(d))
    assert Plan.load(tmp_path / "plan.json") == keep_all_plan(3, 2, 8)


def test_abandoned_step_frees_everything(qwen2_setup, monkeypatch):
    """An error mid-step (an out-of-memory, say) leaves nothing alive: the next try can run."""
    import gc
    import weakref

    adapter, store, batch, _, _ = qwen2_setup
    calls = {"n": 0}
    real = adapter.layer_forward

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 4:
            raise torch.OutOfMemoryError("injected")
        return real(*args, **kwargs)

    monkeypatch.setattr(adapter, "layer_forward", failing)
    executor = Executor(adapter, store, keep_all_plan(adapter.num_layers, 2, 11), CPU)
    alive = weakref.ref(executor)
    with pytest.raises(torch.OutOfMemoryError):
        executor.forward_backward(*batch)
    del executor
    gc.collect()
    assert alive() is None


def test_an_abandoned_step_settles_its_queued_copies(qwen2_setup, monkeypatch):
    """An error mid-step calls `ActivationStore.abandon` (compute then waits for the copies a
    dropped fetch's memory may still receive) before it reaches the caller."""
    adapter, store, batch, _, _ = qwen2_setup
    executor = Executor(adapter, store, checkpoint_all_plan(adapter.num_layers, 2, 11, tier="host"), CPU)
    abandoned = []
    monkeypatch.setattr(executor.activations, "abandon", lambda: abandoned.append(True))
    real = adapter.layer_forward

    def failing_once(*args, **kwargs):  # layer 1 runs out of memory in the first step only
        if abandoned == [] and args[0] == 1:
            raise torch.OutOfMemoryError("injected")
        return real(*args, **kwargs)

    monkeypatch.setattr(adapter, "layer_forward", failing_once)
    with pytest.raises(torch.OutOfMemoryError):
        executor.forward_backward(*batch)
    assert abandoned == [True]
    executor.forward_backward(*batch)  # a step that ends well does not
    assert abandoned == [True]


def left_padded_batch(vocab: int, seq: int = 11):
    ids, labels, _ = random_batch(3, seq, vocab, padded=False, seed=4)
    mask = torch.ones_like(ids)
    for row, pad in enumerate((0, 3, 6)):
        mask[row, :pad] = 0
        labels[row, : pad + 2] = -100  # padding and each row's first real token carry no target
    return ids, labels, mask


SDPA_CPU = {"math": torch.nn.attention.SDPBackend.MATH, "flash": torch.nn.attention.SDPBackend.FLASH_ATTENTION}


@pytest.mark.parametrize("backend", list(SDPA_CPU))
def test_left_padding_matches_hf_on_cpu_attention_backends(tmp_path, backend):
    model = make_hf_model("qwen2", layers=3)
    model.save_pretrained(tmp_path)
    adapter, store = streamed(tmp_path)
    ids, labels, mask = left_padded_batch(adapter.vocab_size)
    ref_loss, ref = reference_grads(model, ids, labels, mask)
    with torch.nn.attention.sdpa_kernel([SDPA_CPU[backend]]):  # that backend only
        stats = Executor(adapter, store, megatrain_plan(3, 3, 11, every=2), CPU).forward_backward(ids, labels, mask)
    assert stats.loss == pytest.approx(ref_loss, rel=1e-5)
    assert_grads_equal(adapter, store, ref)


def test_target_predicted_from_padding_is_rejected(tmp_path):
    make_hf_model("qwen2", layers=2).save_pretrained(tmp_path)
    adapter, store = streamed(tmp_path)
    ids, labels, mask = left_padded_batch(adapter.vocab_size)
    labels[1, 3] = ids[1, 3]  # row 1's first real token, after 3 padding positions
    with pytest.raises(ValueError, match=r"labels\[1, 3\] .* padding position 2 .* pad on the right"):
        Executor(adapter, store, keep_all_plan(2, 3, 11), CPU).forward_backward(ids, labels, mask)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_left_padding_matches_hf_on_cuda(tmp_path):
    cuda = torch.device("cuda")
    model = make_hf_model("qwen2", layers=3)
    model.save_pretrained(tmp_path)
    adapter = ModelAdapter(load_hf_config(tmp_path), cuda, torch.float32)
    store = HostStore(adapter.layouts, torch.float32, pin=False)
    load_safetensors(adapter, store, tmp_path)
    ids, labels, mask = left_padded_batch(adapter.vocab_size)
    ref_loss, ref = reference_grads(model, ids, labels, mask)
    for backend in (torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION, torch.nn.attention.SDPBackend.MATH):
        with torch.nn.attention.sdpa_kernel([backend]):
            stats = Executor(adapter, store, megatrain_plan(3, 3, 11, every=2), cuda).forward_backward(ids, labels, mask)
        assert stats.loss == pytest.approx(ref_loss, rel=1e-4)
        for g, layout in enumerate(adapter.layouts):
            for p in layout.params:
                got = store.grads[g][p.offset : p.offset + p.numel].view(p.shape).float().cpu()
                torch.testing.assert_close(got, ref[layout.hf_prefix + p.name], rtol=1e-4, atol=1e-5)


def test_right_padded_rows_take_the_unmasked_path_and_match_hf(hf_folder, monkeypatch):
    """Rows padded on the right build no mask (every layer is causal: no real position reads a
    padding one), so they run the kernels the profiler measured; loss and gradients still equal
    HF's with its padding mask. Left padding keeps its mask."""
    from lazytrain.model.adapter import right_padded

    assert right_padded(torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0]]))
    assert not right_padded(torch.tensor([[1, 1, 1], [0, 1, 1]]))
    assert not right_padded(torch.tensor([[1, 0, 1]]))  # a hole: not a padded row
    model, folder = hf_folder
    adapter, store = streamed(folder)
    given = []
    real = adapter.layer_masks
    monkeypatch.setattr(adapter, "layer_masks", lambda mask, *a, **k: given.append(mask) or real(mask, *a, **k))
    ids, labels, mask = random_batch(3, 13, adapter.vocab_size, padded=True)
    assert not bool(mask.all())
    ref_loss, ref = reference_grads(model, ids, labels, mask)
    stats = Executor(adapter, store, megatrain_plan(adapter.num_layers, 3, 13, every=2), CPU).forward_backward(
        ids, labels, mask)
    assert given == [None]
    assert stats.loss == pytest.approx(ref_loss, rel=1e-5)
    assert_grads_equal(adapter, store, ref)
    ids, labels, mask = left_padded_batch(adapter.vocab_size)
    Executor(adapter, store, keep_all_plan(adapter.num_layers, 3, 11), CPU).forward_backward(ids, labels, mask)
    assert given[-1] is not None and torch.equal(given[-1].cpu(), mask)
    # longer than one 64-token chunk of the gated delta rule, with a row of padding only (no
    # targets): the same loss and gradients as HF's on the two real rows
    ids, labels, mask = random_batch(3, 150, adapter.vocab_size, padded=True, seed=5)
    mask[1], labels[1] = 0, -100
    mask[2, 70:], labels[2, 70:] = 0, -100
    ref_loss, ref = reference_grads(model, ids[[0, 2]], labels[[0, 2]], mask[[0, 2]])
    stats = Executor(adapter, store, keep_all_plan(adapter.num_layers, 3, 150), CPU).forward_backward(ids, labels, mask)
    assert given[-1] is None
    assert stats.loss == pytest.approx(ref_loss, rel=1e-5)
    assert_grads_equal(adapter, store, ref)


def route_around(model, expert: int) -> None:
    """Make ``expert`` one no token is routed to, in every layer: for top-k, k pairs of router
    rows (r, -r) give k experts a logit above 0 for every token (|<r, x>| > 0), and ``expert``'s
    row is 0."""
    top_k = model.config.num_experts_per_tok
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                others = [e for e in range(p.shape[0]) if e != expert]
                for a, b in zip(others[0 : 2 * top_k : 2], others[1 : 2 * top_k : 2]):
                    p[b] = -p[a]
                p[expert] = 0.0


@pytest.mark.parametrize(("family", "top_k", "experts", "aux"), [
    ("qwen3_moe", 1, 8, True), ("qwen3_moe", 8, 17, False), ("qwen3_5_moe", 2, 8, True), ("qwen3_5_moe", 8, 17, True),
])
def test_mixture_of_experts_matches_hf_autograd(tmp_path, family, top_k, experts, aux):
    """Top-k 1, 2 and 8, without (Qwen3-MoE) and with a shared expert and its gate (Qwen3.5-MoE:
    Gated-DeltaNet and attention layers), with and without the router's load-balancing loss,
    left-padded, kept and recomputed layers: the loss (HF's, the auxiliary term in it) and every
    gradient equal HF autograd's. The last expert is routed no token: its gradient is exactly 0,
    its router row's is not (the softmax and the load-balancing loss reach it)."""
    model = make_hf_model(family, layers=3, num_experts=experts, num_experts_per_tok=top_k,
                          output_router_logits=aux, router_aux_loss_coef=0.1)
    dead = experts - 1
    route_around(model, dead)
    model.save_pretrained(tmp_path)
    adapter, store = streamed(tmp_path)
    assert (adapter.routing.aux_coef is not None) == aux and adapter.routing.top_k == top_k
    ids, labels, mask = left_padded_batch(adapter.vocab_size)
    routed = model(input_ids=ids, attention_mask=mask, output_router_logits=True).router_logits
    assert len(routed) == 3 and all(dead not in logits.topk(top_k).indices for logits in routed)
    ref_loss, ref = reference_grads(model, ids, labels, mask)
    for plan in (keep_all_plan(3, 3, 11, head_chunk_tokens=7), megatrain_plan(3, 3, 11, every=2)):
        stats = Executor(adapter, store, plan, CPU).forward_backward(ids, labels, mask)
        assert stats.loss == pytest.approx(ref_loss, rel=1e-5)
        assert_grads_equal(adapter, store, ref)
        for g, layout in enumerate(adapter.layer_layouts, start=1):
            grads = layout.views(store.grads[g])
            for name in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
                assert not grads[name][dead].any() and grads[name].any()
            assert grads["mlp.gate.weight"][dead].abs().sum() > 0

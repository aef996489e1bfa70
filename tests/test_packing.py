"""Packed batches (``data.packing``): the same samples give the same per-sample loss and
gradients packed as unpacked, no token attends across samples (nor, in Gated-DeltaNet layers,
convolves or carries recurrent state across them), positions restart per sample, and packing is
deterministic and resumes exactly. Every family, the Qwen3.5 hybrids included."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from conftest import make_hf_model
from hypothesis import given, settings
from hypothesis import strategies as st

from lazytrain.cli.main import main
from lazytrain.data.dataset import (
    IGNORE_INDEX,
    BatchConfig,
    BatchIterator,
    TokenizedDataset,
    TokenizeReport,
    collate,
    collate_packed,
    pack_rows,
)
from lazytrain.data.formats import DataError
from lazytrain.memory.host_store import HostStore
from lazytrain.model.adapter import ModelAdapter, load_hf_config, mask_tensors
from lazytrain.model.loading import load_safetensors
from lazytrain.plan.plan import LayerPlan, keep_all_plan, megatrain_plan
from lazytrain.runtime.executor import Executor

CPU = torch.device("cpu")
LENGTHS = (7, 12, 5, 9, 15, 4)
"""Samples of different lengths; packed into rows of 20 as ROWS (each row ends in padding)."""
ROWS = [(0, 1), (2, 3, 5), (4,)]
WIDTH = 20


def dataset(lengths=LENGTHS, max_seq_len: int = WIDTH, vocab: int = 101, seed: int = 0) -> TokenizedDataset:
    """Random samples whose first third is prompt (no loss), as ``tokenize_samples`` makes them;
    sample 1 has no prompt, so its first label is a token (which only packing must mask)."""
    g = torch.Generator().manual_seed(seed)
    ids, labels = [], []
    for k, n in enumerate(lengths):
        sample = torch.randint(1, vocab, (n,), generator=g).tolist()
        prompt = 0 if k == 1 else max(1, n // 3)
        ids.append(sample)
        labels.append([IGNORE_INDEX] * prompt + sample[prompt:])
    report = TokenizeReport(samples=len(ids), kept=len(ids), truncated=0, dropped=0, tokens=sum(lengths),
                            target_tokens=0, longest=max(lengths), max_seq_len=max_seq_len)
    return TokenizedDataset(input_ids=ids, labels=labels, pad_id=0, max_seq_len=max_seq_len, report=report)


def only_sample(batch, sample: int) -> torch.Tensor:
    """The batch's labels with every target of another sample removed."""
    labels = torch.full_like(batch.labels, IGNORE_INDEX)
    if batch.document_ids is None:
        row = batch.indices.index(sample)
        labels[row] = batch.labels[row]
        return labels
    row = next(r for r, samples in enumerate(batch.indices) if sample in samples)
    keep = batch.document_ids[row] == batch.indices[row].index(sample) + 1
    labels[row, keep] = batch.labels[row, keep]
    return labels


def run(executor: Executor, batch, labels=None):
    stats = executor.forward_backward(batch.input_ids, batch.labels if labels is None else labels,
                                      batch.attention_mask, position_ids=batch.position_ids,
                                      document_ids=batch.document_ids)
    return stats, [g.clone() for g in executor.store.grads]


@pytest.fixture(scope="module", params=["qwen2", "qwen3", "llama", "qwen3_5", "qwen3_5-tied"])
def qwen2(tmp_path_factory, request):
    """A family's tiny model, streamed (named for the first; Qwen3, Llama and both Qwen3.5
    hybrids too: Gated-DeltaNet layers first and between attention layers)."""
    model = make_hf_model(request.param, seed=4, layers=3)
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    adapter = ModelAdapter(load_hf_config(folder), CPU, torch.float32)
    store = HostStore(adapter.layouts, torch.float32, pin=False)
    load_safetensors(adapter, store, folder)
    return model, adapter, store


def test_packed_rows_restart_positions_and_pad_only_at_the_end():
    data = dataset()
    batch = collate_packed(data, ROWS)
    assert batch.input_ids.shape == (3, WIDTH) and batch.num_slots == 3 * WIDTH
    assert batch.num_tokens == sum(LENGTHS) and batch.indices == tuple(ROWS)
    for row, samples in enumerate(ROWS):
        start = 0
        for document, i in enumerate(samples, 1):
            n = LENGTHS[i]
            assert batch.input_ids[row, start:start + n].tolist() == data.input_ids[i]
            assert batch.position_ids[row, start:start + n].tolist() == list(range(n))
            assert batch.document_ids[row, start:start + n].tolist() == [document] * n
            # the first label is never a target: it would be predicted from the previous sample
            assert batch.labels[row, start] == IGNORE_INDEX
            assert batch.labels[row, start + 1:start + n].tolist() == data.labels[i][1:]
            start += n
        assert start < WIDTH  # every row of ROWS ends in padding
        assert batch.document_ids[row, start:].eq(0).all() and batch.attention_mask[row, start:].eq(0).all()
        assert batch.labels[row, start:].eq(IGNORE_INDEX).all()
    # the same targets as the samples unpacked
    assert batch.num_target_tokens == collate(data, list(range(len(LENGTHS)))).num_target_tokens


@pytest.mark.parametrize("plans", [("keep_all", "megatrain"), ("megatrain", "keep_all"),
                                   ("keep_all", "recompute_attention"), ("keep_all", "recompute_mlp")])
def test_packed_equals_unpacked_per_sample_loss_and_gradients(qwen2, plans):
    """Each sample's loss (its targets alone, same normaliser) and every parameter gradient,
    and the whole batch's, are the same packed (3 rows of 20, each ending in padding) as
    unpacked (6 right-padded rows); through every plan kind (kept and recomputed layers, and
    kept layers that recompute their token mixer or MLP, whose packed segments are saved)."""
    _, adapter, store = qwen2
    data = dataset()
    unpacked = collate(data, list(range(len(LENGTHS))))
    packed = collate_packed(data, ROWS)

    def executor(policy, batch):
        b, s = batch.input_ids.shape
        if policy == "megatrain":
            return Executor(adapter, store, megatrain_plan(adapter.num_layers, b, s, every=2, head_chunk_tokens=5), CPU)
        plan = keep_all_plan(adapter.num_layers, b, s, head_chunk_tokens=7)
        if policy.startswith("recompute_"):
            plan.layers = [LayerPlan(mode="keep", tier=tier, recompute=policy.removeprefix("recompute_"))
                           for tier in ("gpu", "host", "gpu")[:adapter.num_layers]]
        return Executor(adapter, store, plan, CPU)

    plain, packing = executor(plans[0], unpacked), executor(plans[1], packed)
    for sample in [None, *range(len(LENGTHS))]:
        labels = (None, None) if sample is None else (only_sample(unpacked, sample), only_sample(packed, sample))
        want, want_grads = run(plain, unpacked, labels[0])
        got, got_grads = run(packing, packed, labels[1])
        assert got.num_target_tokens == want.num_target_tokens > 0
        assert got.loss == pytest.approx(want.loss, rel=1e-5), sample
        for g, (a, b) in enumerate(zip(got_grads, want_grads)):
            # atol 1e-6 as every executor parity test: Qwen3's embedding gradient sums its rows in
            # another order packed, 2.4e-7 apart on entries near zero
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"sample {sample} group {g}")
        assert got.grad_norm == pytest.approx(want.grad_norm, rel=1e-5)
        assert got.num_tokens == want.num_tokens and got.num_slots == 60 != want.num_slots


def test_rows_that_one_sample_fills_are_segments_of_their_own(qwen2):
    """Rows without padding, back to back, whose first and last samples share a document id (1):
    each row starts a segment, so no sample reads the previous row's state or tokens."""
    _, adapter, store = qwen2
    data = dataset(lengths=(WIDTH, WIDTH, 8, 12, WIDTH))
    packed = collate_packed(data, [(0,), (1,), (2, 3), (4,)])
    assert packed.document_ids[:2].eq(1).all() and packed.document_ids[3].eq(1).all()
    unpacked = collate(data, list(range(5)))
    plan = megatrain_plan(adapter.num_layers, 4, WIDTH, every=2)
    want, want_grads = run(Executor(adapter, store, keep_all_plan(adapter.num_layers, 5, WIDTH), CPU), unpacked)
    got, got_grads = run(Executor(adapter, store, plan, CPU), packed)
    assert got.loss == pytest.approx(want.loss, rel=1e-5)
    for g, (a, b) in enumerate(zip(got_grads, want_grads)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"group {g}")


def test_packed_executor_matches_plain_hf_autograd(qwen2):
    """The packed step against the HF model's own forward of the samples unpacked (HF builds its
    padding mask itself), and for the dense families HF's own packed forward (positions
    restarting, no mask) too; HF's Qwen3.5 layers would run their state across samples there."""
    model, adapter, store = qwen2
    data = dataset()
    unpacked = collate(data, list(range(len(LENGTHS))))
    packed = collate_packed(data, ROWS)
    losses = []
    runs = [(unpacked, {"attention_mask": unpacked.attention_mask})]
    if adapter.kernels is None:
        runs.append((packed, {"position_ids": packed.position_ids}))
    for batch, kwargs in runs:
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=batch.input_ids, labels=batch.labels, use_cache=False, **kwargs).loss
        loss.backward()
        losses.append(loss.item())
    if len(losses) == 2:  # HF's own packed forward against its unpacked one
        assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    stats, grads = run(Executor(adapter, store, keep_all_plan(adapter.num_layers, 3, WIDTH), CPU), packed)
    assert stats.loss == pytest.approx(losses[0], rel=1e-5)
    params = dict(model.named_parameters())
    for g, layout in enumerate(adapter.layouts):
        for p in layout.params:
            got = grads[g][p.offset:p.offset + p.numel].view(p.shape)
            torch.testing.assert_close(got, params[layout.hf_name(p)].grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe"])
def test_packed_mixture_of_experts_matches_hf_autograd_unpacked(tmp_path, family):
    """Mixture-of-experts layers packed (routing is per token; the router's load-balancing loss
    counts the real tokens of every sample, as HF's does with its padding mask over the samples
    unpacked): the loss with its auxiliary term and every gradient, kept and recomputed layers."""
    model = make_hf_model(family, seed=4, layers=3, output_router_logits=True, router_aux_loss_coef=0.1)
    model.save_pretrained(tmp_path)
    adapter = ModelAdapter(load_hf_config(tmp_path), CPU, torch.float32)
    store = HostStore(adapter.layouts, torch.float32, pin=False)
    load_safetensors(adapter, store, tmp_path)
    data = dataset()
    unpacked, packed = collate(data, list(range(len(LENGTHS)))), collate_packed(data, ROWS)
    out = model(input_ids=unpacked.input_ids, labels=unpacked.labels, attention_mask=unpacked.attention_mask,
                use_cache=False)
    assert out.aux_loss > 0
    out.loss.backward()
    params = dict(model.named_parameters())
    for plan in (keep_all_plan(3, 3, WIDTH), megatrain_plan(3, 3, WIDTH, every=2)):
        stats, grads = run(Executor(adapter, store, plan, CPU), packed)
        assert stats.loss == pytest.approx(out.loss.item(), rel=1e-5)
        for g, layout in enumerate(adapter.layouts):
            for p in layout.params:
                got = grads[g][p.offset:p.offset + p.numel].view(p.shape)
                torch.testing.assert_close(got, params[layout.hf_name(p)].grad, rtol=1e-5, atol=1e-6)


def test_no_token_attends_across_samples(qwen2):
    """Changing one sample's tokens changes no other sample's hidden states in the same row, nor
    the loss and gradients of another sample's targets."""
    _, adapter, store = qwen2
    data = dataset()
    packed = collate_packed(data, ROWS)
    changed = collate_packed(data, ROWS)
    row, other = 1, packed.document_ids[1] == 2  # sample 3, the middle one of row 1
    changed.input_ids[row, other] = (changed.input_ids[row, other] + 7) % adapter.vocab_size
    rest = (packed.document_ids[row] != 2) & (packed.document_ids[row] != 0)

    def hidden(batch):
        x = adapter.embed(store.weights[0].view(adapter.vocab_size, -1), batch.input_ids)
        rope = adapter.rotary_embeddings(batch.position_ids, torch.float32)
        masks = adapter.layer_masks(None, document_ids=batch.document_ids)
        for i in range(adapter.num_layers):
            x = adapter.layer_forward(i, adapter.layouts[i + 1].views(store.weights[i + 1]), x, rope, masks)
        return x

    with torch.no_grad():
        a, b = hidden(packed), hidden(changed)
    assert not torch.allclose(a[row, other], b[row, other])
    torch.testing.assert_close(a[row, rest], b[row, rest], rtol=0, atol=0)
    torch.testing.assert_close(a[[0, 2]], b[[0, 2]], rtol=0, atol=0)

    executor = Executor(adapter, store, megatrain_plan(adapter.num_layers, 3, WIDTH, every=2), CPU)
    for sample in (2, 5):  # the row's other samples, before and after the changed one
        want, want_grads = run(executor, packed, only_sample(packed, sample))
        got, got_grads = run(executor, changed, only_sample(changed, sample))
        assert got.loss == want.loss
        for x, y in zip(got_grads, want_grads):
            torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_positions_restart_in_the_rotary_embedding(qwen2, monkeypatch):
    """The executor's rotary takes the packed positions, and a sample packed after another is
    embedded exactly as at the start of a row."""
    _, adapter, store = qwen2
    data = dataset()
    packed = collate_packed(data, ROWS)
    seen = []
    rotary = adapter.rotary_embeddings
    monkeypatch.setattr(adapter, "rotary_embeddings", lambda ids, dtype: seen.append(ids) or rotary(ids, dtype))
    run(Executor(adapter, store, keep_all_plan(adapter.num_layers, 3, WIDTH), CPU), packed)
    assert torch.equal(seen[0], packed.position_ids)
    alone, behind = collate_packed(data, [(3,)]), collate_packed(data, [(0, 3)])
    cos_alone, _ = rotary(alone.position_ids, torch.float32)
    cos_behind, _ = rotary(behind.position_ids, torch.float32)
    torch.testing.assert_close(cos_behind[0, 7:16], cos_alone[0, :9], rtol=0, atol=0)


@settings(max_examples=30, deadline=None)
@given(lengths=st.lists(st.integers(1, 24), min_size=1, max_size=60), width=st.integers(24, 64),
       seed=st.integers(0, 3))
def test_pack_rows_places_every_sample_once_within_the_width(lengths, width, seed):
    order = list(range(len(lengths)))
    torch.manual_seed(seed)
    order = [order[i] for i in torch.randperm(len(order)).tolist()]
    rows = pack_rows(order, lengths, width)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= width for row in rows)
    # best fit never leaves two rows that would fit into one
    fills = sorted(sum(lengths[i] for i in row) for row in rows)
    assert len(fills) < 2 or fills[0] + fills[1] > width
    assert rows == pack_rows(order, lengths, width)


def test_packed_batches_keep_one_shape_and_resume_exactly():
    data = dataset(lengths=[3 + (7 * i) % 17 for i in range(40)])
    config = BatchConfig(batch_size=2, seed=3, drop_last=True, packing=True)
    original = BatchIterator(dataset=data, config=config)
    batches = [next(original) for _ in range(3 * original.batches_per_epoch)]
    assert all(b.input_ids.shape == (2, WIDTH) for b in batches)
    epoch = [i for b in batches[:original.batches_per_epoch] for row in b.indices for i in row]
    assert len(epoch) == len(set(epoch)) > 30  # every sample at most once (the last rows may be dropped)
    resumed = BatchIterator(dataset=data, config=BatchConfig(batch_size=2, seed=0, drop_last=True, packing=True))
    fresh = BatchIterator(dataset=data, config=config)
    for _ in range(5):
        next(fresh)
    resumed.load_state_dict(fresh.state_dict())
    for want in batches[5:]:
        got = next(resumed)
        assert got.indices == want.indices and torch.equal(got.input_ids, want.input_ids)
    unpacked = BatchIterator(dataset=data, config=BatchConfig(batch_size=2, drop_last=True))
    with pytest.raises(DataError, match="packing: saved True, now False"):
        unpacked.load_state_dict(fresh.state_dict())


def test_too_few_rows_for_a_batch_is_an_error():
    with pytest.raises(DataError, match="gives 2 rows, fewer than batch_size=3"):
        BatchIterator(dataset=dataset(lengths=[8, 8, 8, 8]), config=BatchConfig(batch_size=3, drop_last=True,
                                                                                packing=True))


COMMON = ["training.batch_size=4", "training.progress=false", "data.builtin_train_size=64", "data.heldout_size=2",
          "data.max_seq_len=256", "data.packing=true", "optimizer.warmup_steps=2"]


def step_records(out) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


@pytest.mark.parametrize("source", ["builtin:tiny", "builtin:tiny-hybrid"])
def test_cli_trains_packed_and_resumes_exactly(tmp_path, source):
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    common = [*COMMON, f"model.source={source}"]
    assert main(["train", "training.steps=4", f"training.output_dir={whole}", *common]) == 0
    assert main(["train", "training.steps=2", f"training.output_dir={cut}", *common]) == 0
    assert main(["train", "training.steps=4", f"training.output_dir={cut}", "training.resume=true", *common]) == 0
    want, got = step_records(whole), step_records(cut)
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=1e-6)
    for r in want:
        assert r["seq_len"] == 256 and r["batch_size"] == 4
        assert r["tokens"] + r["pad_tokens"] == 4 * 256
        assert r["fill_ratio"] == pytest.approx(r["tokens"] / 1024) and r["fill_ratio"] > 0.6
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["step_time_s"])


def test_data_parallel_ranks_take_whole_packed_rows():
    from lazytrain.runtime.distributed import DataParallel, RankInfo

    packed = collate_packed(dataset(), [*ROWS, (0,)])
    parallel = DataParallel.__new__(DataParallel)  # local_rows needs only the rank, no process group
    for rank in (0, 1):
        parallel.info = RankInfo(rank=rank, world_size=2, local_rank=rank, local_world_size=2, node_rank=0)
        rows = parallel.local_rows(packed)
        mine = slice(2 * rank, 2 * rank + 2)
        assert rows.indices == packed.indices[mine]
        for name in ("input_ids", "labels", "position_ids", "document_ids", "attention_mask"):
            assert torch.equal(getattr(rows, name), getattr(packed, name)[mine]), name
        assert rows.num_tokens == int(packed.attention_mask[mine].sum())


def test_the_packed_convolution_saves_what_the_unpacked_one_does():
    """Packing adds to the Gated-DeltaNet convolution's saved tensors only the token positions it
    indexes with (8 bytes a token), not a copy of its input (16 KB a token at Qwen3.5-9B): the
    profiler, which measures layers unpacked, stays right for packed steps there."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    from lazytrain.model.adapter import packed_segments
    from lazytrain.model.kernels import select_linear_attention_kernels
    from lazytrain.runtime.profiler import saved_tensor_bytes

    select_linear_attention_kernels(CPU)  # as a hybrid model's adapter does
    packed = collate_packed(dataset(), ROWS)
    segments = packed_segments(packed.document_ids)
    x = torch.randn(3, 96, WIDTH, requires_grad=True)
    weight = torch.randn(96, 4, requires_grad=True)
    saved = {}
    for name, kwargs in (("unpacked", {}), ("packed", segments)):
        _, saved[name] = saved_tensor_bytes(lambda kw=kwargs: hf.causal_conv1d_fn(x * 1, weight, None, activation="silu",
                                                                                   **kw), (weight, *segments.values()))
    assert saved["packed"] <= saved["unpacked"] + 8 * packed.input_ids.numel()


def test_the_torch_delta_rule_groups_packed_segments_by_length():
    """The torch reference pads each segment only to the longest of its group, at most twice its
    shortest (a padding tail of 1 token among samples of hundreds costs no more than itself)."""
    from lazytrain.model.kernels import GROUP_SPREAD, _length_groups

    lengths = [300, 1, 4, 350, 700, 2, 1024, 9, 512, 513]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    groups = _length_groups(cu)
    assert sorted(i for group in groups for i in group) == list(range(len(lengths)))
    for group in groups:
        sizes = [lengths[i] for i in group]
        assert max(sizes) <= GROUP_SPREAD * min(sizes)
    padded = sum(len(group) * max(lengths[i] for i in group) for group in groups)
    assert padded <= GROUP_SPREAD * sum(lengths) < len(lengths) * max(lengths)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe", "qwen3_5", "qwen3_5_moe"])
def test_packed_step_on_cuda_matches_unpacked_on_the_cpu(tmp_path, family):
    """On CUDA (fp32; the Gated-DeltaNet layers on whichever kernels the device has), a packed
    step with recomputed and host-tier layers gives the loss and gradients of the same samples
    unpacked on the CPU; the segments come from the batch's CPU copy."""
    cuda = torch.device("cuda")
    model = make_hf_model(family, seed=4, layers=3)
    model.save_pretrained(tmp_path)
    data = dataset()
    unpacked = collate(data, list(range(len(LENGTHS))))
    packed = collate_packed(data, ROWS)
    results = []
    for device, batch, plan in ((CPU, unpacked, keep_all_plan(3, 6, unpacked.input_ids.shape[1])),
                                (cuda, packed, megatrain_plan(3, 3, WIDTH, every=2))):
        adapter = ModelAdapter(load_hf_config(tmp_path), device, torch.float32)
        store = HostStore(adapter.layouts, torch.float32, pin=device.type == "cuda")
        load_safetensors(adapter, store, tmp_path)
        if device.type == "cuda":
            plan.layers[1] = LayerPlan(mode="keep", tier="host", recompute="attention")
        results.append(run(Executor(adapter, store, plan, device), batch))
    (want, want_grads), (got, got_grads) = results
    assert got.loss == pytest.approx(want.loss, rel=1e-4)
    for g, (a, b) in enumerate(zip(got_grads, want_grads)):
        torch.testing.assert_close(a.float().cpu(), b, rtol=1e-4, atol=1e-5, msg=f"group {g}")


def reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, window_size=(-1, -1), scale=None, enable_gqa=False):
    """torch's ``varlen_attn`` by its definition, for the CPU: each segment's attention alone
    (sdpa's math kernel); causal with ``window_size=(-1, 0)``, as the varlen path asks."""
    assert window_size == (-1, 0) and cu_q is cu_k and max_q == max_k and cu_q.dtype == torch.int32
    reference_varlen.calls += 1
    parts = []
    for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
        assert 0 < b - a <= max_q

        def segment(t, a=a, b=b):
            return t[a:b].transpose(0, 1)[None]

        out = F.scaled_dot_product_attention(segment(q), segment(k), segment(v), is_causal=True, scale=scale,
                                             enable_gqa=enable_gqa)
        parts.append(out[0].transpose(0, 1))
    return torch.cat(parts)


reference_varlen.calls = 0


@pytest.mark.parametrize("policy", ["keep_all", "megatrain", "recompute_attention"])
def test_the_varlen_path_equals_the_mask_path(qwen2, policy):
    """Packed rows through the varlen path (the rows laid end to end, attention cut at the
    segments; here with the kernel's CPU definition) give the mask path's loss and gradients,
    kept, recomputed and with the attention block recomputed from the host tier, in every
    family (grouped-query heads included); no [B, 1, S, S] mask is built."""
    _, adapter, store = qwen2
    packed = collate_packed(dataset(), ROWS)
    b, s = packed.input_ids.shape
    plan = {"keep_all": keep_all_plan(adapter.num_layers, b, s),
            "megatrain": megatrain_plan(adapter.num_layers, b, s, every=2)}.get(policy)
    if plan is None:
        plan = keep_all_plan(adapter.num_layers, b, s)
        plan.layers = [LayerPlan(mode="keep", tier=tier, recompute="attention") for tier in ("host", "gpu", "host")]
    want, want_grads = run(Executor(adapter, store, plan, CPU), packed)
    try:
        adapter.set_packed_attention("varlen", reference_varlen)
        masks = adapter.layer_masks(None, document_ids=packed.document_ids)
        assert all(t.dim() == 1 for t in mask_tensors(masks) if t.dtype == torch.int32)
        assert not any(t.dim() == 4 for t in mask_tensors(masks))
        calls = reference_varlen.calls
        got, got_grads = run(Executor(adapter, store, plan, CPU), packed)
        assert reference_varlen.calls > calls
    finally:
        adapter.set_packed_attention("mask")
    assert got.loss == pytest.approx(want.loss, rel=1e-5)
    for g, (x, y) in enumerate(zip(got_grads, want_grads)):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=f"group {g}")


def test_packed_attention_is_chosen_per_device_and_profiled_as_it_runs(qwen2):
    """varlen only where flash attention's kernel runs (CUDA, bf16/fp16); the profiler refuses to
    time packed rows under another label than the adapter's path, and a varlen table holds no
    mask in the step's fixed memory."""
    from lazytrain.model.packed_attention import select_packed_attention
    from lazytrain.plan.synthetic import QWEN25_32B, synthetic_cost_table
    from lazytrain.runtime.profiler import profile_batch_masks

    _, adapter, _ = qwen2
    assert select_packed_attention(CPU, torch.bfloat16) == "mask"
    assert select_packed_attention(torch.device("cuda"), torch.float32) == "mask"
    assert adapter.packed_attention == "mask"
    with pytest.raises(ValueError, match="runs packed rows as packed"):
        profile_batch_masks(adapter, 2, 64, "packed_varlen")
    with pytest.raises(ValueError, match="packed attention must be one of"):
        adapter.set_packed_attention("flex")
    table = synthetic_cost_table(QWEN25_32B, batch_size=2, seq_len=1024)
    assert dataclasses.replace(table, attention="packed").mask_bytes == 2 * 1024**2
    assert dataclasses.replace(table, attention="packed_varlen").mask_bytes == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["qwen2", "qwen3_5"])
def test_the_flash_varlen_kernel_matches_the_mask_path_on_cuda(tmp_path, family):
    """On CUDA in bf16 the adapter takes torch's flash varlen kernel for packed rows; its loss and
    gradients equal the mask path's within the bf16 gradient check's 1e-2 (relative norm)."""
    cuda = torch.device("cuda")
    model = make_hf_model(family, seed=4, layers=3)
    model.save_pretrained(tmp_path)
    packed = collate_packed(dataset(), ROWS)
    adapter = ModelAdapter(load_hf_config(tmp_path), cuda, torch.bfloat16)
    assert adapter.packed_attention == "varlen"
    store = HostStore(adapter.layouts, torch.bfloat16, pin=True)
    load_safetensors(adapter, store, tmp_path)
    plan = megatrain_plan(3, 3, WIDTH, every=2)
    plan.layers[1] = LayerPlan(mode="keep", tier="host", recompute="attention")
    got, got_grads = run(Executor(adapter, store, plan, cuda), packed)
    adapter.set_packed_attention("mask")
    want, want_grads = run(Executor(adapter, store, plan, cuda), packed)
    assert got.loss == pytest.approx(want.loss, rel=1e-2)
    for g, (x, y) in enumerate(zip(got_grads, want_grads)):
        error = (x.float() - y.float()).norm() / y.float().norm().clamp_min(1e-12)
        assert error < 1e-2, f"group {g}: {error:.2e}"


def test_packed_attention_can_be_set_and_is_refused_where_it_cannot_run(tmp_path):
    """model.packed_attention=mask takes the mask path anywhere; varlen where flash attention's
    kernel cannot run (the CPU, fp32) is one clear error naming the setting."""
    from lazytrain.cli.main import main as cli
    from lazytrain.config import load_config
    from lazytrain.model.packed_attention import PackedAttentionError
    from lazytrain.train.session import build_session

    common = [f"training.output_dir={tmp_path / 'a'}", "data.packing=true", "training.batch_size=2",
              "data.builtin_train_size=8", "data.heldout_size=2"]
    assert build_session(load_config(None, [*common, "model.packed_attention=mask"])).adapter.packed_attention == "mask"
    with pytest.raises(PackedAttentionError, match=r"model.packed_attention=varlen needs .* \(this run: cpu"):
        build_session(load_config(None, [*common, "model.packed_attention=varlen"]))
    assert cli(["train", "model.packed_attention=flex", f"training.output_dir={tmp_path / 'b'}"]) == 2

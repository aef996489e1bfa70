"""The bf16 path's gradients stay close to fp32's on the built-in default.

The tied embedding's gradient sums each token's rows over the batch: hundreds of terms for a
frequent byte. Summed by autograd in bf16 it came out 9.5% off fp32 (relative norm) on the
built-in default, while every other group was within 1% (bf16 rounding); the executor sums it
in fp32 and rounds once (``ModelAdapter.embed_backward``).
"""

from __future__ import annotations

import pytest
import torch

from lazytrain.config import DataConfig
from lazytrain.data.pipeline import load_tokenizer, resolve_template, training_batches
from lazytrain.memory.host_store import HostStore
from lazytrain.model.build import build_model
from lazytrain.plan.policies import PolicyOptions, baseline_plan
from lazytrain.runtime.executor import Executor

CPU = torch.device("cpu")


def _grads(dtype: torch.dtype, batch, device: torch.device = CPU, sublayer: bool = False) -> list[torch.Tensor]:
    """Every group's gradient under keep_all; ``sublayer``: layer 0 kept with its MLP and layer
    1 with its attention recomputed in backward, on the host tier."""
    tokenizer = load_tokenizer("builtin:tiny")
    # the random init drawn on the CPU, so the CUDA run starts from the CPU reference's weights
    adapter, store = build_model("builtin:tiny", device, dtype, seed=0, vocab_size=len(tokenizer),
                                 pin=device.type == "cuda", init_device=CPU, store_factory=HostStore)
    plan = baseline_plan("keep_all", adapter.num_layers, batch.input_ids.shape[0], batch.input_ids.shape[1],
                         PolicyOptions())
    if sublayer:
        for i, lp in enumerate(plan.layers):
            lp.tier, lp.recompute = "host", ("mlp", "attention")[i % 2]
    Executor(adapter, store, plan, device).forward_backward(batch.input_ids, batch.labels, batch.attention_mask)
    return [g.float() for g in store.grads]


DEVICES = [CPU, pytest.param(torch.device("cuda"), marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))]


@pytest.mark.parametrize("device", DEVICES, ids=["cpu", "cuda"])
@pytest.mark.parametrize("sublayer", [False, True], ids=["whole", "sublayer"])
def test_bf16_gradients_of_every_group_within_one_percent_of_fp32(device, sublayer):
    """fp32 on the CPU is the reference; bf16 on ``device``, kept whole or with sub-layer
    recompute (which re-runs the blocks in bf16: the same ops as the forward)."""
    data = DataConfig(builtin_train_size=64)
    tokenizer = load_tokenizer("builtin:tiny")
    batches, _ = training_batches(data, tokenizer, resolve_template(data), batch_size=32, seed=0)
    batch = next(batches)
    real = batch.input_ids[batch.attention_mask.bool()]
    assert int(torch.bincount(real).max()) > 500  # a frequent token: the case that failed
    fp32, bf16 = _grads(torch.float32, batch), _grads(torch.bfloat16, batch, device, sublayer)
    errors = [float((b - f).norm() / f.norm()) for b, f in zip(bf16, fp32)]
    assert max(errors) < 0.01, f"relative gradient error per group (embedding first): {errors}"


def test_embedding_gradient_is_summed_in_fp32():
    tokenizer = load_tokenizer("builtin:tiny")
    adapter, _ = build_model("builtin:tiny", CPU, torch.bfloat16, seed=0, vocab_size=len(tokenizer), pin=False,
                             store_factory=HostStore)
    ids = torch.zeros(1, 4096, dtype=torch.long)  # one token, 4096 times
    grad = torch.full((1, 4096, adapter.hidden_size), 1.0 + 2**-7, dtype=torch.bfloat16)
    out = torch.zeros(adapter.vocab_size, adapter.hidden_size, dtype=torch.float32)
    g = adapter.embed_backward(ids, grad, out, chunk_tokens=1000)
    assert g is out
    # a running sum in bf16 stops growing once its spacing exceeds twice the term
    torch.testing.assert_close(g[0], torch.full_like(g[0], 4096 * (1.0 + 2**-7)))
    assert not g[1:].any()


@pytest.mark.parametrize("tied", [False, True])
def test_embedding_gradient_equals_a_full_fp32_sum_rounded_once(tied):
    """Summing only the batch's tokens' rows, a chunk at a time, gives the bits of a dense
    vocab x hidden fp32 sum (plus the tied head's gradient) rounded once."""
    adapter, _ = build_model("builtin:tiny", CPU, torch.bfloat16, seed=0, vocab_size=64, pin=False,
                             store_factory=HostStore)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 40, (3, 300), generator=gen)  # repeats, and rows never touched
    grad = torch.randn(3, 300, adapter.hidden_size, generator=gen).to(torch.bfloat16)
    shape = (adapter.vocab_size, adapter.hidden_size)
    head = torch.randn(shape, generator=gen).to(torch.bfloat16) if tied else torch.zeros(shape, dtype=torch.bfloat16)
    dense = torch.zeros(shape).index_add_(0, ids.reshape(-1), grad.reshape(-1, shape[1]).float())
    expected = (dense + head.float()).to(torch.bfloat16)
    got = adapter.embed_backward(ids, grad, head.clone(), chunk_tokens=128)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, expected)


@pytest.mark.parametrize("where", ["auto", "cpu"])
def test_model_init_device_reaches_the_build(monkeypatch, where):
    """``model.init_device=cpu`` draws a built-in shape's random init on the CPU whatever the
    training device, so a seed means the same weights on a GPU as on the CPU (a GPU's generator
    draws others: the H200 accuracy study's seeds were other models than the CPU's). Checked
    here: the session hands the setting to the build, and the init is drawn on that device (on
    this CPU-only run both settings draw on the CPU; the CUDA precision test above draws its
    init on the CPU this way)."""
    import lazytrain.model.build as build_module
    import lazytrain.train.session as session_module
    from lazytrain.config import load_config

    handed, drawn = [], []
    real_build, real_init = session_module.build_model, build_module.random_init

    def build_model(*args, **kwargs):
        handed.append(kwargs.get("init_device"))
        return real_build(*args, **kwargs)

    def random_init(adapter, store, seed, device):
        drawn.append(device)
        real_init(adapter, store, seed, device)

    monkeypatch.setattr(session_module, "build_model", build_model)
    monkeypatch.setattr(build_module, "random_init", random_init)
    session_module.build_session(load_config(None, [f"model.init_device={where}", "training.device=cpu"]))
    assert handed == [CPU if where == "cpu" else None] and drawn == [CPU]


def test_model_init_device_takes_auto_or_cpu():
    from lazytrain.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="init_device"):
        load_config(None, ["model.init_device=cuda"])

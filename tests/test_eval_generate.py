"""Generation: streamed equals resident token for token; eval CLI on a file; skipped steps."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import make_hf_model

from lazytrain.cli.main import main
from lazytrain.config import load_config
from lazytrain.eval.generate import cut_at_stop, generate_resident, generate_streamed
from lazytrain.memory.host_store import HostStore
from lazytrain.model.adapter import ModelAdapter, load_hf_config
from lazytrain.model.loading import load_safetensors
from lazytrain.train.trainer import Trainer


@pytest.mark.parametrize("family", ["qwen2", "qwen2-tied", "qwen3", "llama", "qwen3_5", "qwen3_5-tied"])
def test_streamed_generation_equals_hf_generate(tmp_path, family):
    """Hybrid stacks too: KV caches for attention layers, conv + recurrent state for linear ones."""
    model = make_hf_model(family, layers=3)
    model.save_pretrained(tmp_path)
    adapter = ModelAdapter(load_hf_config(tmp_path), torch.device("cpu"), torch.float32)
    store = HostStore(adapter.layouts, torch.float32, pin=False)
    load_safetensors(adapter, store, tmp_path)
    prompts = [[5, 6, 7, 8, 9], [10, 11], [3, 4, 5, 6, 7, 8, 9, 10]]  # left padding differs per row
    want = generate_resident(model, prompts, 12, pad_id=0, eos_id=None)
    got = generate_streamed(adapter, store, prompts, 12, pad_id=0, eos_id=None)
    assert got == want
    assert all(len(t) == 12 for t in got)
    # with an eos id, both stop at it (and drop it)
    eos = want[0][3]
    assert generate_streamed(adapter, store, prompts, 12, 0, eos) == generate_resident(model, prompts, 12, 0, eos)


def test_cut_at_stop():
    assert cut_at_stop("1 + 1 = 2\nThe answer is: 2\n\n\nQ: next", ("\n\n\n", "\nQ: ")) == "1 + 1 = 2\nThe answer is: 2"
    assert cut_at_stop("no stop here", ("###",)) == "no stop here"


def test_eval_cli_on_a_gsm8k_style_file(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "training.steps=2", "training.batch_size=4", "training.progress=false",
                 f"training.output_dir={out}", "data.builtin_train_size=32", "data.heldout_size=2"]) == 0
    data = tmp_path / "test.jsonl"
    rows = [{"query": f"What is {a} plus 1?", "response": f"{a} + 1 = {a + 1}\n#### {a + 1}", "type": t}
            for a, t in [(1, "easy"), (20, "easy"), (300, "hard")]]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert main(["eval", f"eval.model={out}", f"eval.data={data}", "eval.max_new_tokens=8",
                 f"eval.output={tmp_path / 'pred.jsonl'}"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["n"] == 3 and set(report["per_type"]) == {"easy", "hard"}
    assert report["per_type"]["easy"]["n"] == 2
    predictions = [json.loads(line) for line in (tmp_path / "pred.jsonl").read_text().splitlines()]
    assert [p["query"] for p in predictions] == [r["query"] for r in rows]


def test_eval_cli_bad_data_is_one_clear_error(tmp_path, capsys):
    out = tmp_path / "run"
    main(["train", "training.steps=1", "training.batch_size=2", "training.progress=false",
          f"training.output_dir={out}", "data.builtin_train_size=8", "data.heldout_size=1"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"query": "a", "response": "b"}\n{not json}\n')
    assert main(["eval", f"eval.model={out}", f"eval.data={bad}"]) == 2
    err = capsys.readouterr().err
    assert "bad.jsonl" in err and "line 2" in err and "Traceback" not in err


def test_non_finite_gradient_skips_the_step_and_touches_nothing(tmp_path, monkeypatch):
    config = load_config(None, ["training.steps=3", "training.batch_size=4", "training.progress=false",
                                f"training.output_dir={tmp_path}", "data.builtin_train_size=32",
                                "data.heldout_size=2"])
    trainer = Trainer(config)
    trainer.setup()
    real = trainer.executor.forward_backward
    calls = {"n": 0}

    def second_step_is_nan(*args, **kwargs):
        stats = real(*args, **kwargs)
        calls["n"] += 1
        if calls["n"] == 2:
            trainer.updater.finish()
            snapshot["masters"] = [m.clone() for m in trainer.store.masters]
            snapshot["steps"] = list(trainer.optimizer.steps)
            stats.grad_norm = math.nan
        elif calls["n"] == 3:
            trainer.updater.finish()
            snapshot["after"] = [m.clone() for m in trainer.store.masters]
            snapshot["steps_after"] = list(trainer.optimizer.steps)
        return stats

    snapshot: dict = {}
    monkeypatch.setattr(trainer.executor, "forward_backward", second_step_is_nan)
    summary = trainer.train()
    assert summary["skipped_steps"] == 1
    assert snapshot["steps_after"] == snapshot["steps"]
    assert all(torch.equal(a, b) for a, b in zip(snapshot["masters"], snapshot["after"]))
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped"] for r in records if "loss" in r] == [False, True, False]


def test_evaluate_on_another_tier_uses_that_tiers_held_out_split(tmp_path, monkeypatch):
    """The fine-tuning study's retained exact match: Trainer.evaluate(tier) scores the held-out
    problems of ``tier``, not of the tier trained on."""
    from lazytrain.data.synthetic import make_samples
    from lazytrain.eval import evaluate

    config = load_config(None, ["training.steps=1", "training.batch_size=2", "training.progress=false",
                                f"training.output_dir={tmp_path}", "data.builtin_train_size=8",
                                "data.heldout_size=3", "data.builtin_tier=addsub"])
    trainer = Trainer(config)
    trainer.setup()
    seen = []
    monkeypatch.setattr(evaluate, "streamed_exact_match",
                        lambda adapter, store, tokenizer, template, samples: seen.append(samples)
                        or {"accuracy": 0.5, "no_answer": 0, "n": len(samples)})
    assert trainer.evaluate("add2")["eval_samples"] == 3 and trainer.evaluate()["eval_samples"] == 3
    assert seen[0] == make_samples("heldout", 3, seed=0, tier="add2")
    assert seen[1] == make_samples("heldout", 3, seed=0, tier="addsub") != seen[0]
    trainer.evaluate("add2", seed=7)  # the base model's held-out problems, drawn with its seed
    assert seen[2] == make_samples("heldout", 3, seed=7, tier="add2") != seen[0]


def test_eval_cli_on_a_hybrid_model_gives_the_same_answers_resident_and_streamed(tmp_path):
    """`lazytrain eval` of a trained Qwen3.5 hybrid (Gated-DeltaNet and attention layers):
    whole-model generation (HF cache: attention KV, recurrent and convolution states) and
    streamed generation predict the same text."""
    out = tmp_path / "run"
    # 40 steps: enough that it writes the answer's form ("10 + 10 = 12"), not blanks, so the two
    # generations have to agree on every token of a text the states shape
    assert main(["train", "model.source=builtin:tiny-hybrid", "training.steps=40", "optimizer.lr=3e-3",
                 "training.batch_size=4", "training.progress=false", f"training.output_dir={out}",
                 "data.builtin_train_size=32", "data.heldout_size=2"]) == 0
    predictions = {}
    for mode in ("resident", "streamed"):
        path = tmp_path / f"{mode}.jsonl"
        assert main(["eval", f"eval.model={out}", f"eval.mode={mode}", "eval.num_samples=4",
                     "eval.max_new_tokens=12", "eval.device=cpu", f"eval.output={path}"]) == 0
        predictions[mode] = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(predictions["resident"]) == 4 and all("=" in p["prediction"] for p in predictions["resident"])
    assert predictions["resident"] == predictions["streamed"]

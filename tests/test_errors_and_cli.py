"""Bad inputs give errors that say what and what to do; the CLI runs end to end."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from lazytrain.cli.main import main
from lazytrain.config import ConfigError, load_config
from lazytrain.memory.host_store import HostMemoryError, HostStore
from lazytrain.model.adapter import ModelAdapter, UnsupportedModelError, load_hf_config
from lazytrain.model.build import model_config


def test_hub_id_is_refused_with_what_to_do():
    with pytest.raises(UnsupportedModelError, match="does not download from the hub"):
        load_hf_config("Qwen/Qwen2.5-7B")


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2)
    config.architectures = ["GPT2LMHeadModel"]
    config.save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="Qwen2ForCausalLM, Qwen3ForCausalLM, LlamaForCausalLM"):
        load_hf_config(tmp_path)


def test_folder_without_config(tmp_path):
    with pytest.raises(UnsupportedModelError, match="no config.json"):
        load_hf_config(tmp_path)


def test_unknown_builtin_shape():
    with pytest.raises(UnsupportedModelError, match="unknown built-in model shape 'qwen9'"):
        model_config("builtin:qwen9")


def test_host_memory_is_counted_before_allocating():
    adapter = ModelAdapter(model_config("builtin:qwen2.5-7b"), torch.device("cpu"), torch.bfloat16)
    with pytest.raises(HostMemoryError, match=r"needs 11[0-9]\.\d GiB .* optimizer.kind=hybrid8bit"):
        HostStore(adapter.layouts, torch.bfloat16, pin=False, host_limit_bytes=64 * 2**30)
    assert adapter.num_params() == 7_615_616_512


def test_config_errors():
    with pytest.raises(ConfigError, match="training.steps='abc' is not a valid int"):
        load_config(None, ["training.steps=abc"])
    with pytest.raises(ConfigError, match="unknown key"):
        load_config(None, ["training.stepz=3"])
    with pytest.raises(ConfigError, match="must look like section.key=value"):
        load_config(None, ["steps"])
    with pytest.raises(ConfigError, match="optimizer.kind='adam' is not one of fp32, hybrid8bit"):
        load_config(None, ["optimizer.kind=adam"])
    with pytest.raises(ConfigError, match="plan.policy='plan.json' is not one of auto, solved"):
        load_config(None, ["plan.policy=plan.json"])
    with pytest.raises(ConfigError, match="plan.file=p.json and plan.policy=megatrain"):
        load_config(None, ["plan.file=p.json", "plan.policy=megatrain"])
    for key in ("optimizer.lr", "training.max_grad_norm", "optimizer.eps"):
        for value in ("nan", "inf"):
            with pytest.raises(ConfigError, match=f"{key}={value} is not a finite number"):
                load_config(None, [f"{key}={value}"])
    assert load_config(None, []).optimizer.lr == 2e-3  # None: the built-in tiny model's rate
    assert load_config(None, ["model.source=builtin:qwen2.5-7b"]).optimizer.lr == 1e-5
    with pytest.raises(ConfigError, match="fp32_embedding_states applies to optimizer.kind=hybrid8bit"):
        load_config(None, ["optimizer.fp32_embedding_states=true"])
    with pytest.raises(ConfigError, match="state_rounding=stochastic applies to optimizer.kind=hybrid8bit"):
        load_config(None, ["optimizer.state_rounding=stochastic"])
    with pytest.raises(ConfigError, match="optimizer.state_rounding='up' is not one of auto, nearest, stochastic"):
        load_config(None, ["optimizer.kind=hybrid8bit", "optimizer.state_rounding=up"])
    assert load_config(None, []).plan.recompute_blocks == ("mlp", "attention", "mlp_up")
    assert load_config(None, ["plan.recompute_blocks=[attention, mlp_up]"]).plan.recompute_blocks == \
        ("attention", "mlp_up")
    with pytest.raises(ConfigError, match=r"plan.recompute_blocks: \['norm'\] cannot be recomputed; use any of "
                                          "mlp, attention, mlp_up, or"):
        load_config(None, ["plan.recompute_blocks=[mlp, norm]"])
    assert load_config(None, []).plan.offload_window == 1
    assert load_config(None, ["plan.offload_window=3"]).plan.offload_window == 3
    with pytest.raises(ConfigError, match="plan.offload_window must be an integer >= 1"):
        load_config(None, ["plan.offload_window=0"])


def test_state_rounding_auto_rounds_stochastically_when_fine_tuning_loaded_weights(tmp_path):
    """auto (the default): stochastic sqrt(v) codes for weights loaded from a folder, nearest
    codes for a built-in shape trained from its random init and for fp32 states; an explicit
    choice stands."""
    def rounding(*overrides):
        return load_config(None, list(overrides)).state_rounding()

    assert rounding("optimizer.kind=hybrid8bit") == "nearest"  # builtin:tiny, from scratch
    assert rounding("optimizer.kind=hybrid8bit", "model.source=builtin:qwen2.5-7b") == "nearest"
    assert rounding("optimizer.kind=hybrid8bit", f"model.source={tmp_path}") == "stochastic"
    assert rounding(f"model.source={tmp_path}") == "nearest"  # fp32 states are not rounded
    assert rounding("optimizer.kind=hybrid8bit", f"model.source={tmp_path}", "optimizer.state_rounding=nearest") \
        == "nearest"
    assert rounding("optimizer.kind=hybrid8bit", "optimizer.state_rounding=stochastic") == "stochastic"
    from lazytrain.config import OptimizerConfig
    from lazytrain.optim.factory import make_optimizer

    with pytest.raises(ValueError, match="state_rounding=auto depends on the model"):
        make_optimizer(OptimizerConfig(kind="hybrid8bit"), [torch.zeros(4)], [4])
    # the saved config keeps auto: reused with fp32 states, or for another model, it resolves again
    saved = load_config(None, ["optimizer.kind=hybrid8bit", f"model.source={tmp_path}"])
    saved.save(tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml", []).optimizer.state_rounding == "auto"
    assert load_config(tmp_path / "config.yaml", ["optimizer.kind=fp32"]).state_rounding() == "nearest"


def test_yaml_config_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("training:\n  steps: 7\n  batch_size: 4\noptimizer:\n  lr: 0.01\n")
    config = load_config(path, ["training.steps=9"])
    assert (config.training.steps, config.training.batch_size, config.optimizer.lr) == (9, 4, 0.01)


def test_cli_reports_errors_without_traceback(tmp_path, capsys):
    assert main(["train", "model.source=/nonexistent/model", f"training.output_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "Traceback" not in err and "/nonexistent/model" in err


def test_cli_keeps_the_traceback_of_a_bug(tmp_path, monkeypatch):
    """Only a LazyTrainError is a user error; a bug's ValueError is not hidden as one."""
    import lazytrain.train.trainer as trainer_module

    def broken(config):
        raise ValueError("group 3: gradient has 10 elements, master 12")

    monkeypatch.setattr(trainer_module, "build_session", broken)
    with pytest.raises(ValueError, match="gradient has 10 elements"):
        main(["train", "training.steps=1", f"training.output_dir={tmp_path / 'run'}"])


def test_cli_train_writes_an_hf_model_and_metrics(tmp_path):
    out = tmp_path / "run"
    code = main([
        "train", "training.steps=3", "training.batch_size=4", "training.progress=false",
        f"training.output_dir={out}", "data.builtin_train_size=64", "data.heldout_size=4",
    ])
    assert code == 0
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["tokens_per_s"] > 0 and r["tflops_model"] > 0 for r in steps)
    assert "eval_exact_match" in lines[-1]
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert model.config.num_hidden_layers == 2
    assert tokenizer.decode(tokenizer("Q: 1 + 2\nA: ")["input_ids"]) == "Q: 1 + 2\nA: "
    assert (out / "lazytrain_config.yaml").exists() and (out / "lazytrain_template.json").exists()


@pytest.mark.parametrize("device_layers,device_steps", [(0, 0), (1, 0), (0, 1)])
def test_the_embedding_and_head_stepped_on_the_device_train_and_resume_as_on_the_host(tmp_path, monkeypatch,
                                                                                     device_layers, device_steps):
    """plan.const_update=device (and the first layer with them, resident or streamed) through the
    trainer: with a checkpoint every 2 steps and a resume at step 3, the same losses and exported
    weights as the CPU optimizer stepping them."""
    monkeypatch.setenv("LAZYTRAIN_OPTIM_KERNEL", "torch")  # the device path's math on both sides
    common = ["training.batch_size=4", "training.progress=false", "data.builtin_train_size=64",
              "data.heldout_size=2", "optimizer.kind=hybrid8bit", "training.save_every=2"]
    from lazytrain.optim.hybrid8bit import Hybrid8bitAdamW

    placed = []
    to_device = Hybrid8bitAdamW.to_device
    monkeypatch.setattr(Hybrid8bitAdamW, "to_device",
                        lambda self, group, weight: (placed.append(group), to_device(self, group, weight)))
    assert main(["train", "training.steps=6", f"training.output_dir={tmp_path / 'a'}", "plan.const_update=host", *common]) == 0
    assert placed == []
    device = [*common, "plan.const_update=device", f"plan.device_layers={device_layers}",
              f"plan.device_steps={device_steps}"]
    streamed = []
    stream_in = Hybrid8bitAdamW.stream_in
    monkeypatch.setattr(Hybrid8bitAdamW, "stream_in", lambda self, group, weight, scratch: (
        streamed.append(group), stream_in(self, group, weight, scratch)))
    assert main(["train", "training.steps=3", f"training.output_dir={tmp_path / 'b'}", *device]) == 0
    assert main(["train", "training.steps=6", f"training.output_dir={tmp_path / 'b'}", "training.resume=true", *device]) == 0

    def losses(run):
        records = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
        return [json.loads(r)["loss"] for r in records if '"loss"' in r]

    # groups 0 and 3 (the built-in model has 2 layers), placed at the first update and again after
    # each checkpoint brought them home: steps 1 and 3 (saved at 2), resumed: 4 and 5 (saved at 4)
    assert placed == ([0, 1, 3] if device_layers else [0, 3]) * 4
    assert streamed == [1] * 6 * device_steps  # at every update, each step's (3 per run)
    assert losses("b") == losses("a")
    a = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "a")
    b = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "b")
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name


def test_const_update_device_needs_the_8bit_optimizer(tmp_path):
    from lazytrain.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="optimizer.kind=fp32 cannot"):
        load_config(None, [f"training.output_dir={tmp_path}", "plan.const_update=device", "optimizer.kind=fp32"])

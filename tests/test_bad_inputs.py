"""Each bad input of a new user is one message through the CLI (status 2, no traceback)."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import transformers
from conftest import make_hf_model

from lazytrain.cli.main import main

FAST = ["training.steps=1", "training.batch_size=2", "training.progress=false"]


def fails_with(capsys, args: list[str], *fragments: str) -> str:
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("error:") == 1, err
    for fragment in fragments:
        assert fragment in err, err
    return err


def alpaca_file(path, n: int = 3, instruction: str = "Summarise the following paragraph in one sentence.") -> str:
    with path.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"instruction": f"{instruction} ({i})", "input": "The cat sat on the mat " * 8,
                                "output": "A cat sat on a mat."}) + "\n")
    return str(path)


@pytest.mark.parametrize("override,message", [
    ("optimizer.lr=nan", "optimizer.lr=nan is not a finite number"),
    ("optimizer.lr=.inf", "optimizer.lr=inf is not a finite number"),
    ("optimizer.betas=[0.9, .nan]", "optimizer.betas=(0.9, nan) is not a finite number"),
    ("training.max_grad_norm=nan", "training.max_grad_norm=nan is not a finite number"),
    ("training.steps=[5", "override 'training.steps=[5': '[5' is not a valid value"),
    ("memory.gpu_gb=nan", "memory.gpu_gb=nan is not a finite number"),
])
def test_bad_config_values(capsys, tmp_path, override, message):
    fails_with(capsys, ["train", override, f"training.output_dir={tmp_path}"], message)


def test_model_folder_is_checked_before_tokenizer_and_data(capsys, tmp_path):
    data = alpaca_file(tmp_path / "d.jsonl")
    common = [f"data.dataset={data}", f"training.output_dir={tmp_path / 'out'}", *FAST]
    fails_with(capsys, ["train", f"model.source={tmp_path / 'missing'}", *common], "does not exist")
    (tmp_path / "empty").mkdir()
    fails_with(capsys, ["train", f"model.source={tmp_path / 'empty'}", *common], "has no config.json")
    gpt2 = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2)
    gpt2.architectures = ["GPT2LMHeadModel"]
    gpt2.save_pretrained(tmp_path / "gpt2")
    fails_with(capsys, ["train", f"model.source={tmp_path / 'gpt2'}", *common], "'GPT2LMHeadModel' is not supported")
    make_hf_model("qwen2", layers=1).save_pretrained(tmp_path / "cut")
    weights = tmp_path / "cut" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    fails_with(capsys, ["train", f"model.source={tmp_path / 'cut'}", *common],
               f"{weights} is damaged or incomplete", "download or copy it again")


def test_output_dir_that_is_a_file(capsys, tmp_path):
    (tmp_path / "f").write_text("x")
    fails_with(capsys, ["train", f"training.output_dir={tmp_path / 'f'}", *FAST], "is a file; give a folder")


def test_unusable_nvme_dir(capsys, tmp_path):
    (tmp_path / "f").write_text("x")
    fails_with(capsys, ["train", f"memory.nvme_dir={tmp_path / 'f'}", f"training.output_dir={tmp_path / 'o'}",
                        "data.builtin_train_size=8", *FAST], "memory.nvme_dir to a writable folder")


def test_non_utf8_data_names_file_and_line(capsys, tmp_path):
    data = tmp_path / "d.jsonl"
    alpaca_file(data, n=1)
    with data.open("ab") as f:
        f.write(b'{"instruction": "caf\xe9", "output": "x"}\n')
    fails_with(capsys, ["train", f"data.dataset={data}", f"training.output_dir={tmp_path / 'o'}", *FAST],
               f"{data} line 2: not UTF-8", "column 21")


def test_batch_larger_than_the_data(capsys, tmp_path):
    data = alpaca_file(tmp_path / "d.jsonl", n=2)
    fails_with(capsys, ["train", f"data.dataset={data}", f"training.output_dir={tmp_path / 'o'}",
                        "training.batch_size=4", "training.steps=1"],
               "lower training.batch_size to 2 or less")


def test_a_user_jsonl_fits_the_default_max_seq_len(capsys, tmp_path):
    """The alpaca prompt alone is longer than the built-in data's 128; user data defaults to 1024."""
    data = alpaca_file(tmp_path / "d.jsonl", n=4, instruction="Explain step by step what the text says. " * 4)
    assert main(["train", f"data.dataset={data}", f"training.output_dir={tmp_path / 'o'}", *FAST]) == 0
    assert "4/4 samples kept, 0 truncated" in capsys.readouterr().err


def test_inputs_are_checked_before_the_output_folders_state(capsys, tmp_path):
    """After a first run, a retry into the same folder with a wrong model or data path is told
    about the path, not about the earlier run."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    fails_with(capsys, ["train", f"model.source={tmp_path / 'missing'}", f"training.output_dir={out}", *FAST],
               f"model path '{tmp_path / 'missing'}' does not exist")
    fails_with(capsys, ["train", f"data.dataset={tmp_path / 'd.jsonl'}", f"training.output_dir={out}", *FAST],
               f"data file not found: {tmp_path / 'd.jsonl'}")
    fails_with(capsys, ["train", f"training.output_dir={out}", *FAST], "holds an earlier run")


def test_an_output_dir_that_cannot_be_written(capsys, tmp_path):
    (tmp_path / "f").write_text("x")
    fails_with(capsys, ["train", f"training.output_dir={tmp_path / 'f' / 'run'}", *FAST],
               f"cannot be created: {tmp_path / 'f'} is a file")
    if Path("/proc/self").is_dir():  # Linux: a filesystem where no file can be created
        fails_with(capsys, ["train", "training.output_dir=/proc/lazytrain-run", *FAST],
                   "training.output_dir=/proc/lazytrain-run cannot be created (in /proc)", "choose a folder you can write")
    if os.geteuid() != 0:  # root writes whatever the permissions say
        (tmp_path / "locked").mkdir(mode=0o500)
        fails_with(capsys, ["train", f"training.output_dir={tmp_path / 'locked'}", *FAST],
                   "cannot be written: Permission denied")
    assert not list((tmp_path / "f").parent.glob("**/.lazytrain-write-test-*"))


def test_a_diverged_run_without_a_checkpoint_is_not_told_to_resume(capsys, tmp_path):
    err = fails_with(capsys, ["train", f"training.output_dir={tmp_path}", "training.steps=50", "training.batch_size=2",
                              "training.progress=false", "data.builtin_train_size=16", "optimizer.lr=1e30",
                              "optimizer.warmup_steps=0", "training.max_grad_norm=0", "training.max_skipped_steps=2",
                              "training.save_every_minutes=0"],
                     "no checkpoint was written", "optimizer.lr=1e+29", "training.max_grad_norm=1.0",
                     "train again with training.overwrite=true", "no checkpoint to resume from")
    assert "resume from it" not in err and "training.resume=true" not in err


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A model folder as `lazytrain train` writes it (one step of the built-in tiny model)."""
    out = tmp_path_factory.mktemp("trained")
    assert main(["train", f"training.output_dir={out}", "data.builtin_train_size=8", "data.heldout_size=1", *FAST]) == 0
    return out


def test_eval_checks_its_output_path_before_generating(capsys, tmp_path, trained):
    fails_with(capsys, ["eval", f"eval.model={trained}", f"eval.output={tmp_path / 'no' / 'p.jsonl'}"],
               "predictions cannot be written to", "writable eval.output path")


def test_eval_of_a_truncated_model_file_is_one_clear_error(capsys, tmp_path, trained):
    shutil.copytree(trained, tmp_path / "cut")
    weights = tmp_path / "cut" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    fails_with(capsys, ["eval", f"eval.model={tmp_path / 'cut'}"], f"{weights} is damaged or incomplete",
               "download or copy it again")


def test_eval_says_when_the_file_holds_fewer_samples_than_asked(capsys, caplog, tmp_path, trained):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"query": f"What is {i} plus 1?", "response": f"The answer is: {i + 1}"})
                            + "\n" for i in range(3)))
    with caplog.at_level(logging.WARNING, logger="lazytrain.eval.evaluate"):
        assert main(["eval", f"eval.model={trained}", f"eval.data={data}", "eval.num_samples=1000",
                     "eval.max_new_tokens=2", f"eval.output={tmp_path / 'p.jsonl'}"]) == 0
    assert json.loads(capsys.readouterr().out)["n"] == 3
    assert f"eval.num_samples=1000, but {data} holds 3: evaluating all 3" in caplog.text

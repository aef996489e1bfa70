"""The configuration reference comes from the config's own docstrings, and the committed copy
(docs/configuration.md) is the current one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lazytrain.cli.main import main
from lazytrain.cli.reference import REFERENCE_PATH, keys, reference_markdown, section_doc
from lazytrain.config import SECTIONS, load_config

ROOT = Path(__file__).resolve().parents[1]


def test_docs_configuration_md_is_current():
    committed = (ROOT / REFERENCE_PATH).read_text()
    assert committed == reference_markdown(), (
        f"{REFERENCE_PATH} is stale: regenerate it with `lazytrain config --write {REFERENCE_PATH}`")


def test_every_key_and_section_is_documented():
    undocumented = [key for key, _, _, doc in keys() if not doc]
    assert not undocumented, f"fields without a docstring under them in config.py: {undocumented}"
    assert all(section_doc(cls) for cls in SECTIONS.values())
    assert {key.split(".")[0] for key, *_ in keys()} == set(SECTIONS)


def test_the_listed_defaults_are_valid_overrides_giving_the_defaults():
    """What the reference shows after ``section.key=`` can be typed back as it is."""
    overrides = [f"{key}={default}" for key, _, default, _ in keys()]
    assert load_config(None, overrides).to_dict() == load_config().to_dict()


def test_train_help_lists_every_key_and_eval_help_its_own(capsys):
    with pytest.raises(SystemExit) as done:
        main(["train", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    for key, _, default, _ in keys():
        assert f"\n  {key}={default}\n" in out, key
    assert "memory.gpu_gb=null\n      GPU memory cap for the step" in out
    assert f"`lazytrain config` or {REFERENCE_PATH}" in out
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    out = capsys.readouterr().out
    assert "\n  eval.num_samples=200\n" in out and "training.steps" not in out


def test_config_command_prints_and_writes_the_reference_without_torch(tmp_path):
    path = tmp_path / "configuration.md"
    code = ("import sys; from lazytrain.cli.main import main; "
            f"assert main(['config', '--write', {str(path)!r}]) == 0; assert main(['config']) == 0; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert path.read_text() == done.stdout == reference_markdown()


def test_config_write_to_an_unwritable_path(capsys, tmp_path):
    assert main(["config", "--write", str(tmp_path / "missing" / "c.md")]) == 2
    err = capsys.readouterr().err
    assert "reference cannot be written to" in err and "Traceback" not in err

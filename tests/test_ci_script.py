"""`.ci/run` runs the README's two commands in order in its clone (command 1 trains the built-in
default, command 2 runs the tests) and stops at the first part that fails. Checked with stand-ins
for pip, lazytrain and python that record their arguments."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[list[str]]:
    """The parts (split at ``&&``) of each line of the README's first bash block."""
    block = (ROOT / "README.md").read_text().split("```bash\n", 1)[1].split("```", 1)[0]
    lines = [line.split("#", 1)[0].strip() for line in block.splitlines()]
    return [[" ".join(shlex.split(part)) for part in line.split("&&")] for line in lines if line]


def run_ci(tmp_path: Path, fail: str = "") -> tuple[int, list[str]]:
    """.ci/run in a copy of the clone's layout; ``fail``: the recorded call that exits 1."""
    clone = tmp_path / "clone"
    (clone / ".ci").mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / ".ci" / "run", clone / ".ci" / "run")
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir(exist_ok=True)
    for name in ("pip", "lazytrain", "python"):
        stand_in = bin_dir / name
        stand_in.write_text('#!/bin/sh\ncall="$(basename "$0") $*"\necho "$call $(pwd)" >> "$LOG"\n'
                            '[ "$call" != "$FAIL" ]\n')
        stand_in.chmod(0o755)
    done = subprocess.run(["bash", str(clone / ".ci" / "run")], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "LOG": str(log),
                               "FAIL": fail}, check=False)
    calls = log.read_text().splitlines() if log.exists() else []
    for call in calls:
        assert call.endswith(f" {clone}")  # every command ran in the clone
    return done.returncode, [call.removesuffix(f" {clone}") for call in calls]


def test_ci_runs_the_readme_commands_in_order(tmp_path):
    commands = readme_commands()
    assert len(commands) == 2 and commands[0][-1] == "lazytrain train" and commands[1][-1] == "python -m pytest -q"
    code, calls = run_ci(tmp_path)
    assert code == 0 and calls == commands[0] + commands[1]


@pytest.mark.parametrize("fail", ["pip install torch==2.13.0", "lazytrain train", "python -m pytest -q"])
def test_ci_stops_at_the_first_failure(tmp_path, fail):
    expected = [part for command in readme_commands() for part in command]
    code, calls = run_ci(tmp_path, fail)
    assert code != 0 and calls == expected[: expected.index(fail) + 1]


def test_ci_refuses_a_clone_that_already_holds_the_default_run(tmp_path):
    (tmp_path / "clone" / "runs" / "default").mkdir(parents=True)
    code, calls = run_ci(tmp_path)
    assert code == 2 and calls == []

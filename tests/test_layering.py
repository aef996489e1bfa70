"""The parts keep to their places in DESIGN.md: plan/ imports no torch, and nothing below the
trainer and the CLI imports them."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "lazytrain"
TOP = ("train", "cli")


def imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_nothing_below_train_and_cli_imports_them():
    offenders = []
    for path in SRC.rglob("*.py"):
        part = path.relative_to(SRC).parts[0]
        if part in TOP:
            continue
        for name in imports(path):
            if any(name == f"lazytrain.{top}" or name.startswith(f"lazytrain.{top}.") for top in TOP):
                offenders.append(f"{path.relative_to(SRC)} imports {name}")
    assert not offenders, offenders


def test_plan_imports_no_torch():
    for path in (SRC / "plan").rglob("*.py"):
        assert not any(n == "torch" or n.startswith("torch.") for n in imports(path)), path
    # and importing it (with everything it pulls in) loads no torch either
    code = "import sys, lazytrain.plan; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def upward_imports(part: str, below: str) -> list[str]:
    """Imports of ``lazytrain.<below>`` in ``part`` (a folder or a module under src/lazytrain)."""
    path = SRC / part
    files = sorted(path.rglob("*.py")) if path.is_dir() else [path.with_suffix(".py")]
    return [f"{f.relative_to(SRC)} imports {name}" for f in files for name in imports(f)
            if name == f"lazytrain.{below}" or name.startswith(f"lazytrain.{below}.")]


def test_model_imports_nothing_from_memory():
    """The host store is built from the model's layouts (memory/ sits above model/): loading and
    building take a storage protocol, and the caller picks the store."""
    assert not upward_imports("model", "memory")


def test_config_imports_nothing_from_optim_and_no_torch():
    """The config is the bottom layer: the optimizers take its hyperparameters, not the reverse,
    and reading a config (``lazytrain config``, ``--help``) loads no torch."""
    assert not upward_imports("config", "optim")
    code = "import sys, lazytrain.config; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


FRONT_DOOR = {"lazytrain.plan.planner": None, "lazytrain.plan.plan": {"Plan"}}
"""What the trainer, the session and ``lazytrain plan`` may import from plan/: the planner (its
module is the front door) and `Plan` (None: any name)."""


def runtime_imports(path: Path) -> list[tuple[str, set[str]]]:
    """(module, names) of each import that runs (those under ``if TYPE_CHECKING:`` are types only)."""
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and getattr(node.test, "id", None) == "TYPE_CHECKING" for n in ast.walk(node)}
    found = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found += [(alias.name, set()) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.append((node.module, {alias.name for alias in node.names}))
    return found


def test_the_trainer_and_the_session_plan_through_the_planner_alone():
    offenders = []
    for name in ("train/trainer.py", "train/session.py", "train/plan_ahead.py"):
        for module, names in runtime_imports(SRC / name):
            if module != "lazytrain.plan" and not module.startswith("lazytrain.plan."):
                continue
            allowed = FRONT_DOOR.get(module, set())
            if module not in FRONT_DOOR or (allowed is not None and not names <= allowed):
                offenders.append(f"{name} imports {sorted(names) or module} from {module}")
    assert not offenders, offenders

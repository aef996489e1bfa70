"""The README and docs/ stay usable: the README is short and starts with the commands CI runs,
every relative link resolves (file and #anchor), every record and script the pages cite exists,
and every page under docs/ is reachable from the README."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
NOTES = sorted((ROOT / "bench" / "results").glob("*_notes.md"))  # study reports the docs link

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
RESULT = re.compile(r"bench/results/[\w.+\-*]+")
SCRIPT = re.compile(r"\b(?:bench|tests|src/lazytrain)/[\w/]+\.(?:py|sh)\b")
PLACEHOLDER = re.compile(r"\b[A-Z]{3,}\b")  # bench/NAME.py, python -m bench.NAME
MODULE = re.compile(r"python -m (bench(?:\.\w+)+)")
FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)

FIRST_LINES = [
    "# LazyTrain",
    "",
    "```bash",
    ("pip install torch==2.13.0 && pip install -e . && lazytrain train          "
     "# train the built-in default (tiny model, built-in data; CPU or GPU)"),
    ("pip install torch==2.13.0 && pip install -e '.[test]' && python -m pytest -q   "
     "# run the tests (what .ci/run does)"),
    "```",
]


def anchors(page: Path) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces to '-'."""
    headings = re.findall(r"^#+\s+(.+)$", FENCE.sub("", page.read_text()), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_readme_is_short_and_starts_with_the_commands_ci_runs():
    lines = README.read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; move details to docs/"
    assert lines[: len(FIRST_LINES)] == FIRST_LINES
    # .ci/run runs both commands in order, each part (`a && b`) a line of its own
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    parts = [part.strip() for line in FIRST_LINES[3:5] for part in line.split("  #")[0].split("&&")]
    run = [line for line in ci if line and not line.startswith("#")]
    assert run[-len(parts):] == parts, (run, parts)
    for n, line in enumerate(FIRST_LINES[3:5], 1):
        assert f"# command {n}: {line.split('  #')[0].strip()}" in ci


def test_links_resolve():
    broken = []
    for page in PAGES + NOTES:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target):  # http(s), mailto: not checked here
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_cited_records_and_scripts_exist():
    missing = []
    for page in PAGES:
        text = page.read_text()
        for cited in RESULT.findall(text) + SCRIPT.findall(text):
            if not PLACEHOLDER.search(cited) and not any(ROOT.glob(cited.rstrip("."))):
                missing.append(f"{page.name}: {cited}")
        for script in re.findall(r"python (bench/[\w/]+\.py)", text):  # bench is not installed:
            if re.search(r"^\s*(from|import) bench\b", (ROOT / script).read_text(), re.MULTILINE):
                missing.append(f"{page.name}: python {script} (imports bench: run it as python -m)")
        for module in MODULE.findall(text):
            if not PLACEHOLDER.search(module) and not (ROOT / (module.replace(".", "/") + ".py")).exists():
                missing.append(f"{page.name}: python -m {module}")
    assert not missing, "\n".join(missing)


def test_every_cited_record_is_indexed_in_docs_benchmarks():
    """docs/benchmarks.md names the study of every record the README and docs cite (the record,
    or its report: the same name with another extension)."""
    index = (ROOT / "docs" / "benchmarks.md").read_text()
    unindexed = sorted({f"{page.name}: {cited}" for page in PAGES for cited in RESULT.findall(page.read_text())
                        if "*" not in cited and Path(cited.rstrip(".")).stem not in index})
    assert not unindexed, "\n".join(unindexed)


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(README.parent / t.partition("#")[0]).resolve() for t in LINK.findall(README.read_text())}
    orphans = [p.name for p in PAGES[1:] if p.resolve() not in linked]
    assert not orphans, f"docs pages the README does not link: {orphans}"


def test_the_readme_config_example_loads(tmp_path):
    """The README's YAML example is a valid config, with the values it shows."""
    from lazytrain.config import load_config

    (example,) = re.findall(r"^```yaml\n(.*?)^```", README.read_text(), re.DOTALL | re.MULTILINE)
    path = tmp_path / "my.yaml"
    path.write_text(example)
    config = load_config(path, ["training.steps=200"])
    assert config.optimizer.kind == "hybrid8bit" and config.data.packing and config.training.steps == 200


def test_the_plan_headline_table_is_generated_from_compute_only_rows(tmp_path):
    """The README's plan block lists each run as trained (skipped-update runs left out) with its
    prediction's error and its step against compute-only; bench/readme_table.py --check (in
    tests/test_peers.py) keeps the README's copy equal to what the committed rows give."""
    from bench import readme_table

    def row(name: str, update: str, k: int, step: float, predicted: float, replanned: bool | None) -> dict:
        return {"name": name, "process": 1, "update": update, "device_layers": k, "replanned": replanned,
                "tokens_per_s": 12000.0, "tflops_6nt": 550.0, "step_time_s": step, "step_min_s": step,
                "step_max_s": step, "predicted_step_time_s": predicted, "step_over_compute_only": step / 5.0}

    path = tmp_path / "plan_x_compute_only.json"
    path.write_text(json.dumps([row("m_dlauto_recal4", "cpu", 4, 5.5, 5.39, True), row("m_dl6", "cpu", 6, 5.0, 5.1, False),
                                row("m_update-skipped_dlauto", "skipped", 0, 4.0, 4.0, None)]))
    block = readme_table.plan_table([path])
    assert "| plan_x | 1 | auto: 4 (re-planned) | 12,000 | 550.0 | 5.50 (5.50-5.50) | 5.39 (-2.0%) | 1.100x |" in block
    assert "| 6 | " in block and "| 0 |" not in block  # the skipped-update run is not a run as trained
    assert "2 runs: step / compute-only median 1.050x (1.000-1.100x); predicted step time -2.0% to +2.0%" in block
    text = README.read_text()
    assert text.count(readme_table.PLAN_START) == 1 and text.count(readme_table.START) == 1

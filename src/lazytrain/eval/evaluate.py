"""Exact-match evaluation of a saved model on MetaMathQA-style data.

Prompts are rendered with the template saved beside the model (the one training used),
answers are generated greedily, extracted after "The answer is:" (or "####") and compared
numerically with the gold answer. Writes predictions to JSONL and returns the report.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from tqdm import tqdm

from lazytrain.data.dataset import encode_prompts
from lazytrain.data.formats import DataError, DataSource, Sample, load_samples
from lazytrain.data.synthetic import make_samples
from lazytrain.data.template import PromptTemplate, get_template
from lazytrain.errors import LazyTrainError
from lazytrain.eval.answers import exact_match_report
from lazytrain.eval.generate import cut_at_stop, generate_resident, generate_streamed

log = logging.getLogger(__name__)


class EvalError(LazyTrainError, ValueError):
    """A model folder or output path that evaluation cannot use."""


def _check_output(out_path: Path) -> None:
    """Fail before generating (minutes on a large model) if the predictions cannot be written."""
    if out_path.is_dir():
        raise EvalError(f"--output {out_path} is a folder; give a file path (e.g. {out_path / 'predictions.jsonl'})")
    try:
        with out_path.open("a"):
            pass
    except OSError as e:
        raise EvalError(f"predictions cannot be written to {out_path} ({e.strerror}); pass a writable "
                        "--output path") from None


@dataclass(kw_only=True, slots=True)
class EvalConfig:
    model: str
    """A model folder written by ``lazytrain train`` or ``export`` (or any HF folder)."""
    data: str = "builtin"
    """``builtin`` (the held-out split of the built-in data) or a local file."""
    format: str = "auto"
    builtin_tier: str = "add2"
    num_samples: int = 200
    """Samples to evaluate (the first N of the file; N held-out problems for builtin)."""
    seed: int = 0
    max_new_tokens: int = 64
    batch_size: int = 64
    device: str = "auto"
    mode: str = "auto"
    """auto (resident when the model fits in 90% of free GPU memory), resident, streamed."""
    template: str = "saved"
    """saved (the template stored with the model), or a built-in template name."""
    output: str | None = None
    """Predictions JSONL (default: MODEL/eval_predictions.jsonl)."""
    stop: tuple[str, ...] = ("\n\n\n", "### Instruction", "\nQ: ")
    """Generation is cut at the first of these strings (and at the tokenizer's eos)."""

    def __post_init__(self) -> None:
        if self.mode not in ("auto", "resident", "streamed"):
            raise ValueError(f"eval mode must be auto, resident or streamed, got {self.mode!r}")
        if self.num_samples < 1 or self.batch_size < 1 or self.max_new_tokens < 1:
            raise ValueError("eval num_samples, batch_size and max_new_tokens must be >= 1")


def _samples(cfg: EvalConfig) -> list[Sample]:
    if cfg.data == "builtin":
        return make_samples("heldout", cfg.num_samples, seed=cfg.seed, tier=cfg.builtin_tier)
    samples = load_samples(DataSource(path=cfg.data, format=cfg.format, limit=cfg.num_samples))
    if not samples:
        raise DataError(f"{cfg.data}: no samples to evaluate")
    return samples


def _fits_on_device(folder: Path, device: torch.device) -> bool:
    if device.type != "cuda":
        return True
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    free, _ = torch.cuda.mem_get_info(device)
    return size * 1.2 < free * 0.9


def exact_match(samples: list[Sample], tokenizer, template: PromptTemplate, run, batch_size: int,
                desc: str = "eval", stop: tuple[str, ...] = ()) -> tuple[dict, list[str]]:
    """Generate for every sample with ``run(list of prompt ids) -> list of new ids``, score."""
    prompts = encode_prompts(samples, tokenizer, template)
    # similar lengths in each batch keep padding low; outputs go back in sample order
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    outputs: list[str] = [""] * len(prompts)
    for start in tqdm(range(0, len(order), batch_size), desc=desc, leave=False):
        idx = order[start : start + batch_size]
        for i, tokens in zip(idx, run([prompts[i] for i in idx])):
            outputs[i] = cut_at_stop(tokenizer.decode(tokens, skip_special_tokens=True), stop)
    report = exact_match_report(outputs, [s.response for s in samples], [s.type for s in samples])
    return report, outputs


def evaluate(cfg: EvalConfig) -> dict:
    folder = Path(cfg.model).expanduser()
    if not (folder / "config.json").exists():
        raise EvalError(f"{folder} is not a model folder (no config.json); pass the output_dir of a training run")
    out_path = Path(cfg.output) if cfg.output else folder / "eval_predictions.jsonl"
    _check_output(out_path)
    device = torch.device("cuda" if cfg.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if cfg.device == "auto" else cfg.device))
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    template = PromptTemplate.load(folder) if cfg.template == "saved" else get_template(cfg.template)
    samples = _samples(cfg)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos_id = tokenizer.eos_token_id
    mode = cfg.mode
    if mode == "auto":
        mode = "resident" if _fits_on_device(folder, device) else "streamed"
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if mode == "resident":
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
        run = lambda batch: generate_resident(model, batch, cfg.max_new_tokens, pad_id, eos_id)
    else:
        from lazytrain.model.build import build_model

        adapter, store = build_model(str(folder), device, dtype)
        run = lambda batch: generate_streamed(adapter, store, batch, cfg.max_new_tokens, pad_id, eos_id)
    report, outputs = exact_match(samples, tokenizer, template, run, cfg.batch_size, f"eval ({mode})",
                                  cfg.stop)
    report["mode"] = mode
    with out_path.open("w") as f:
        for s, out in zip(samples, outputs):
            f.write(json.dumps({"query": s.instruction, "gold": s.response, "prediction": out,
                                "type": s.type}) + "\n")
    report["predictions"] = str(out_path)
    return report

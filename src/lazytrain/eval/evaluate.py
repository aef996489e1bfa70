"""Exact-match evaluation of a saved model on MetaMathQA-style data.

Prompts are rendered with the template saved beside the model (the one training used),
answers are generated greedily, extracted after "The answer is:" (or "####") and compared
numerically with the gold answer. Writes predictions to JSONL and returns the report.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
import transformers
from tqdm import tqdm

from lazytrain.config import EvalConfig
from lazytrain.data.dataset import encode_prompts
from lazytrain.data.formats import DataError, DataSource, Sample, load_samples
from lazytrain.data.pipeline import load_tokenizer
from lazytrain.data.synthetic import make_samples
from lazytrain.data.template import PromptTemplate, get_template
from lazytrain.errors import LazyTrainError
from lazytrain.eval.answers import exact_match_report
from lazytrain.eval.generate import cut_at_stop, generate_resident, generate_streamed
from lazytrain.model.loading import check_weight_files
from lazytrain.runtime.device import resolve_device, resolve_dtype

log = logging.getLogger(__name__)


class EvalError(LazyTrainError, ValueError):
    """A model folder or output path that evaluation cannot use."""


def _check_output(out_path: Path) -> None:
    """Fail before generating (minutes on a large model) if the predictions cannot be written."""
    if out_path.is_dir():
        raise EvalError(f"eval.output={out_path} is a folder; give a file path (e.g. {out_path / 'predictions.jsonl'})")
    try:
        with out_path.open("a"):
            pass
    except OSError as e:
        raise EvalError(f"predictions cannot be written to {out_path} ({e.strerror}); pass a writable "
                        "eval.output path") from None


def _samples(cfg: EvalConfig) -> list[Sample]:
    if cfg.data == "builtin":
        samples = make_samples("heldout", cfg.num_samples, seed=cfg.seed, tier=cfg.builtin_tier)
    else:
        samples = load_samples(DataSource(path=cfg.data, format=cfg.format, limit=cfg.num_samples))
    if not samples:
        raise DataError(f"{cfg.data}: no samples to evaluate")
    if len(samples) < cfg.num_samples:
        log.warning("eval.num_samples=%d, but %s holds %d: evaluating all %d", cfg.num_samples,
                    cfg.data if cfg.data != "builtin" else f"the built-in tier {cfg.builtin_tier}",
                    len(samples), len(samples))
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


def streamed_exact_match(adapter, store, tokenizer, template: PromptTemplate, samples: list[Sample],
                         max_new_tokens: int = 64, batch_size: int = 100) -> dict:
    """Exact match of the model in a host store (generation streams it layer by layer)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def run(batch):
        return generate_streamed(adapter, store, batch, max_new_tokens, pad, tokenizer.eos_token_id)

    report, _ = exact_match(samples, tokenizer, template, run, batch_size=batch_size, desc="eval")
    return report


def evaluate(cfg: EvalConfig) -> dict:
    folder = Path(cfg.model).expanduser()
    if not (folder / "config.json").exists():
        raise EvalError(
            f"eval.model={folder} is not a model folder (no config.json); pass the output_dir of a "
            "training run"
        )
    check_weight_files(folder)  # a damaged download fails here, as in train, not deep in loading
    tokenizer = load_tokenizer(str(folder))
    template = PromptTemplate.load(folder) if cfg.template == "saved" else get_template(cfg.template)
    samples = _samples(cfg)
    out_path = Path(cfg.output) if cfg.output else folder / "eval_predictions.jsonl"
    _check_output(out_path)  # the inputs first (as train does), then where the predictions go
    device = resolve_device(cfg.device)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos_id = tokenizer.eos_token_id
    mode = cfg.mode
    if mode == "auto":
        mode = "resident" if _fits_on_device(folder, device) else "streamed"
    dtype = resolve_dtype("auto", device)
    if mode == "resident":
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
        run = lambda batch: generate_resident(model, batch, cfg.max_new_tokens, pad_id, eos_id)
    else:
        from lazytrain.memory.host_store import HostStore
        from lazytrain.model.build import build_model

        adapter, store = build_model(str(folder), device, dtype, store_factory=HostStore)
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

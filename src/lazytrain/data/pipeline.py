"""From the ``data`` config section to batches: tokenizer, prompt template, samples, batches."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from lazytrain.data.dataset import BatchConfig, BatchIterator, TokenizeReport, tokenize_samples
from lazytrain.data.formats import DataError, DataSource, Sample, load_samples
from lazytrain.data.synthetic import make_samples
from lazytrain.data.template import PromptTemplate, get_template
from lazytrain.data.tokenizer import builtin_tokenizer

if TYPE_CHECKING:
    from lazytrain.config import DataConfig

log = logging.getLogger(__name__)


def load_tokenizer(source: str):
    """The built-in byte tokenizer for ``builtin:`` shapes, else the model folder's own."""
    if source.startswith("builtin:"):
        return builtin_tokenizer()
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as e:
        raise DataError(
            f"no tokenizer could be loaded from {source}: {e}; the model folder needs the "
            "tokenizer files saved with the model (tokenizer.json or vocab + merges)"
        ) from None


def resolve_template(config: DataConfig) -> PromptTemplate:
    """``auto``: compact for the built-in data, alpaca for user data."""
    name = config.template
    if name == "auto":
        name = "compact" if config.dataset == "builtin" else "alpaca"
    return get_template(name)


def heldout_samples(config: DataConfig, seed: int) -> list[Sample]:
    """The built-in held-out split (problems the training split never contains)."""
    return make_samples("heldout", config.heldout_size, seed=seed, tier=config.builtin_tier,
                        length_mix=config.builtin_length_mix)


def training_batches(config: DataConfig, tokenizer, template: PromptTemplate, *, batch_size: int, seed: int,
                     pad_to_multiple_of: int = 1) -> tuple[BatchIterator, TokenizeReport]:
    """The resumable batch stream of the training data (length-grouped, or packed with
    ``data.packing``), and what tokenizing it dropped."""
    if config.dataset == "builtin":
        samples = make_samples("train", config.builtin_train_size, seed=seed, tier=config.builtin_tier,
                               length_mix=config.builtin_length_mix)
    else:
        samples = load_samples(DataSource(path=config.dataset, format=config.format,
                                          prompt_field=config.prompt_field,
                                          response_field=config.response_field))
    dataset = tokenize_samples(samples, tokenizer, template, config.max_seq_len)
    log.info("data: %s", dataset.report.summary())
    batches = BatchIterator(dataset=dataset, config=BatchConfig(
        batch_size=batch_size, seed=seed, drop_last=True, pad_to_multiple_of=pad_to_multiple_of,
        packing=config.packing))
    return batches, dataset.report

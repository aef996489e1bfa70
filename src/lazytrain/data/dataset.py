"""Tokenization with loss masks, and length-grouped or packed batches that resume exactly.

A sample becomes ``prompt ids + response ids + eos``. Its ``labels`` are the same ids with
every prompt position set to ``IGNORE_INDEX``, not yet shifted: the loss at position ``t``
predicts ``labels[t + 1]``, so the targets of a batch are ``labels[:, 1:] != IGNORE_INDEX``.

Packed batches (``BatchConfig.packing``) hold several samples per row of exactly
``max_seq_len`` tokens, padding only at the row's end. Each token carries its sample's
``document_ids`` (1, 2, ... within the row; 0 is padding), which the model turns into
block-diagonal causal attention, and ``position_ids`` that restart at 0 for every sample. A
sample's first label is ``IGNORE_INDEX`` (nothing of its own precedes it), so every sample has
exactly the targets it has unpacked, and no target is predicted across samples.
"""

from __future__ import annotations

import bisect
import random
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedTokenizerBase

from lazytrain.data.formats import DataError, Sample
from lazytrain.data.template import PromptTemplate

IGNORE_INDEX = -100


def encode_prompts(samples: list[Sample], tokenizer: PreTrainedTokenizerBase,
                   template: PromptTemplate) -> list[list[int]]:
    """Prompt ids of each sample, exactly as training conditions on them (use it in eval)."""
    texts = [template.render(sample, tokenizer) for sample in samples]
    return tokenizer(texts, add_special_tokens=template.add_special_tokens)["input_ids"]


@dataclass(kw_only=True, slots=True)
class TokenizeReport:
    """What tokenization did to the samples, for the run log."""

    samples: int
    """Samples given."""
    kept: int
    truncated: int
    """Kept samples cut to ``max_seq_len`` (their end, response and eos, is lost)."""
    dropped: int
    """Samples dropped because truncation left them no target token."""
    tokens: int
    """Tokens of the kept samples, after truncation."""
    target_tokens: int
    """Tokens of the kept samples that the loss is computed on."""
    longest: int
    """Longest sample before truncation, in tokens."""
    max_seq_len: int

    def summary(self) -> str:
        return (f"{self.kept}/{self.samples} samples kept, {self.truncated} truncated and "
                f"{self.dropped} dropped at max_seq_len={self.max_seq_len} (longest "
                f"{self.longest}); {self.tokens} tokens, {self.target_tokens} targets")


@dataclass(kw_only=True, slots=True)
class TokenizedDataset:
    input_ids: list[list[int]]
    labels: list[list[int]]
    """``input_ids`` with prompt positions set to ``IGNORE_INDEX`` (not shifted)."""
    pad_id: int
    max_seq_len: int
    report: TokenizeReport

    def __len__(self) -> int:
        return len(self.input_ids)


def tokenize_samples(samples: list[Sample], tokenizer: PreTrainedTokenizerBase,
                     template: PromptTemplate, max_seq_len: int) -> TokenizedDataset:
    """Tokenize, mask prompts and truncate to ``max_seq_len``; raise `DataError` if none is left."""
    if max_seq_len < 2:
        raise DataError(f"max_seq_len must be >= 2 (a token and its target), got {max_seq_len}")
    if not samples:
        raise DataError("no samples to tokenize; check the data source")
    eos_id = tokenizer.eos_token_id
    if eos_id is None:
        raise DataError(f"tokenizer {type(tokenizer).__name__} has no eos token, so the model "
                        "could not learn to stop; set tokenizer.eos_token")
    # Padding is masked out of attention and loss, so any id does when there is no pad token.
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    prompts = encode_prompts(samples, tokenizer, template)
    responses = tokenizer([s.response for s in samples], add_special_tokens=False)["input_ids"]

    all_ids, all_labels = [], []
    truncated = dropped = longest = target_tokens = 0
    for prompt, response in zip(prompts, responses, strict=True):
        ids = [*prompt, *response, eos_id]
        labels = [IGNORE_INDEX] * len(prompt) + [*response, eos_id]
        longest = max(longest, len(ids))
        cut = len(ids) > max_seq_len
        ids, labels = ids[:max_seq_len], labels[:max_seq_len]
        # Position 0 is never a target (nothing precedes it), prompt positions are masked.
        targets = len(ids) - max(len(prompt), 1)
        if targets <= 0:
            dropped += 1
            continue
        truncated += cut
        target_tokens += targets
        all_ids.append(ids)
        all_labels.append(labels)

    report = TokenizeReport(
        samples=len(samples), kept=len(all_ids), truncated=truncated, dropped=dropped,
        tokens=sum(map(len, all_ids)), target_tokens=target_tokens, longest=longest,
        max_seq_len=max_seq_len,
    )
    if not all_ids:
        raise DataError(f"all {len(samples)} samples lost their targets to truncation at "
                        f"max_seq_len={max_seq_len} (longest sample {longest} tokens); raise "
                        "max_seq_len or use a shorter prompt template")
    return TokenizedDataset(input_ids=all_ids, labels=all_labels, pad_id=pad_id,
                            max_seq_len=max_seq_len, report=report)


@dataclass(kw_only=True, slots=True)
class Batch:
    input_ids: torch.Tensor
    """[B, S] token ids, right-padded with the pad id."""
    labels: torch.Tensor
    """[B, S] target ids, not shifted; ``IGNORE_INDEX`` at prompt and padding positions."""
    attention_mask: torch.Tensor
    """[B, S] 1 for real tokens, 0 for padding."""
    num_tokens: int
    """Real (non-pad) tokens."""
    num_target_tokens: int
    """Tokens the loss is computed on: ``(labels[:, 1:] != IGNORE_INDEX).sum()``."""
    indices: tuple[int, ...] | tuple[tuple[int, ...], ...]
    """Positions of the rows' samples in the `TokenizedDataset` (packed: per row, the tuple of
    its samples in order)."""
    position_ids: torch.Tensor | None = None
    """Packed: [B, S] positions, restarting at 0 for each sample (0 on padding). None: each row
    is one sample starting at position 0."""
    document_ids: torch.Tensor | None = None
    """Packed: [B, S] the sample of each token within its row (1, 2, ...; 0 on padding);
    attention never crosses samples. None: one sample per row."""

    @property
    def num_slots(self) -> int:
        """Token slots, padding included."""
        return self.input_ids.numel()


def collate(dataset: TokenizedDataset, indices: list[int], pad_to_multiple_of: int = 1) -> Batch:
    """Right-pad the samples at ``indices`` to the longest of them (rounded up to
    ``pad_to_multiple_of``, but never past ``max_seq_len``)."""
    longest = max(len(dataset.input_ids[i]) for i in indices)
    rounded = -(-longest // pad_to_multiple_of) * pad_to_multiple_of
    width = max(longest, min(rounded, dataset.max_seq_len))
    input_ids = torch.full((len(indices), width), dataset.pad_id, dtype=torch.long)
    labels = torch.full((len(indices), width), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(indices), width), dtype=torch.long)
    for row, i in enumerate(indices):
        n = len(dataset.input_ids[i])
        input_ids[row, :n] = torch.tensor(dataset.input_ids[i])
        labels[row, :n] = torch.tensor(dataset.labels[i])
        attention_mask[row, :n] = 1
    return Batch(
        input_ids=input_ids, labels=labels, attention_mask=attention_mask,
        num_tokens=int(attention_mask.sum()),
        num_target_tokens=int((labels[:, 1:] != IGNORE_INDEX).sum()),
        indices=tuple(indices),
    )


def collate_packed(dataset: TokenizedDataset, rows: list[tuple[int, ...]]) -> Batch:
    """Rows of ``max_seq_len`` tokens, each the samples of one ``rows`` entry end to end."""
    width = dataset.max_seq_len
    input_ids = torch.full((len(rows), width), dataset.pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    position_ids = torch.zeros((len(rows), width), dtype=torch.long)
    document_ids = torch.zeros((len(rows), width), dtype=torch.long)
    for row, samples in enumerate(rows):
        start = 0
        for document, i in enumerate(samples, 1):
            n = len(dataset.input_ids[i])
            end = start + n
            input_ids[row, start:end] = torch.tensor(dataset.input_ids[i])
            labels[row, start:end] = torch.tensor(dataset.labels[i])
            # predicted from the previous sample's last token: never a target (as unpacked,
            # where nothing precedes position 0)
            labels[row, start] = IGNORE_INDEX
            position_ids[row, start:end] = torch.arange(n)
            document_ids[row, start:end] = document
            start = end
    attention_mask = (document_ids != 0).long()
    return Batch(
        input_ids=input_ids, labels=labels, attention_mask=attention_mask,
        num_tokens=int(attention_mask.sum()),
        num_target_tokens=int((labels[:, 1:] != IGNORE_INDEX).sum()),
        indices=tuple(rows), position_ids=position_ids, document_ids=document_ids,
    )


def pack_rows(order: list[int], lengths: list[int], width: int) -> list[tuple[int, ...]]:
    """Best fit: each sample of ``order`` in turn goes into the open row it fills most tightly,
    or a new row; the rows in the order they were opened. Deterministic."""
    rows: list[list[int]] = []
    open_rows: list[tuple[int, int]] = []  # (room left, row), sorted
    shortest = min(lengths[i] for i in order)
    for i in order:
        n = lengths[i]
        k = bisect.bisect_left(open_rows, (n, -1))
        if k < len(open_rows):
            room, row = open_rows.pop(k)
        else:
            room, row = width, len(rows)
            rows.append([])
        rows[row].append(i)
        if room - n >= shortest:  # a row no sample fits in is closed
            bisect.insort(open_rows, (room - n, row))
    return [tuple(row) for row in rows]


@dataclass(kw_only=True, slots=True)
class BatchConfig:
    batch_size: int
    """Samples per batch (the last batch of an epoch may be smaller unless drop_last)."""
    seed: int = 0
    """Seeds the per-epoch shuffle."""
    group_by_length: bool = True
    """Batch samples of similar length together, to cut padding (unpacked batches only)."""
    packing: bool = False
    """Pack samples into rows of the dataset's ``max_seq_len`` (`collate_packed`); a batch is
    ``batch_size`` rows."""
    mega_batch_factor: int = 64
    """Length grouping sorts within windows of ``mega_batch_factor * batch_size`` shuffled
    samples, so batches stay random across windows."""
    pad_to_multiple_of: int = 1
    """Pad each batch's length up to a multiple of this (8 suits tensor cores)."""
    drop_last: bool = False
    """Drop each epoch's last batch when it is smaller than batch_size."""

    def __post_init__(self) -> None:
        if self.packing and not self.drop_last:
            raise DataError("packed batches keep one shape (batch_size rows of max_seq_len): "
                            "packing needs drop_last")
        if self.batch_size < 1:
            raise DataError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.mega_batch_factor < 1:
            raise DataError(f"mega_batch_factor must be >= 1, got {self.mega_batch_factor}")
        if self.pad_to_multiple_of < 1:
            raise DataError(f"pad_to_multiple_of must be >= 1, got {self.pad_to_multiple_of}")


@dataclass(slots=True)
class BatchIterator:
    """Endless batches, epoch after epoch, each epoch a new deterministic order (packed: a
    new deterministic packing of a new order).

    ``state_dict()`` is the position (epoch, next batch, seed); after ``load_state_dict`` the
    iterator yields exactly the batches an uninterrupted run would have yielded next.
    """

    dataset: TokenizedDataset
    config: BatchConfig
    epoch: int = 0
    index: int = 0
    """Index of the next batch within the epoch."""
    seed: int = field(init=False)
    """The shuffle seed: ``config.seed``, or the one restored by `load_state_dict`."""
    _order: tuple[int, list[list]] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.seed = self.config.seed
        n, batch_size = len(self.dataset), self.config.batch_size
        if n == 0:
            raise DataError("the dataset has no samples; check the data source and max_seq_len")
        if self.config.drop_last and n < batch_size:
            raise DataError(f"the dataset has {n} samples (after truncation), fewer than "
                            f"batch_size={batch_size}, and every batch must be full: lower "
                            f"training.batch_size to {n} or less, or add samples")
        if self.config.packing:
            self._check_packed_epoch(self.epoch)

    def _check_packed_epoch(self, epoch: int) -> None:
        if not self.epoch_batches(epoch):
            rows = len(self.packed_rows(epoch))
            raise DataError(f"packing the {len(self.dataset)} samples into rows of "
                            f"max_seq_len={self.dataset.max_seq_len} tokens gives {rows} rows, fewer "
                            f"than batch_size={self.config.batch_size}, and every batch must be full: "
                            f"lower training.batch_size to {rows} or less, or add samples")

    @property
    def batches_per_epoch(self) -> int:
        """Batches of the current epoch (packed, the count may differ a little between epochs)."""
        if self.config.packing:
            return len(self.epoch_batches(self.epoch))
        n, batch_size = len(self.dataset), self.config.batch_size
        return n // batch_size if self.config.drop_last else -(-n // batch_size)

    def packed_rows(self, epoch: int) -> list[tuple[int, ...]]:
        """The packed rows of ``epoch``: the epoch's shuffled order, best-fit packed, the rows
        shuffled again (so the last, least full rows are not all at the epoch's end)."""
        rng = random.Random(f"lazytrain-packed|{self.seed}|{epoch}")
        order = list(range(len(self.dataset)))
        rng.shuffle(order)
        rows = pack_rows(order, [len(ids) for ids in self.dataset.input_ids], self.dataset.max_seq_len)
        rng.shuffle(rows)
        return rows

    def epoch_batches(self, epoch: int) -> list[list]:
        """Every batch of ``epoch``, in order: its sample indices, or packed its rows (each a
        tuple of sample indices)."""
        if self._order is not None and self._order[0] == epoch:
            return self._order[1]
        config = self.config
        if config.packing:
            rows = self.packed_rows(epoch)
            batches = [rows[start:start + config.batch_size]
                       for start in range(0, len(rows) - config.batch_size + 1, config.batch_size)]
            self._order = (epoch, batches)
            return batches
        rng = random.Random(f"lazytrain-batches|{self.seed}|{epoch}")
        order = list(range(len(self.dataset)))
        rng.shuffle(order)
        lengths = [len(ids) for ids in self.dataset.input_ids]
        if config.group_by_length:
            window = config.mega_batch_factor * config.batch_size
            order = [i for start in range(0, len(order), window)
                     for i in sorted(order[start:start + window], key=lambda i: -lengths[i])]
        batches = [order[start:start + config.batch_size]
                   for start in range(0, len(order), config.batch_size)]
        if config.drop_last and len(batches[-1]) < config.batch_size:
            batches.pop()
        if config.group_by_length:
            rng.shuffle(batches)
            # The longest batch goes first, so a batch that does not fit in memory fails the
            # first step rather than one hours in.
            longest = max(range(len(batches)), key=lambda b: max(lengths[i] for i in batches[b]))
            batches.insert(0, batches.pop(longest))
        self._order = (epoch, batches)
        return batches

    def __iter__(self) -> BatchIterator:
        return self

    def __next__(self) -> Batch:
        if self.index >= self.batches_per_epoch:
            self.epoch, self.index = self.epoch + 1, 0
            if self.config.packing:
                self._check_packed_epoch(self.epoch)
        batch = self.epoch_batches(self.epoch)[self.index]
        self.index += 1
        if self.config.packing:
            return collate_packed(self.dataset, batch)
        return collate(self.dataset, batch, self.config.pad_to_multiple_of)

    def state_dict(self) -> dict:
        """The position, plus what the order depends on (checked on load)."""
        config = self.config
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed,
                "num_samples": len(self.dataset), "batch_size": config.batch_size,
                "group_by_length": config.group_by_length,
                "mega_batch_factor": config.mega_batch_factor, "drop_last": config.drop_last,
                "packing": config.packing, "max_seq_len": self.dataset.max_seq_len}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a `state_dict`; the data and batching must be the same as then."""
        current = self.state_dict()
        # keys a checkpoint from before packing lacks, with the value it ran with
        saved = {"packing": False, "max_seq_len": current["max_seq_len"], **state}
        changed = [f"{key}: saved {saved.get(key)}, now {current[key]}"
                   for key in ("num_samples", "batch_size", "group_by_length",
                               "mega_batch_factor", "drop_last", "packing", "max_seq_len")
                   if saved.get(key) != current[key]]
        if changed:
            raise DataError("cannot resume the data order, the data or batching changed ("
                            + "; ".join(changed) + "); resume with the same data and settings")
        self.seed, self.epoch, self.index = state["seed"], state["epoch"], state["index"]
        self._order = None

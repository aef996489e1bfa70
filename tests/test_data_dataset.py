import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lazytrain.data.dataset import (
    IGNORE_INDEX,
    BatchConfig,
    BatchIterator,
    TokenizedDataset,
    TokenizeReport,
    collate,
    encode_prompts,
    tokenize_samples,
)
from lazytrain.data.formats import DataError, Sample
from lazytrain.data.synthetic import make_samples
from lazytrain.data.template import get_template
from lazytrain.data.tokenizer import builtin_tokenizer

TOKENIZER = builtin_tokenizer()
COMPACT = get_template("compact")
EOS, PAD = TOKENIZER.eos_token_id, TOKENIZER.pad_token_id
# tokens the tokenizer puts before a prompt (the built-in one has no BOS)
PREFIX = TOKENIZER("")["input_ids"]


def _chars(text: str) -> list[int]:
    return TOKENIZER(text, add_special_tokens=False)["input_ids"]


def test_masking_of_one_sample():
    sample = Sample(instruction="1+2?", response="3")
    dataset = tokenize_samples([sample], TOKENIZER, COMPACT, max_seq_len=64)
    prompt = [*PREFIX, *_chars("Q: 1+2?\nA: ")]
    assert dataset.input_ids == [[*prompt, *_chars("3"), EOS]]
    assert dataset.labels == [[IGNORE_INDEX] * len(prompt) + [*_chars("3"), EOS]]
    assert encode_prompts([sample], TOKENIZER, COMPACT) == [prompt]
    assert dataset.report == TokenizeReport(samples=1, kept=1, truncated=0, dropped=0,
                                            tokens=len(prompt) + 2, target_tokens=2,
                                            longest=len(prompt) + 2, max_seq_len=64)


def test_truncation_is_counted_and_empty_targets_dropped():
    samples = [
        Sample(instruction="a", response="fits"),  # 8 prompt tokens + 4 + eos = 13
        Sample(instruction="a", response="is cut here"),  # 8 + 11 + 1 = 20: cut to 16
        Sample(instruction="a much longer question", response="x"),  # prompt > 16: dropped
    ]
    dataset = tokenize_samples(samples, TOKENIZER, COMPACT, max_seq_len=16)
    assert [len(ids) for ids in dataset.input_ids] == [13, 16]
    assert dataset.labels[1][-1] != EOS  # the end, eos included, was cut
    report = dataset.report
    assert (report.samples, report.kept, report.truncated, report.dropped) == (3, 2, 1, 1)
    assert report.target_tokens == 5 + 8 and report.longest == 31
    assert "1 truncated and 1 dropped" in report.summary()


def test_all_truncated_away_or_empty_is_an_error():
    with pytest.raises(DataError, match=r"all 2 samples lost their targets .* max_seq_len=4 "
                                        r"\(longest sample 10 tokens\)"):
        tokenize_samples([Sample(instruction="a", response="b")] * 2, TOKENIZER, COMPACT, 4)
    with pytest.raises(DataError, match="no samples"):
        tokenize_samples([], TOKENIZER, COMPACT, 16)
    with pytest.raises(DataError, match="max_seq_len must be >= 2"):
        tokenize_samples([Sample(instruction="a", response="b")], TOKENIZER, COMPACT, 1)


def _dataset(lengths: list[int], max_seq_len: int = 64) -> TokenizedDataset:
    """Sample i has ``lengths[i]`` tokens: a 2-token prompt, then targets."""
    ids = [[5, 10 + i % 50, *[4 + (i + j) % 90 for j in range(n - 2)]]
           for i, n in enumerate(lengths)]
    labels = [[IGNORE_INDEX, IGNORE_INDEX, *x[2:]] for x in ids]
    report = TokenizeReport(samples=len(ids), kept=len(ids), truncated=0, dropped=0, tokens=0,
                            target_tokens=0, longest=max(lengths, default=0),
                            max_seq_len=max_seq_len)
    return TokenizedDataset(input_ids=ids, labels=labels, pad_id=PAD, max_seq_len=max_seq_len,
                            report=report)


def test_collate_pads_right_and_counts():
    dataset = _dataset([5, 3, 9])
    batch = collate(dataset, [0, 1, 2])
    assert batch.input_ids.shape == batch.labels.shape == batch.attention_mask.shape == (3, 9)
    assert batch.attention_mask.sum(1).tolist() == [5, 3, 9]
    assert batch.input_ids[1].tolist() == dataset.input_ids[1] + [PAD] * 6
    assert batch.labels[1].tolist() == dataset.labels[1] + [IGNORE_INDEX] * 6
    assert batch.num_tokens == 17
    assert batch.num_target_tokens == int((batch.labels[:, 1:] != IGNORE_INDEX).sum()) == 3 + 1 + 7
    assert batch.indices == (0, 1, 2)


@pytest.mark.parametrize(("longest", "multiple", "max_seq_len", "width"), [
    (9, 1, 64, 9), (9, 8, 64, 16), (16, 8, 64, 16), (61, 8, 62, 62), (62, 8, 62, 62),
])
def test_pad_to_multiple(longest, multiple, max_seq_len, width):
    batch = collate(_dataset([3, longest], max_seq_len), [0, 1], pad_to_multiple_of=multiple)
    assert batch.input_ids.shape[1] == width


def _epoch_rows(iterator: BatchIterator) -> list[tuple[int, list[int], list[int]]]:
    """(index, tokens, labels) of every row of one epoch, padding stripped."""
    rows = []
    for _ in range(iterator.batches_per_epoch):
        batch = next(iterator)
        for row, index in enumerate(batch.indices):
            n = int(batch.attention_mask[row].sum())
            assert batch.attention_mask[row, :n].all() and not batch.attention_mask[row, n:].any()
            assert (batch.input_ids[row, n:] == PAD).all()
            assert (batch.labels[row, n:] == IGNORE_INDEX).all()
            rows.append((index, batch.input_ids[row, :n].tolist(), batch.labels[row, :n].tolist()))
    return rows


_text = st.text(alphabet="ab 1+\n?", max_size=20)


@settings(max_examples=40, deadline=None)
@given(
    pairs=st.lists(st.tuples(_text, _text), min_size=1, max_size=40),
    batch_size=st.integers(1, 7),
    mega_batch_factor=st.integers(1, 4),
    group_by_length=st.booleans(),
    seed=st.integers(0, 3),
)
def test_every_sample_once_per_epoch_with_exact_tokens(pairs, batch_size, mega_batch_factor,
                                                       group_by_length, seed):
    samples = [Sample(instruction=q, response=r) for q, r in pairs]
    dataset = tokenize_samples(samples, TOKENIZER, COMPACT, max_seq_len=256)
    assert dataset.report.kept == len(samples)
    for sample, ids, labels in zip(samples, dataset.input_ids, dataset.labels, strict=True):
        prompt = [*PREFIX, *_chars(COMPACT.render(sample))]
        assert ids == [*prompt, *_chars(sample.response), EOS]
        assert labels == [IGNORE_INDEX] * len(prompt) + ids[len(prompt):]
    config = BatchConfig(batch_size=batch_size, mega_batch_factor=mega_batch_factor,
                         group_by_length=group_by_length, seed=seed)
    iterator = BatchIterator(dataset=dataset, config=config)
    for _ in range(2):  # two epochs, two different orders
        rows = _epoch_rows(iterator)
        assert sorted(index for index, _, _ in rows) == list(range(len(samples)))
        for index, ids, labels in rows:
            assert ids == dataset.input_ids[index] and labels == dataset.labels[index]


@settings(max_examples=30, deadline=None)
@given(
    lengths=st.lists(st.integers(3, 40), min_size=1, max_size=60),
    batch_size=st.integers(1, 8),
    drop_last=st.booleans(),
    consumed=st.integers(0, 25),
    seed=st.integers(0, 1000),
)
def test_resume_yields_the_same_next_batches(lengths, batch_size, drop_last, consumed, seed):
    if drop_last and len(lengths) < batch_size:
        return
    config = {"batch_size": batch_size, "drop_last": drop_last, "seed": seed,
              "mega_batch_factor": 2}
    dataset = _dataset(lengths)
    original = BatchIterator(dataset=dataset, config=BatchConfig(**config))
    for _ in range(consumed):
        next(original)
    state = original.state_dict()
    resumed = BatchIterator(dataset=dataset, config=BatchConfig(**{**config, "seed": 0}))
    resumed.load_state_dict(state)
    for _ in range(2 * original.batches_per_epoch + 1):
        a, b = next(original), next(resumed)
        assert a.indices == b.indices
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)


def test_length_grouping_cuts_padding_and_puts_the_longest_first():
    dataset = tokenize_samples(make_samples("train", 2000), TOKENIZER, COMPACT, max_seq_len=128)

    def padding(group_by_length: bool) -> float:
        iterator = BatchIterator(dataset=dataset, config=BatchConfig(
            batch_size=16, group_by_length=group_by_length, mega_batch_factor=8))
        batches = [next(iterator) for _ in range(iterator.batches_per_epoch)]
        longest = max(len(ids) for ids in dataset.input_ids)
        if group_by_length:
            assert batches[0].input_ids.shape[1] == longest
        return 1 - sum(b.num_tokens for b in batches) / sum(b.input_ids.numel() for b in batches)

    assert padding(True) < padding(False) / 2


def test_epochs_differ_and_are_deterministic():
    dataset = _dataset(list(range(3, 43)))
    a = BatchIterator(dataset=dataset, config=BatchConfig(batch_size=4, seed=5))
    b = BatchIterator(dataset=dataset, config=BatchConfig(batch_size=4, seed=5))
    assert a.epoch_batches(0) == b.epoch_batches(0) != a.epoch_batches(1)
    assert a.batches_per_epoch == 10


def test_drop_last():
    iterator = BatchIterator(dataset=_dataset([5] * 10), config=BatchConfig(batch_size=4,
                                                                            drop_last=True))
    assert iterator.batches_per_epoch == 2
    assert [len(next(iterator).indices) for _ in range(5)] == [4] * 5
    assert iterator.state_dict()["epoch"] == 2


@pytest.mark.parametrize(("lengths", "config", "message"), [
    ([], {"batch_size": 2}, "no samples"),
    ([5, 5], {"batch_size": 4, "drop_last": True}, "2 samples .after truncation., fewer than batch_size=4"),
])
def test_iterator_errors(lengths, config, message):
    dataset = _dataset(lengths) if lengths else TokenizedDataset(
        input_ids=[], labels=[], pad_id=PAD, max_seq_len=8, report=_dataset([3]).report)
    with pytest.raises(DataError, match=message):
        BatchIterator(dataset=dataset, config=BatchConfig(**config))


def test_resume_with_other_data_is_refused():
    state = BatchIterator(dataset=_dataset([5] * 10), config=BatchConfig(batch_size=2)).state_dict()
    other = BatchIterator(dataset=_dataset([5] * 11), config=BatchConfig(batch_size=2))
    with pytest.raises(DataError, match="num_samples: saved 10, now 11"):
        other.load_state_dict(state)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"batch_size": 0}, "batch_size"),
    ({"batch_size": 1, "mega_batch_factor": 0}, "mega_batch_factor"),
    ({"batch_size": 1, "pad_to_multiple_of": 0}, "pad_to_multiple_of"),
])
def test_batch_config_validation(kwargs, message):
    with pytest.raises(DataError, match=message):
        BatchConfig(**kwargs)

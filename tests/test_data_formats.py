import json
import sys

import pytest

from lazytrain.data.formats import DataError, DataSource, Sample, load_samples

METAMATH = [
    {"query": "What is 2 + 3?", "response": "2 + 3 = 5\nThe answer is: 5", "type": "GSM_Rephrased",
     "original_question": "2 + 3?"},
    {"query": "Q2", "response": "R2"},
]
ALPACA = [
    {"instruction": "Add.", "input": "2 and 3", "output": "5", "system": "Be brief."},
    {"instruction": "Say hi.", "input": "", "output": "hi"},
]
GENERIC = [{"question": "Q1", "answer": "#### 1", "extra": 7}, {"question": "Q2", "answer": "A2"}]

EXPECTED = {
    "metamath": [
        Sample(instruction="What is 2 + 3?", response="2 + 3 = 5\nThe answer is: 5",
               type="GSM_Rephrased"),
        Sample(instruction="Q2", response="R2"),
    ],
    "alpaca": [
        Sample(instruction="Add.", input="2 and 3", response="5", system="Be brief."),
        Sample(instruction="Say hi.", response="hi"),
    ],
    "generic": [Sample(instruction="Q1", response="#### 1"),
                Sample(instruction="Q2", response="A2")],
}
RECORDS = {"metamath": METAMATH, "alpaca": ALPACA, "generic": GENERIC}
FIELDS = {"prompt_field": "question", "response_field": "answer"}


def _write(path, records, kind):
    if kind == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    elif kind == "json":
        path.write_text(json.dumps(records, indent=2))
    else:
        import pyarrow as pa  # in the test extra: the parquet cases run, they do not skip
        import pyarrow.parquet as pq
        pq.write_table(pa.Table.from_pylist(records), path)
    return path


@pytest.mark.parametrize("kind", ["jsonl", "json", "parquet"])
@pytest.mark.parametrize(("schema", "format"), [
    ("metamath", "auto"), ("metamath", "metamathqa"),
    ("alpaca", "auto"), ("alpaca", "alpaca"),
    ("generic", "auto"), ("generic", "by-kind"),
])
def test_formats(tmp_path, kind, schema, format):
    path = _write(tmp_path / f"data.{kind}", RECORDS[schema], kind)
    format = kind if format == "by-kind" else format
    samples = load_samples(DataSource(path=str(path), format=format, **FIELDS))
    assert samples == EXPECTED[schema]


def test_plain_path_and_limit(tmp_path):
    path = _write(tmp_path / "d.jsonl", METAMATH * 3, "jsonl")
    assert len(load_samples(str(path))) == 6
    assert load_samples(DataSource(path=str(path), limit=1)) == EXPECTED["metamath"][:1]


def test_jsonl_skips_blank_lines(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n" + json.dumps(METAMATH[0]) + "\n\n   \n" + json.dumps(METAMATH[1]) + "\n")
    assert load_samples(str(path)) == EXPECTED["metamath"]


def test_folder_of_data_files(tmp_path):
    _write(tmp_path / "a.jsonl", METAMATH[:1], "jsonl")
    _write(tmp_path / "b.json", METAMATH[1:], "json")
    (tmp_path / "README.md").write_text("# not data")
    assert load_samples(str(tmp_path)) == EXPECTED["metamath"]


def test_saved_hf_dataset(tmp_path):
    import datasets  # in the test extra: this test runs, it does not skip
    from datasets.table import InMemoryTable

    def dataset(records):
        # A fixed fingerprint skips datasets' pickling of the table, which some
        # datasets/pyarrow version pairs cannot do.
        return datasets.Dataset(InMemoryTable.from_pylist(records), fingerprint="fixture")

    dataset(METAMATH).save_to_disk(str(tmp_path / "one"))
    datasets.DatasetDict({"train": dataset(ALPACA)}).save_to_disk(str(tmp_path / "dict"))
    assert [s.instruction for s in load_samples(str(tmp_path / "one"))] == ["What is 2 + 3?", "Q2"]
    assert [s.response for s in load_samples(DataSource(path=str(tmp_path / "dict"),
                                                        format="hf"))] == ["5", "hi"]
    with pytest.raises(DataError, match=r"splits \['train'\], not 'test'"):
        load_samples(DataSource(path=str(tmp_path / "dict"), split="test"))


def _bad_jsonl(tmp_path, lines):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize(("lines", "format", "message"), [
    (['{"query": "a", "response": "b"}', '{"query": "a", "response": }'], "auto",
     r"bad\.jsonl line 2: invalid JSON"),
    (['{"query": "a", "response": "b"}', "", '{"query": "c", "answer": "d"}'], "auto",
     (r"bad\.jsonl line 3: missing field 'response'; found fields \['answer', 'query'\], "
      r"expected \['query', 'response', 'type \(optional\)'\]")),
    (['{"instruction": "a", "output": 5}'], "auto",
     r"line 1: field 'output' must be a string, got int"),
    (['{"q": "a", "r": "b"}'], "auto",
     r"line 1: cannot tell the data format from the fields \['q', 'r'\]"),
    (['{"query": "a", "response": "b"}'], "alpaca",
     r"line 1: missing field 'instruction'; found fields \['query', 'response'\]"),
    (['{"query": "a", "response": "b"}'], "jsonl", r"missing field 'prompt'"),
    (['["a", "b"]'], "auto", r"line 1: expected a JSON object \(a record\), got list"),
])
def test_bad_jsonl(tmp_path, lines, format, message):
    path = _bad_jsonl(tmp_path, lines)
    with pytest.raises(DataError, match=message):
        load_samples(DataSource(path=str(path), format=format))


@pytest.mark.parametrize(("text", "message"), [
    ('[\n  {"query": "a", "response": "b"},\n  {"query": "a" "response": "b"}\n]',
     r"bad\.json line 3: invalid JSON"),
    ('[{"query": "a", "response": "b"}, {"query": "a"}]',
     r"bad\.json record 1: missing field 'response'"),
    ('{"query": "a", "response": "b"}\n{"query": "c", "response": "d"}',
     None),  # an object first means JSON Lines, whatever the suffix
    ("[]", r"no records in .*bad\.json"),
])
def test_json_file(tmp_path, text, message):
    path = tmp_path / "bad.json"
    path.write_text(text)
    if message is None:
        assert [s.response for s in load_samples(str(path))] == ["b", "d"]
    else:
        with pytest.raises(DataError, match=message):
            load_samples(str(path))


def test_empty_and_missing(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match=r"no records in .*empty\.jsonl"):
        load_samples(str(tmp_path / "empty.jsonl"))
    with pytest.raises(DataError, match=r"data file not found: .*nope\.jsonl"):
        load_samples(str(tmp_path / "nope.jsonl"))
    (tmp_path / "folder").mkdir()
    with pytest.raises(DataError, match="holds no saved dataset"):
        load_samples(str(tmp_path / "folder"))
    with pytest.raises(DataError, match="not a folder written by datasets' save_to_disk"):
        load_samples(DataSource(path=str(tmp_path / "folder"), format="hf"))


@pytest.mark.parametrize("name", ["meta-math/MetaMathQA", "tatsu-lab/alpaca"])
def test_hub_id_is_refused_offline(name):
    with pytest.raises(DataError, match=r"Hub dataset id.*offline.*local file or folder"):
        load_samples(name)


def test_parquet_without_pyarrow(tmp_path, monkeypatch):
    path = tmp_path / "d.parquet"
    path.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(DataError, match=r"pip install pyarrow"):
        load_samples(str(path))


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"format": "csv"}, "not one of"),
    ({"prompt_field": ""}, "non-empty"),
    ({"limit": 0}, "limit"),
])
def test_bad_source_config(kwargs, message):
    with pytest.raises(DataError, match=message):
        DataSource(path="x.jsonl", **kwargs)


def test_data_error_is_a_value_error():
    assert issubclass(DataError, ValueError)

"""Loaders that turn SFT data files into a list of normalised `Sample` records.

Schemas (``DataSource.format``):

- ``metamathqa``: ``query``, ``response``, optional ``type`` (``original_question`` is ignored);
- ``alpaca``: ``instruction``, ``input``, ``output``, optional ``system``;
- ``json`` / ``jsonl`` / ``parquet``: any records, the question in ``prompt_field`` and the
  answer in ``response_field``; the name also fixes how the file is read;
- ``hf``: a folder written by ``datasets``' ``save_to_disk``, schema chosen as for ``auto``;
- ``auto``: chosen from the first record's keys, in the order above.

Files are read by their kind: ``.parquet`` with pyarrow, ``.jsonl`` as JSON Lines, anything
else as JSON, an array when it starts with ``[`` and JSON Lines otherwise. A folder written by
``datasets``' ``save_to_disk`` is read with ``load_from_disk``; any other folder is read as the
concatenation of the ``.json``, ``.jsonl`` and ``.parquet`` files directly inside it (a hub
snapshot, say). Nothing is ever downloaded.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lazytrain.errors import LazyTrainError

FORMATS = ("auto", "metamathqa", "alpaca", "json", "jsonl", "parquet", "hf")
DATA_FILE_SUFFIXES = (".json", ".jsonl", ".parquet")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class DataError(LazyTrainError, ValueError):
    """Bad or missing training/eval data; the message says where and what to do."""


@dataclass(kw_only=True, slots=True)
class Sample:
    """One SFT example, whatever file format it came from."""

    instruction: str
    """The question or task."""
    input: str = ""
    """Further context for the instruction (alpaca's ``input``); empty when there is none."""
    response: str
    """The target the model learns to produce."""
    type: str | None = None
    """A category for per-type metrics (MetaMathQA's ``type``, the synthetic tier)."""
    system: str | None = None
    """A system prompt, if the record has one."""


@dataclass(kw_only=True, slots=True)
class DataSource:
    """Where SFT data lives and how its records map onto `Sample`."""

    path: str
    """A local file (.json, .jsonl, .parquet) or folder (``save_to_disk`` output or data files)."""
    format: str = "auto"
    """auto | metamathqa | alpaca | json | jsonl | parquet | hf (see the module docstring)."""
    prompt_field: str = "prompt"
    """Record key of the question, for the generic formats."""
    response_field: str = "response"
    """Record key of the answer, for the generic formats."""
    split: str = "train"
    """Which split to read from a saved ``datasets.DatasetDict`` folder."""
    limit: int | None = None
    """Read only the first ``limit`` records (None: all)."""

    def __post_init__(self) -> None:
        self.path = str(self.path)
        if self.format not in FORMATS:
            raise DataError(f"data format {self.format!r} is not one of {FORMATS}")
        if not self.prompt_field or not self.response_field:
            raise DataError("data prompt_field and response_field must be non-empty record keys")
        if self.limit is not None and self.limit < 1:
            raise DataError(f"data limit must be >= 1 or None (all records), got {self.limit}")


@dataclass(slots=True)
class _Record:
    fields: dict[str, Any]
    where: str
    """Location for error messages: 'file.jsonl line 7', 'file.json record 3', ..."""


def load_samples(source: DataSource | str) -> list[Sample]:
    """Read every record of ``source`` into `Sample` s; raise `DataError` on bad data."""
    if not isinstance(source, DataSource):
        source = DataSource(path=source)
    path = existing_path(source.path)
    samples: list[Sample] = []
    to_sample = None
    for record in _read_records(path, source):
        if source.limit is not None and len(samples) >= source.limit:
            break
        if to_sample is None:
            to_sample = _schema(source, record)
        samples.append(to_sample(record))
    if not samples:
        raise DataError(f"no records in {path}; point data at a file or folder with examples")
    return samples


def existing_path(name: str) -> Path:
    """``name`` as a path that exists; a `DataError` saying what to pass instead when it does not."""
    path = Path(name).expanduser()
    if path.exists():
        return path
    if _HUB_ID.match(name) and path.suffix not in DATA_FILE_SUFFIXES:
        raise DataError(
            f"{name!r} is not a local file or folder; it looks like a Hugging Face Hub dataset id, "
            "and LazyTrain reads data offline only (the hub cannot be reached from here). "
            "Download it where the hub is reachable (e.g. `huggingface-cli download "
            f"--repo-type dataset {name} --local-dir DIR`) and pass the local file or folder."
        )
    raise DataError(
        f"data file not found: {path}; pass an existing .json, .jsonl or .parquet file or a folder"
    )


def _read_records(path: Path, source: DataSource) -> Iterator[_Record]:
    saved = path.is_dir() and any((path / m).exists() for m in ("dataset_dict.json", "state.json"))
    if source.format == "hf" and not saved:
        raise DataError(f"{path} is not a folder written by datasets' save_to_disk (no "
                        "dataset_dict.json or state.json); set data format to auto for other data")
    if saved:
        yield from _read_saved_dataset(path, source.split)
    elif path.is_dir():
        files = sorted(
            p for p in path.iterdir()
            if p.is_file() and p.suffix in DATA_FILE_SUFFIXES and not p.name.startswith(".")
        )
        if not files:
            raise DataError(f"folder {path} holds no saved dataset and no .json, .jsonl or "
                            ".parquet files; pass a data file or a `save_to_disk` folder")
        for file in files:
            yield from _read_file(file, source.format)
    else:
        yield from _read_file(path, source.format)


def _read_file(path: Path, format: str) -> Iterator[_Record]:
    if format == "parquet" or (format not in ("json", "jsonl") and path.suffix == ".parquet"):
        yield from _read_parquet(path)
    elif format == "jsonl" or path.suffix == ".jsonl":
        yield from _read_jsonl(path)
    else:
        with path.open("rb") as f:
            head = f.read(4096).lstrip()
        yield from (_read_json_array(path) if head.startswith(b"[") else _read_jsonl(path))


def _decode(data: bytes, path: Path, line_number: int | None = None) -> str:
    """``data`` as UTF-8, or a `DataError` naming the file, line and column of the first bad byte."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        if line_number is None:
            line_number = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise DataError(f"{path} line {line_number}: not UTF-8 text (byte {data[e.start:e.start + 1]!r} "
                        f"at column {column}); convert the file to UTF-8 (e.g. `iconv -f latin1 -t utf-8`)"
                        ) from None


def _read_jsonl(path: Path) -> Iterator[_Record]:
    with path.open("rb") as f:
        for line_number, raw in enumerate(f, start=1):
            line = _decode(raw, path, line_number)
            if not line.strip():
                continue
            where = f"{path} line {line_number}"
            try:
                fields = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: invalid JSON ({e.msg} at column {e.colno}); "
                                "fix or remove that line") from None
            yield _record(fields, where)


def _read_json_array(path: Path) -> Iterator[_Record]:
    try:
        records = json.loads(_decode(path.read_bytes(), path))
    except json.JSONDecodeError as e:
        raise DataError(f"{path} line {e.lineno}: invalid JSON ({e.msg} at column {e.colno})"
                        ) from None
    if not isinstance(records, list):
        raise DataError(f"{path}: expected a JSON array of records or JSON Lines, "
                        f"got a JSON {type(records).__name__}")
    for index, fields in enumerate(records):
        yield _record(fields, f"{path} record {index}")


def _read_parquet(path: Path) -> Iterator[_Record]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"reading {path} needs pyarrow: `pip install pyarrow` "
                        "(or convert the data to JSON Lines)") from None
    try:
        table = pq.read_table(path)
    except (OSError, ValueError, pa.ArrowException) as e:
        raise DataError(f"{path}: not a readable parquet file ({e})") from None
    for index, fields in enumerate(table.to_pylist()):
        yield _record(fields, f"{path} row {index}")


def _read_saved_dataset(path: Path, split: str) -> Iterator[_Record]:
    try:
        import datasets
    except ImportError:
        raise DataError(f"{path} is a saved Hugging Face dataset; reading it needs the datasets "
                        "library: `pip install datasets`") from None
    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DataError(f"{path} has splits {sorted(loaded)}, not {split!r}; "
                            "set the data split to one of them")
        loaded = loaded[split]
    for index, fields in enumerate(loaded):
        yield _record(fields, f"{path} row {index}")


def _record(fields: Any, where: str) -> _Record:
    if not isinstance(fields, dict):
        raise DataError(f"{where}: expected a JSON object (a record), got {type(fields).__name__}")
    return _Record(fields, where)


def _schema(source: DataSource, first: _Record) -> Callable[[_Record], Sample]:
    """Pick the record -> Sample conversion, detecting it from ``first`` for format=auto."""
    generic = _GenericFields(source.prompt_field, source.response_field)
    if source.format == "metamathqa":
        return _metamathqa
    if source.format == "alpaca":
        return _alpaca
    if source.format in ("json", "jsonl", "parquet"):
        return generic
    keys = set(first.fields)
    if {"query", "response"} <= keys:
        return _metamathqa
    if {"instruction", "output"} <= keys:
        return _alpaca
    if {source.prompt_field, source.response_field} <= keys:
        return generic
    raise DataError(
        f"{first.where}: cannot tell the data format from the fields {sorted(keys)}; expected "
        f"metamathqa (query, response), alpaca (instruction, output) or "
        f"{source.prompt_field!r}/{source.response_field!r} (set data prompt_field and "
        "response_field to the record's keys)"
    )


def _optional(record: _Record, key: str) -> str | None:
    value = record.fields.get(key)
    if value is not None and not isinstance(value, str):
        raise DataError(f"{record.where}: field {key!r} must be a string, "
                        f"got {type(value).__name__} {value!r:.60}")
    return value


def _required(record: _Record, key: str, expected: list[str]) -> str:
    value = _optional(record, key)
    if value is None:
        raise DataError(f"{record.where}: missing field {key!r}; found fields "
                        f"{sorted(record.fields)}, expected {expected}")
    return value


def _metamathqa(record: _Record) -> Sample:
    expected = ["query", "response", "type (optional)"]
    return Sample(
        instruction=_required(record, "query", expected),
        response=_required(record, "response", expected),
        type=_optional(record, "type"),
    )


def _alpaca(record: _Record) -> Sample:
    expected = ["instruction", "input (optional)", "output", "system (optional)"]
    return Sample(
        instruction=_required(record, "instruction", expected),
        input=_optional(record, "input") or "",
        response=_required(record, "output", expected),
        system=_optional(record, "system"),
    )


@dataclass(frozen=True, slots=True)
class _GenericFields:
    prompt_field: str
    response_field: str

    def __call__(self, record: _Record) -> Sample:
        expected = [self.prompt_field, self.response_field]
        return Sample(
            instruction=_required(record, self.prompt_field, expected),
            response=_required(record, self.response_field, expected),
        )

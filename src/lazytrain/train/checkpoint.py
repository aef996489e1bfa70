"""Resumable checkpoints that survive a kill at any moment and a disk that fills up.

A checkpoint is a folder ``OUT/checkpoints/step-NNNNNNNN`` holding

- ``masters.safetensors``: the master groups (``g0``, ``g1``, ...) in their own precision:
  fp32 (an fp32 or split master, ``memory.master``), or bf16 (a bf16 master);
- ``optimizer.safetensors``: every tensor of the optimizer's ``state_dict()``, flattened;
- ``state.json``: the step, data position, the optimizer's non-tensor state (its structure,
  with each tensor replaced by its name in ``optimizer.safetensors``) and the size of each
  file. No pickle anywhere.

A save writes everything into ``.partial-step-NNNNNNNN`` (fsynced file by file, ``state.json``
last), renames it to its final name (atomic on one filesystem), fsyncs the parent folder, and
only then retires older checkpoints beyond ``keep`` (renamed to ``.deleting-...`` first, so a
half-deleted folder is never taken for a checkpoint). A kill at any point therefore leaves the
previous checkpoint complete; `Checkpointer.latest` finds the newest complete one and the
next save removes the leftovers. Before writing, the free space is checked against the size
of the new checkpoint; a disk that fills anyway (another writer) raises `CheckpointError`,
removes the partial folder and leaves the previous checkpoint as it was.

Masters load across forms: fp32 or bf16 values into an fp32 or split master exactly, bf16
values into a bf16 master exactly, fp32 values into a bf16 master rounded to the nearest bf16
once (with a warning when that changes any value: `Checkpointer.restore`).

Checkpoints of earlier versions (``OUT/checkpoint`` with ``optimizer.pt``) are read too: the
pickle is loaded with ``weights_only=True`` (tensors and plain containers only).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from lazytrain.errors import LazyTrainError

log = logging.getLogger(__name__)

CHUNK_BYTES = 64 * 2**20
"""Bytes per write call: a full disk is noticed within one chunk, and no tensor is copied whole."""
SPACE_MARGIN_BYTES = 2**30
"""Free space left over after a checkpoint, for the filesystem, logs and other processes (a
machine whose disk filled up has been seen to stop answering)."""
EXIT_AT_ENV = "LAZYTRAIN_CHECKPOINT_EXIT_AT"
"""Test hook: ``PHASE`` or ``PHASE:N`` makes the N-th save (default 1) of this process exit
with status 137 (as SIGKILL would) at that phase; phases are `SAVE_PHASES`."""
SAVE_PHASES = ("writing", "files_written", "state_written", "renamed", "retiring")
DTYPES = {
    torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
    torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16", torch.int32: "I32", torch.int64: "I64",
    torch.bool: "BOOL",
}


class CheckpointError(LazyTrainError, OSError):
    """A checkpoint that cannot be written (no space, no permission) or read (damaged)."""


def shard_file_names(rank: int, world_size: int) -> tuple[str, str]:
    """A rank's masters and optimizer-state files (the single-process names at world size 1)."""
    if world_size == 1:
        return "masters.safetensors", "optimizer.safetensors"
    suffix = f"rank{rank:05d}-of-{world_size:05d}"
    return f"masters-{suffix}.safetensors", f"optimizer-{suffix}.safetensors"


RUN_FILES = ("metrics.jsonl", "checkpoints", "checkpoint", "config.json")
"""What marks a folder as holding an earlier training run (profile and plan write other files)."""


def check_output_dir(out_dir: Path, resume: bool, overwrite: bool) -> None:
    """Refuse an output_dir that is a file or cannot be written, or that holds an earlier run
    unless resumed or overwritten."""
    if out_dir.exists() and not out_dir.is_dir():
        raise CheckpointError(f"training.output_dir={out_dir} is a file; give a folder (it is created if missing)")
    check_writable(out_dir)
    if resume or overwrite or not out_dir.is_dir():
        return
    found = [name for name in RUN_FILES if (out_dir / name).exists()
             and not (name == "metrics.jsonl" and (out_dir / name).stat().st_size == 0)]
    if found:
        raise CheckpointError(
            f"training.output_dir={out_dir} holds an earlier run ({', '.join(found)}); continue it "
            "with training.resume=true, replace it with training.overwrite=true, or choose another "
            "training.output_dir"
        )


def check_writable(out_dir: Path) -> None:
    """Raise unless a file can be created in ``out_dir``, or in its nearest existing parent (where
    it would be created), naming why (permission, read-only filesystem, a file in the path);
    nothing is left behind."""
    parent = out_dir
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise CheckpointError(f"training.output_dir={out_dir} cannot be created: {parent} is a file; "
                              "choose a folder path whose parents are folders")
    probe = parent / f".lazytrain-write-test-{os.getpid()}"
    try:
        probe.touch(exist_ok=False)
        probe.unlink()
    except OSError as error:
        where = "written" if parent == out_dir else f"created (in {parent})"
        raise CheckpointError(
            f"training.output_dir={out_dir} cannot be {where}: {error.strerror}; choose a folder "
            "you can write to on a writable disk (or fix its permissions)"
        ) from None


def gb(nbytes: int) -> str:
    return f"{nbytes / 1e9:.1f} GB"


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def free_bytes(path: Path) -> int:
    """Free bytes on the filesystem of ``path`` (or of its nearest existing parent)."""
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def flatten_state(state, prefix: str = "") -> tuple[object, dict[str, torch.Tensor]]:
    """``state`` with each tensor replaced by ``{"tensor": name}``, and the tensors by name."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(value, path: str):
        if isinstance(value, torch.Tensor):
            tensors[path] = value
            return {"tensor": path}
        if isinstance(value, dict):
            if not all(isinstance(k, str) for k in value):
                raise TypeError(f"state {path or '/'}: only string keys can be saved")
            return {"dict": {k: walk(v, f"{path}.{k}" if path else k) for k, v in value.items()}}
        if isinstance(value, (list, tuple)):
            return {"list": [walk(v, f"{path}.{i}" if path else str(i)) for i, v in enumerate(value)]}
        if value is None or isinstance(value, (bool, int, float, str)):
            return {"value": value}
        raise TypeError(f"state {path}: a {type(value).__name__} cannot be saved without pickle")

    return walk(state, prefix), tensors


def unflatten_state(tree, tensors) -> object:
    """The inverse of `flatten_state`; ``tensors`` maps names to tensors (or a safetensors handle)."""
    if "tensor" in tree:
        return tensors.get_tensor(tree["tensor"]) if hasattr(tensors, "get_tensor") else tensors[tree["tensor"]]
    if "dict" in tree:
        return {k: unflatten_state(v, tensors) for k, v in tree["dict"].items()}
    if "list" in tree:
        return [unflatten_state(v, tensors) for v in tree["list"]]
    return tree["value"]


def tensors_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(_numel(t) * _dtype(t).itemsize for t in tensors.values())


# A master group is an fp32 tensor, a split master (bf16 weight + int16 remainder) whose exact
# fp32 value `.stored()` builds, or a bf16 master (`.stored()`: its weight): a checkpoint holds
# each in its `.dtype`, one group at a time (optim/master.py).
def _numel(t) -> int:
    return t.numel()


def _dtype(t) -> torch.dtype:
    return t.dtype


def _shape(t) -> list[int]:
    return list(t.shape) if isinstance(t, torch.Tensor) else [t.numel()]


def _materialize(t) -> torch.Tensor:
    return t if isinstance(t, torch.Tensor) else t.stored()


def _rounded_elements(master, saved: torch.Tensor) -> int:
    """How many of ``saved``'s values a bf16 ``master`` cannot hold (0 for another master)."""
    if master.dtype != torch.bfloat16 or saved.dtype == torch.bfloat16:
        return 0
    return int((saved.to(torch.bfloat16).float() != saved.float()).sum())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_chunk(f, data: memoryview) -> None:
    """One write of a checkpoint file (a separate function so tests can fill the disk here)."""
    f.write(data)


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], on_half=None) -> None:
    """A safetensors file written in chunks straight from the tensors, then fsynced.

    (``safetensors.torch.save_file`` first copies every tensor into one bytes object: 30 GB
    more host memory for a 7B model's masters.) ``on_half`` is called once half the bytes
    are written (the test hook's ``writing`` phase).
    """
    header, offset = {}, 0
    for name, t in tensors.items():
        nbytes = _numel(t) * _dtype(t).itemsize
        header[name] = {"dtype": DTYPES[_dtype(t)], "shape": _shape(t), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    total, written = offset, 0
    with open(path, "wb") as f:
        write_chunk(f, memoryview(len(encoded).to_bytes(8, "little") + encoded))
        for t in tensors.values():
            flat = _materialize(t).detach().reshape(-1)
            data = memoryview(flat.contiguous().view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")
            for start in range(0, len(data), CHUNK_BYTES):
                piece = data[start : start + CHUNK_BYTES]
                write_chunk(f, piece)
                if on_half is not None and written < total // 2 <= written + len(piece):
                    on_half()
                written += len(piece)
        f.flush()
        os.fsync(f.fileno())


@dataclass(frozen=True, slots=True)
class Found:
    """A complete checkpoint on disk."""

    path: Path
    step: int
    state: dict


class Checkpointer:
    """Saves, finds and restores the run's checkpoints in ``out_dir/checkpoints``.

    ``keep``: complete checkpoints kept after a save. ``in_place``: retire the old ones
    *before* writing the new one, so a disk with room for one checkpoint only can hold the
    run; a kill or a full disk during that save then leaves no checkpoint.
    """

    def __init__(self, out_dir: Path, keep: int = 1, in_place: bool = False, rank: int = 0,
                 world_size: int = 1, agree: Callable[[bool], bool] | None = None):
        self.out_dir = Path(out_dir)
        self.root = self.out_dir / "checkpoints"
        self.keep = keep
        self.in_place = in_place
        self.saves = 0
        # data parallel: every rank writes its shard files into one folder (on a filesystem all
        # hosts see); rank 0 alone writes state.json, renames the folder and retires old ones
        self.rank, self.world_size = rank, world_size
        self.agree: Callable[[bool], bool] = agree or (lambda ok: ok)
        """Every rank calls it with whether its part went well; True when all did (a barrier)."""

    # -- finding ---------------------------------------------------------------------------

    def complete(self) -> list[Found]:
        """Complete checkpoints, newest first (a legacy ``OUT/checkpoint`` included)."""
        found = []
        candidates = sorted(self.root.glob("step-*")) if self.root.is_dir() else []
        legacy = self.out_dir / "checkpoint"
        for path in [*candidates, legacy]:
            state = self._read_state(path)
            if state is not None:
                found.append(Found(path=path, step=int(state["step"]), state=state))
        return sorted(found, key=lambda f: f.step, reverse=True)

    def latest(self) -> Found | None:
        found = self.complete()
        return found[0] if found else None

    def resume_point(self) -> Found:
        """The checkpoint ``training.resume=true`` continues from (an error when there is none)."""
        found = self.latest()
        if found is None:
            raise CheckpointError(
                f"training.resume=true but {self.out_dir} holds no complete checkpoint; start "
                "without training.resume (add training.overwrite=true if the folder holds a run)"
            )
        return found

    def shard(self, rank: int, world_size: int, agree: Callable[[bool], bool]) -> None:
        """Data parallel: this rank writes and reads its shard files; ``agree`` syncs the ranks
        (each says whether its part went well; all learn whether every part did)."""
        self.rank, self.world_size, self.agree = rank, world_size, agree

    def barrier(self) -> None:
        self.agree(True)

    def _on_every_rank(self, action: Callable[[], None], what: str) -> None:
        """Run ``action`` here while the other ranks run theirs; if it failed on any rank, raise
        on every rank (a rank that failed alone would leave the others waiting at the next
        barrier for ever): its own error where it failed, a `CheckpointError` elsewhere."""
        error = None
        try:
            action()
        except (OSError, CheckpointError) as caught:
            error = caught
        if self.agree(error is None):
            return
        if error is not None:
            raise error
        raise CheckpointError(f"another rank failed {what} (its log says why)")

    def _read_state(self, path: Path) -> dict | None:
        try:
            state = json.loads((path / "state.json").read_text())
        except (OSError, ValueError):
            return None
        if path.name == "checkpoint":  # the earlier layout: no file list
            return state if (path / "masters.safetensors").exists() and (path / "optimizer.pt").exists() else None
        for name, size in state.get("files", {}).items():
            file = path / name
            if not file.is_file() or file.stat().st_size != size:
                log.warning("checkpoint %s is incomplete (%s); skipping it", path, name)
                return None
        return state

    # -- sizes -----------------------------------------------------------------------------

    def size_bytes(self, masters: list, optimizer_state: dict) -> int:
        """Bytes of a checkpoint: masters (fp32; a split master saved whole, a bf16 master as bf16)
        and optimizer state."""
        return tensors_bytes({str(g): m for g, m in enumerate(masters)}) + tensors_bytes(
            flatten_state(optimizer_state)[1])

    def check_room(self, size: int, extra: int = 0, whole_run: bool = False) -> None:
        """Raise unless the next save (and ``extra`` bytes, e.g. the model export) fits.

        The checkpoints that stay on disk while a new one is written are the newest ``keep``
        (``keep - 1`` with ``in_place``, whose older ones are deleted first). ``whole_run``
        (at start-up): also count the ones this run has yet to write before it reaches that
        steady state, so a disk that would fill at the second save is refused now.
        """
        existing = self.complete()
        stay = existing[: self.keep - 1] if self.in_place else existing[: self.keep]
        reclaim = sum(folder_bytes(f.path) for f in existing[len(stay):]) if self.in_place else 0
        copies = 1 + ((self.keep - 1 if self.in_place else self.keep) - len(stay) if whole_run else 0)
        free = free_bytes(self.out_dir) + reclaim
        need = copies * size + extra + SPACE_MARGIN_BYTES
        if free >= need:
            return
        held = sum(folder_bytes(f.path) for f in stay)
        options = ["free space on that disk", "set training.output_dir to a larger disk"]
        if self.keep > 1:
            options.append(f"lower training.keep_checkpoints (now {self.keep})")
        if not self.in_place:
            options.append("set training.checkpoint_in_place=true (the previous checkpoint is deleted "
                           "before the next is written: needs room for one, but a kill during that "
                           "save loses it)")
        what = f"{copies} checkpoints (the next and the one kept while it is written)" if copies > 1 else "it"
        kept = f"; {len(stay)} earlier checkpoint(s) ({gb(held)}) stay on disk" if stay else ""
        model = f" plus {gb(extra)} for the model export" if extra else ""
        raise CheckpointError(
            f"a checkpoint of this run is {gb(size)}: {what}{model} need {gb(need)} with a margin, "
            f"{gb(free)} is free under {self.out_dir}{kept}; {'; or '.join(options)}"
        )

    # -- saving ----------------------------------------------------------------------------

    def save(self, step: int, masters: list, optimizer_state: dict, state: dict) -> Path:
        """Write checkpoint ``step``; return its folder. The previous one survives any failure."""
        self.saves += 1
        main = self.rank == 0
        if main:
            self.clean_leftovers()
        tree, opt_tensors = flatten_state(optimizer_state)
        master_tensors = {f"g{g}": m for g, m in enumerate(masters)}
        size = tensors_bytes(master_tensors) + tensors_bytes(opt_tensors)
        self._on_every_rank(lambda: self.check_room(size), f"the free-space check before checkpoint step {step}")
        final = self.root / f"step-{step:08d}"
        tmp = self.root / f".partial-{final.name}"
        masters_name, optimizer_name = shard_file_names(self.rank, self.world_size)

        def prepare() -> None:  # rank 0, before any rank writes
            if self.in_place:
                for old in self.complete()[self.keep - 1:]:
                    self._retire(old.path)
            tmp.mkdir(parents=True)

        self._on_every_rank(prepare if main else (lambda: None), f"preparing checkpoint {final}")

        def write_files() -> None:
            write_safetensors(tmp / masters_name, master_tensors, on_half=lambda: self._phase("writing"))
            write_safetensors(tmp / optimizer_name, opt_tensors)
            self._phase("files_written")

        def complete() -> None:  # rank 0, once every rank's files are written
            files = {f.name: f.stat().st_size for f in sorted(tmp.iterdir())}
            self._write_json(tmp / "state.json", {**state, "step": step, "optimizer": tree, "files": files,
                                                  "world_size": self.world_size})
            _fsync_dir(tmp)
            self._phase("state_written")
            if final.exists():  # the same step saved again (e.g. after a resume): retire it first
                self._retire(final)
            tmp.rename(final)
            _fsync_dir(self.root)

        try:
            self._on_every_rank(write_files, f"writing its files of checkpoint {final}")
            self._on_every_rank(complete if main else (lambda: None), f"completing checkpoint {final}")
            if not main:
                return final
        except CheckpointError:  # another rank's failure: this rank's files go with the folder
            if main:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        except OSError as error:
            shutil.rmtree(tmp, ignore_errors=True)
            previous = self.latest()
            kept = f"the previous checkpoint {previous.path} (step {previous.step}) is intact" if previous else "no earlier checkpoint exists"
            if error.errno in (errno.ENOSPC, errno.EDQUOT):
                raise CheckpointError(
                    f"the disk filled up while writing checkpoint {final} ({gb(size)}): {error.strerror}; "
                    f"{kept}; free space or set training.output_dir to a larger disk, then resume "
                    "with training.resume=true"
                ) from None
            raise CheckpointError(f"could not write checkpoint {final}: {error}; {kept}") from None
        self._phase("renamed")
        for old in self.complete()[self.keep:]:
            self._retire(old.path)
        return final

    def clean_leftovers(self) -> None:
        """Remove partial saves and half-retired checkpoints that a kill left behind."""
        if self.root.is_dir():
            for path in [*self.root.glob(".partial-*"), *self.root.glob(".deleting-*")]:
                shutil.rmtree(path, ignore_errors=True)

    def remove_all(self) -> None:
        for path in (self.root, self.out_dir / "checkpoint", self.out_dir / "checkpoint.tmp"):
            shutil.rmtree(path, ignore_errors=True)

    def _retire(self, path: Path) -> None:
        doomed = self.root / f".deleting-{path.name}"
        self.root.mkdir(parents=True, exist_ok=True)
        path.rename(doomed)
        _fsync_dir(self.root)
        self._phase("retiring")
        shutil.rmtree(doomed)

    @staticmethod
    def _write_json(path: Path, data: dict) -> None:
        with open(path, "w") as f:
            json.dump(data, f)
            f.flush()
            os.fsync(f.fileno())

    def _phase(self, name: str) -> None:
        spec = os.environ.get(EXIT_AT_ENV)
        if not spec:
            return
        phase, _, nth = spec.partition(":")
        if phase == name and self.saves == int(nth or 1):
            os._exit(137)

    # -- restoring -------------------------------------------------------------------------

    def restore(self, found: Found, masters: list, num_params: int | None = None) -> dict:
        """Copy the checkpoint's masters (this rank's shard) into ``masters`` of a model with
        ``num_params`` parameters; return the optimizer's state dict."""
        path = found.path
        if num_params is not None and found.state.get("num_params", num_params) != num_params:
            raise CheckpointError(
                f"checkpoint {path} is of a model with {found.state['num_params']} parameters, this "
                f"model has {num_params}; resume with the same model.source or use another "
                "training.output_dir"
            )
        saved_world = int(found.state.get("world_size", 1))
        if saved_world != self.world_size:
            raise CheckpointError(
                f"checkpoint {path} holds the shards of {saved_world} ranks, this run has "
                f"{self.world_size}; resume with {saved_world} ranks (torchrun --nproc-per-node/"
                "--nnodes), or start a new training.output_dir"
            )
        masters_name, optimizer_name = shard_file_names(self.rank, self.world_size)
        rounded = 0
        try:
            with safe_open(str(path / masters_name), framework="pt") as f:
                names = set(f.keys())
                if names != {f"g{g}" for g in range(len(masters))}:
                    raise CheckpointError(
                        f"checkpoint {path} holds {len(names)} parameter groups, this model has "
                        f"{len(masters)}; resume with the model the checkpoint was made with"
                    )
                for g, m in enumerate(masters):
                    saved = f.get_tensor(f"g{g}")
                    if saved.numel() != m.numel():
                        raise CheckpointError(
                            f"checkpoint {path}: group {g} has {saved.numel()} parameters, this model "
                            f"{m.numel()}; resume with the model the checkpoint was made with"
                        )
                    if isinstance(m, torch.Tensor):
                        m.copy_(saved)
                    else:
                        rounded += _rounded_elements(m, saved)
                        m.assign(saved)
            if rounded:
                log.warning("checkpoint %s holds fp32 masters and this run's are bf16 (memory.master=bf16): %d of %d "
                            "values were rounded to the nearest bf16, once (resuming with memory.master=fp32 or split "
                            "keeps them exactly)", path, rounded, sum(m.numel() for m in masters))
            if path.name == "checkpoint":
                return torch.load(path / "optimizer.pt", weights_only=True)
            with safe_open(str(path / optimizer_name), framework="pt") as f:
                return unflatten_state(found.state["optimizer"], f)
        except (SafetensorError, OSError, RuntimeError) as error:
            raise CheckpointError(
                f"checkpoint {path} cannot be read ({error}); delete it to resume from an earlier "
                "one, or start again without training.resume"
            ) from None

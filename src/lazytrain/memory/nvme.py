"""The NVMe tier: activations written to files and read back, asynchronously, checksummed.

Writes and reads run on a small thread pool through pinned host buffers the caller owns, so
the GPU copies on either side stay asynchronous. Every file carries a CRC-32 that is checked
on every read; a missing, unwritable or full folder, a short read or a corrupted file raises
`NvmeError` naming the path, never a silent wrong gradient. Files are removed when freed and
at exit. Plain buffered I/O is used (no O_DIRECT).
"""

from __future__ import annotations

import atexit
import errno
import itertools
import os
import shutil
import threading
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch


class NvmeError(OSError):
    pass


@dataclass(slots=True)
class NvmeRecord:
    path: Path
    nbytes: int
    crc: int


def _bytes_view(t: torch.Tensor):
    return t.view(-1).view(torch.uint8).numpy()


class NvmeStore:
    def __init__(self, folder: str | Path, workers: int = 4):
        self.folder = Path(folder).expanduser()
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            probe = self.folder / f".lazytrain-probe-{os.getpid()}"
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as e:
            raise NvmeError(
                f"NVMe activation folder {self.folder} is not usable ({e.strerror or e}); set "
                "memory.nvme_dir to a writable folder on a fast disk"
            ) from None
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="lazytrain-nvme")
        self._counter = itertools.count()
        self._live: set[Path] = set()
        self._lock = threading.Lock()
        self.bytes_written = 0
        atexit.register(self.close)

    def free_bytes(self) -> int:
        return shutil.disk_usage(self.folder).free

    def write(self, buf: torch.Tensor, ready: torch.cuda.Event | None = None) -> Future:
        """Write ``buf`` (a contiguous CPU tensor) once ``ready`` has fired; -> `NvmeRecord`."""
        path = self.folder / f"lazytrain-{os.getpid()}-{next(self._counter)}.act"
        with self._lock:
            self._live.add(path)
        return self._pool.submit(self._write, path, buf, ready)

    def _write(self, path: Path, buf: torch.Tensor, ready: torch.cuda.Event | None) -> NvmeRecord:
        if ready is not None:
            ready.synchronize()
        data = _bytes_view(buf)
        nbytes = data.nbytes
        if self.free_bytes() < nbytes:
            raise NvmeError(errno.ENOSPC, f"NVMe folder full: {nbytes / 2**20:.1f} MiB needed, "
                            f"{self.free_bytes() / 2**20:.1f} MiB free; free space or lower the "
                            "plan's NVMe use", str(path))
        try:
            with open(path, "wb") as f:
                f.write(memoryview(data))
        except OSError as e:
            raise NvmeError(e.errno, f"writing activations failed: {e.strerror or e}", str(path)) from None
        with self._lock:
            self.bytes_written += nbytes
        return NvmeRecord(path=path, nbytes=nbytes, crc=zlib.crc32(memoryview(data)))

    def read(self, record: NvmeRecord, out: torch.Tensor) -> Future:
        """Read ``record`` into ``out`` (a contiguous CPU tensor of the same bytes); -> ``out``."""
        return self._pool.submit(self._read, record, out)

    def _read(self, record: NvmeRecord, out: torch.Tensor) -> torch.Tensor:
        data = _bytes_view(out)
        try:
            with open(record.path, "rb") as f:
                got = f.readinto(memoryview(data))
        except OSError as e:
            raise NvmeError(e.errno, f"reading activations failed: {e.strerror or e}", str(record.path)) from None
        if got != record.nbytes:
            raise NvmeError(errno.EIO, f"short read: {got} of {record.nbytes} bytes", str(record.path))
        if zlib.crc32(memoryview(data)) != record.crc:
            raise NvmeError(errno.EIO, "checksum mismatch: the activation file is corrupted", str(record.path))
        return out

    def remove(self, record: NvmeRecord) -> None:
        with self._lock:
            self._live.discard(record.path)
        record.path.unlink(missing_ok=True)

    def close(self) -> None:
        """Remove every file this store wrote."""
        with self._lock:
            live, self._live = list(self._live), set()
        for path in live:
            path.unlink(missing_ok=True)

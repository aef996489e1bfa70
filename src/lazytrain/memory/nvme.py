"""The NVMe tier: activations written to files and read back, asynchronously, checksummed.

Writes and reads run on a small thread pool through pinned host buffers the caller owns, so
the GPU copies on either side stay asynchronous. Every file carries a CRC-32 that is checked
on every read; a missing, unwritable or full folder, a short read or a corrupted file raises
`NvmeError` naming the path, never a silent wrong gradient. Files are removed when freed and
at exit.

I/O bypasses the page cache (``O_DIRECT``) where the filesystem allows it and the buffer is
4 KiB-aligned with storage up to the next 4 KiB (`aligned_empty` makes such buffers; the
file is then padded to 4 KiB); otherwise it is ordinary buffered I/O. Without the cache, a
write costs what the disk costs and the host memory the cache would take stays free.
"""

from __future__ import annotations

import atexit
import errno
import itertools
import mmap
import os
import shutil
import threading
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from lazytrain.errors import LazyTrainError
from lazytrain.memory.host_store import pin_in_place


class NvmeError(LazyTrainError, OSError):
    pass


@dataclass(slots=True)
class NvmeRecord:
    path: Path
    nbytes: int
    crc: int


ALIGN = 4096
"""O_DIRECT needs this alignment of the memory address, the file offset and the length."""
O_DIRECT = getattr(os, "O_DIRECT", 0)


def _bytes_view(t: torch.Tensor):
    return t.view(-1).view(torch.uint8).numpy()


def _round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def aligned_empty(numel: int, dtype: torch.dtype, pin: bool = False) -> torch.Tensor:
    """``numel`` elements at a 4 KiB-aligned address, with storage up to the next 4 KiB.

    The storage is an anonymous memory mapping of exactly those whole pages, so it *starts* at
    the aligned address: torch's ``is_pinned()`` asks about a tensor's storage's first byte,
    and a slice of a larger allocation (what this did before) reported False for memory that
    was pinned and copied at pinned speed. With ``pin`` the pages are page-locked in place
    (`pin_in_place`) for as long as the returned tensor lives: they hold `padded_bytes` of host
    memory, where torch's pinned allocator would round up to a power of two (a 14.8 GB saved
    set took 16 GiB). Whole pages only, so no other buffer shares them. Keep the returned
    tensor itself while copying: it owns the pinning (a dtype view of it does not keep it alive).
    """
    nbytes = numel * dtype.itemsize
    # private anonymous memory (mmap's default is shared), unmapped when the last tensor on the
    # storage goes; pages are zero until written
    region = mmap.mmap(-1, _round_up(max(nbytes, 1)), flags=mmap.MAP_PRIVATE)
    pages = torch.frombuffer(region, dtype=torch.uint8)
    out = pages[:nbytes].view(dtype)
    if pin:
        pin_in_place(pages, owner=out)
    return out


def padded_bytes(nbytes: int) -> int:
    """Host bytes an `aligned_empty` buffer of ``nbytes`` holds (its whole 4 KiB pages)."""
    return _round_up(nbytes)


def _direct_region(buf: torch.Tensor):
    """The aligned, padded bytes holding ``buf`` (a numpy view), or None if it has none."""
    nbytes = buf.numel() * buf.element_size()
    start = buf.storage_offset() * buf.element_size()
    padded = _round_up(nbytes)
    storage = buf.untyped_storage()
    if buf.data_ptr() % ALIGN or storage.nbytes() - start < padded or not buf.is_contiguous():
        return None
    region = torch.empty(0, dtype=torch.uint8).set_(storage, start, (padded,), (1,))
    return region.numpy()


def _probe_direct(folder: Path) -> bool:
    """Whether ``folder``'s filesystem takes O_DIRECT writes (tmpfs, for one, does not)."""
    if not O_DIRECT:
        return False
    probe = folder / f".lazytrain-direct-{os.getpid()}"
    buf = aligned_empty(ALIGN, torch.uint8)
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | O_DIRECT, 0o600)
        try:
            return os.write(fd, _direct_region(buf)) == ALIGN
        finally:
            os.close(fd)
    except OSError:
        return False
    finally:
        probe.unlink(missing_ok=True)


def _write_all(fd: int, data) -> None:
    view, done = memoryview(data), 0
    while done < len(view):
        n = os.write(fd, view[done:])
        if n <= 0:
            raise OSError(errno.EIO, f"write returned {n} after {done} of {len(view)} bytes")
        done += n


def _read_all(fd: int, data) -> int:
    view, done = memoryview(data), 0
    while done < len(view):
        n = os.readv(fd, [view[done:]])
        if n == 0:
            break
        done += n
    return done


class NvmeStore:
    """Activation files in ``folder``. ``direct``: None probes whether O_DIRECT works there,
    False forces buffered I/O."""

    def __init__(self, folder: str | Path, workers: int = 4, direct: bool | None = None):
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
        self.direct = _probe_direct(self.folder) if direct is None else (direct and bool(O_DIRECT))
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
        region = _direct_region(buf) if self.direct else None
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (O_DIRECT if region is not None else 0)
        try:
            fd = os.open(path, flags, 0o600)
            try:
                _write_all(fd, data if region is None else region)
            finally:
                os.close(fd)
        except OSError as e:
            raise NvmeError(e.errno, f"writing activations failed: {e.strerror or e}", str(path)) from None
        with self._lock:
            self.bytes_written += nbytes
        return NvmeRecord(path=path, nbytes=nbytes, crc=zlib.crc32(memoryview(data)))

    def read(self, record: NvmeRecord, out: torch.Tensor, ready: torch.cuda.Event | None = None) -> Future:
        """Read ``record`` into ``out`` (a contiguous CPU tensor of the same bytes) once
        ``ready`` has fired (the last GPU copy out of a reused pinned buffer); -> ``out``."""
        return self._pool.submit(self._read, record, out, ready)

    def _read(self, record: NvmeRecord, out: torch.Tensor, ready: torch.cuda.Event | None = None) -> torch.Tensor:
        if ready is not None:  # a pooled buffer an H2D copy may still be reading
            ready.synchronize()
        data = _bytes_view(out)
        region = _direct_region(out) if self.direct else None
        try:
            fd = os.open(record.path, os.O_RDONLY | (O_DIRECT if region is not None else 0))
            try:
                got = min(_read_all(fd, data if region is None else region), record.nbytes)
            finally:
                os.close(fd)
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

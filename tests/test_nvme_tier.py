"""NVMe tier faults give clear errors naming the file, never a wrong gradient."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from lazytrain.memory.nvme import NvmeError, NvmeStore
from lazytrain.runtime.activations import ActivationStore
from lazytrain.runtime.streams import Streams

CPU = torch.device("cpu")


# both I/O paths: O_DIRECT where this folder's filesystem takes it, and buffered
IO_PATHS = [pytest.param(None, id="direct-if-possible"), pytest.param(False, id="buffered")]


def stored(tmp_path, direct=None):
    nvme = NvmeStore(tmp_path / "acts", direct=direct)
    store = ActivationStore(Streams(CPU), CPU, nvme=nvme)
    x = torch.randn(64, 33)  # 8448 bytes: not a multiple of the 4 KiB O_DIRECT unit
    handle = store.put(x, "nvme")
    record = handle.written.result()
    return nvme, store, x, handle, record


@pytest.mark.parametrize("direct", IO_PATHS)
def test_round_trip_and_cleanup(tmp_path, direct):
    nvme, store, x, handle, record = stored(tmp_path, direct)
    assert record.path.exists() and record.nbytes == x.numel() * 4
    if nvme.direct:  # the file is padded to whole 4 KiB blocks
        assert record.path.stat().st_size == 12288
    else:
        assert record.path.stat().st_size == record.nbytes
    assert torch.equal(store.get(handle), x)
    store.free(handle)
    assert not record.path.exists()
    assert store.bytes_by_tier["nvme"] == 0


def test_aligned_buffers_and_when_o_direct_applies(tmp_path):
    from lazytrain.memory.nvme import ALIGN, O_DIRECT, _direct_region, aligned_empty

    buf = aligned_empty(1000, torch.float32)
    assert buf.data_ptr() % ALIGN == 0 and buf.numel() == 1000
    assert _direct_region(buf).nbytes == ALIGN  # 4000 bytes, padded to one block
    assert _direct_region(torch.randn(1000)[1:]) is None  # unaligned: buffered I/O
    nvme = NvmeStore(tmp_path / "acts")
    if not O_DIRECT:
        assert not nvme.direct
    # no probe file is left behind either way
    assert not list((tmp_path / "acts").iterdir())


@pytest.mark.parametrize("direct", IO_PATHS)
def test_flipped_byte_is_detected(tmp_path, direct):
    _, store, _, handle, record = stored(tmp_path, direct)
    raw = bytearray(record.path.read_bytes())
    raw[100] ^= 0x40
    record.path.write_bytes(bytes(raw))
    with pytest.raises(NvmeError, match="checksum mismatch") as e:
        store.get(handle)
    assert str(record.path) in str(e.value)


@pytest.mark.parametrize("direct", IO_PATHS)
def test_short_read_is_detected(tmp_path, direct):
    _, store, _, handle, record = stored(tmp_path, direct)
    with open(record.path, "r+b") as f:
        f.truncate(record.nbytes - 7)
    with pytest.raises(NvmeError, match="short read") as e:
        store.get(handle)
    assert str(record.path) in str(e.value)


def test_missing_file_names_the_path(tmp_path):
    _, store, _, handle, record = stored(tmp_path)
    record.path.unlink()
    with pytest.raises(NvmeError, match="reading activations failed") as e:
        store.get(handle)
    assert str(record.path) in str(e.value)


def test_unwritable_folder(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(NvmeError, match="not usable.*memory.nvme_dir"):
        NvmeStore(blocker / "acts")


def test_disk_full(tmp_path, monkeypatch):
    nvme = NvmeStore(tmp_path / "acts")
    monkeypatch.setattr(nvme, "free_bytes", lambda: 10)
    store = ActivationStore(Streams(CPU), CPU, nvme=nvme)
    handle = store.put(torch.randn(100), "nvme")
    with pytest.raises(NvmeError, match="NVMe folder full") as e:
        handle.written.result()
    assert e.value.errno == errno.ENOSPC


@pytest.mark.parametrize("direct", IO_PATHS)
def test_failed_write(tmp_path, monkeypatch, direct):
    nvme = NvmeStore(tmp_path / "acts", direct=direct)

    def failing_write(fd, data):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "write", failing_write)
    handle = ActivationStore(Streams(CPU), CPU, nvme=nvme).put(torch.randn(100), "nvme")
    with pytest.raises(NvmeError, match="writing activations failed") as e:
        handle.written.result()
    assert ".act" in str(e.value)


def test_a_step_that_cannot_fit_on_the_disk_fails_before_writing(tmp_path, monkeypatch):
    nvme = NvmeStore(tmp_path / "acts")
    store = ActivationStore(Streams(CPU), CPU, nvme=nvme)
    store.start_step(nvme_bytes=1000)  # room enough
    handle = store.put(torch.randn(4096), "nvme")
    handle.written.result()
    store.free(handle)
    monkeypatch.setattr(nvme, "free_bytes", lambda: 8000)
    # the last step's peak (16 KiB) is checked even when the caller knows of less
    with pytest.raises(NvmeError, match="NVMe folder full: this step needs") as e:
        store.start_step(nvme_bytes=0)
    assert e.value.errno == errno.ENOSPC and str(tmp_path / "acts") in str(e.value)
    assert not list((tmp_path / "acts").iterdir())


def test_nvme_tier_without_a_folder_is_a_clear_error():
    with pytest.raises(ValueError, match="memory.nvme_dir"):
        ActivationStore(Streams(CPU), CPU).put(torch.randn(4), "nvme")


def test_close_removes_every_file(tmp_path):
    nvme, _, _, _, record = stored(tmp_path)
    nvme.close()
    assert not record.path.exists()


class _Event:
    """Stands for the CUDA event of a pinned buffer's last H2D copy."""

    def __init__(self, log: list):
        self.log = log

    def synchronize(self) -> None:
        self.log.append("copy done")


def test_a_read_into_a_reused_buffer_waits_for_its_last_copy_to_the_gpu(tmp_path, monkeypatch):
    """A freed NVMe handle's read buffer goes back to the pool with the event of its H2D copy;
    the next NVMe read into it (a CPU thread) waits for that event, or it could overwrite
    pinned memory a queued copy has not read yet (silently wrong activations on a GPU)."""
    import lazytrain.memory.nvme as nvme_module

    _, store, x, first, _ = stored(tmp_path)
    second = store.put(x + 1, "nvme")
    second.written.result()  # its write buffer is back in the pool before the read buffer below
    log = []
    assert torch.equal(store.get(first), x)
    first.fetched_event = _Event(log)  # on a GPU: the H2D copy out of the read buffer
    store.free(first)
    real = nvme_module._read_all

    def read_all(fd, data):
        log.append("file read")
        return real(fd, data)

    monkeypatch.setattr(nvme_module, "_read_all", read_all)
    assert torch.equal(store.get(second), x + 1)  # read into first's buffer, the last one pooled
    assert log == ["copy done", "file read"]
    store.free(second)


@pytest.mark.parametrize("tier", ["gpu", "host", "nvme"])
def test_a_read_after_free_is_a_clear_error(tmp_path, tier):
    """The executor frees a kept layer's storage at its last read; a read after that (a saved
    tensor read more often than it was saved) must fail loudly, not read a freed buffer."""
    store = ActivationStore(Streams(CPU), CPU, nvme=NvmeStore(tmp_path / "acts"))
    handle = store.put(torch.randn(8, 8), tier)
    store.get(handle)
    store.free(handle)
    with pytest.raises(RuntimeError, match="read after it was freed"):
        store.get(handle)

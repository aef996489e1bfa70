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


def stored(tmp_path):
    nvme = NvmeStore(tmp_path / "acts")
    store = ActivationStore(Streams(CPU), CPU, nvme=nvme)
    x = torch.randn(64, 33)
    handle = store.put(x, "nvme")
    record = handle.written.result()
    return nvme, store, x, handle, record


def test_round_trip_and_cleanup(tmp_path):
    nvme, store, x, handle, record = stored(tmp_path)
    assert record.path.exists() and record.nbytes == x.numel() * 4
    assert torch.equal(store.get(handle), x)
    store.free(handle)
    assert not record.path.exists()
    assert store.bytes_by_tier["nvme"] == 0


def test_flipped_byte_is_detected(tmp_path):
    _, store, _, handle, record = stored(tmp_path)
    raw = bytearray(record.path.read_bytes())
    raw[100] ^= 0x40
    record.path.write_bytes(bytes(raw))
    with pytest.raises(NvmeError, match="checksum mismatch") as e:
        store.get(handle)
    assert str(record.path) in str(e.value)


def test_short_read_is_detected(tmp_path):
    _, store, _, handle, record = stored(tmp_path)
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


def test_failed_write(tmp_path, monkeypatch):
    nvme = NvmeStore(tmp_path / "acts")
    real_open = open

    def failing_open(path, mode="r", *args, **kwargs):
        if "w" in mode and str(path).endswith(".act"):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr("builtins.open", failing_open)
    handle = ActivationStore(Streams(CPU), CPU, nvme=nvme).put(torch.randn(100), "nvme")
    with pytest.raises(NvmeError, match="writing activations failed"):
        handle.written.result()


def test_nvme_tier_without_a_folder_is_a_clear_error():
    with pytest.raises(ValueError, match="memory.nvme_dir"):
        ActivationStore(Streams(CPU), CPU).put(torch.randn(4), "nvme")


def test_close_removes_every_file(tmp_path):
    nvme, store, _, handle, record = stored(tmp_path)
    nvme.close()
    assert not record.path.exists()

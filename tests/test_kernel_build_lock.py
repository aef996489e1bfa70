"""optim/kernel.py: a build lock that a killed build left is cleared at once, and one that a
running LazyTrain build holds is waited for (torch's own lock is a plain file: a build killed
mid-way left one on the H200 and the next process waited on it until its time limit); and a
changed header (csrc/master.h, included by both kernels) moves every kernel's build directory,
so none is loaded from a build of the old header."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from lazytrain.optim import kernel

fcntl = pytest.importorskip("fcntl")


def test_a_lock_a_killed_build_left_is_removed_at_once(tmp_path):
    (tmp_path / "lock").write_text("")  # torch's baton, fresh: no age rule would clear it
    with pytest.warns(RuntimeWarning, match="removing the kernel build lock .* a killed build left"), \
            kernel._building(tmp_path):
        assert not (tmp_path / "lock").exists()


def test_a_running_build_is_waited_for_until_its_process_ends(tmp_path):
    (tmp_path / "lock").write_text("")
    holder = subprocess.Popen(
        [sys.executable, "-c", ("import fcntl, sys, time\n"
                                f"f = open({str(tmp_path / 'lazytrain_build.lock')!r}, 'w')\n"
                                "fcntl.flock(f, fcntl.LOCK_EX)\nprint('held', flush=True)\ntime.sleep(60)")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        entered = threading.Event()

        def build():
            with pytest.warns(RuntimeWarning), kernel._building(tmp_path):
                entered.set()

        thread = threading.Thread(target=build)
        thread.start()
        time.sleep(0.5)
        # the other build is alive: its lock stays, and this one waits
        assert not entered.is_set() and (tmp_path / "lock").exists()
        holder.kill()  # killed mid-build: the kernel releases its flock
        thread.join(timeout=10)
        assert entered.is_set() and not (tmp_path / "lock").exists()
    finally:
        holder.kill()
        holder.wait()


def test_a_changed_header_rebuilds_every_kernel(tmp_path, monkeypatch):
    """Both kernels include csrc/master.h; torch's JIT build rehashes only the .cpp it is given,
    so the build directory's key must cover the header: editing it moves the directory of
    every kernel and variant (and of nothing else: the same header gives the same key)."""
    assert any(h.name == "master.h" for h in kernel.HEADERS)
    for name in kernel.SOURCES:
        assert '#include "master.h"' in kernel.SOURCES[name].read_text()
    keys = [(name, variant) for name in kernel.SOURCES for variant in (None, "scalar")]
    before = {key: kernel.build_directory(key[1], key[0]) for key in keys}
    assert before == {key: kernel.build_directory(key[1], key[0]) for key in keys}
    edited = tmp_path / "master.h"
    edited.write_bytes(kernel.HEADERS[0].read_bytes() + b"\n// edited\n")
    monkeypatch.setattr(kernel, "HEADERS", (edited, *kernel.HEADERS[1:]))
    after = {key: kernel.build_directory(key[1], key[0]) for key in keys}
    assert all(after[key] != before[key] for key in keys)

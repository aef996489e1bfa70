"""optim/kernel.py: a build lock that a killed build left is cleared at once, and one that a
running LazyTrain build holds is waited for (torch's own lock is a plain file: a build killed
mid-way left one on the H200 and the next process waited on it until its time limit)."""

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

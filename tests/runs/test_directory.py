"""One owner per run directory: a real second process, a real SIGKILL."""

import os
import signal
import subprocess
import sys

import pytest

from areal_eval.runs.directory import RunBusy, RunDir, RunLock
from tests.helpers import HOLD_RUN_LOCK

pytestmark = pytest.mark.integration  # a real second process


def test_a_second_owner_is_refused_naming_the_first_until_it_dies(tmp_path):
    run = RunDir(tmp_path / "run")
    holder = subprocess.Popen([sys.executable, "-c", HOLD_RUN_LOCK, str(run.root)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunBusy, match=rf"in use by pid {holder.pid} on "):
            RunLock(run).acquire()
        os.kill(holder.pid, signal.SIGKILL)  # a stale owner: the kernel drops its lock
        holder.wait(10)
        with RunLock(run):
            assert f'"pid": {os.getpid()}' in run.lock_file.read_text()
        with RunLock(run):  # released on exit, so the same command can run again
            pass
    finally:
        holder.kill()
        holder.wait()


def test_another_owner_in_the_same_process_is_refused_too(tmp_path):
    run = RunDir(tmp_path / "run")
    lock = RunLock(run).acquire()
    with pytest.raises(RunBusy):
        RunLock(run).acquire()
    lock.release()
    RunLock(run).acquire().release()

"""What a process started for a job does to itself: die with its parent, carry a name, yield
the CPU, and print its stacks on a signal."""

from __future__ import annotations

import functools
import os
import signal

STACKS_SIGNAL = signal.SIGUSR1
"""``kill -USR1 <pid>`` makes a process of a forked-rank job (its agent or a rank) print its
threads' Python stacks to the job's log (:mod:`areal_eval.launchers.forked_ranks` registers
:mod:`faulthandler` for it)."""


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Have the kernel send ``sig`` to this process when its parent dies, however it dies
    (``kill -9`` included), so no training or evaluation job outlives the flow that watches it.

    Linux only (elsewhere it does nothing). The kernel watches the *thread* that forked: start
    jobs from threads that live as long as the job's owner (the flow's, a task runner's).
    """
    prctl = libc_prctl()
    if prctl is None:
        return
    prctl(1, int(sig), 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the parent died before the call
        os.kill(os.getpid(), sig)


def name_process(name: str) -> None:
    """Set this process's name as ``ps``, ``top`` and psutil show it (15 bytes at most; Linux
    only): a forked rank would otherwise look like its agent."""
    prctl = libc_prctl()
    if prctl is not None:
        prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME


@functools.cache
def libc_prctl():
    """libc's prctl, looked up once in the parent: a child between fork and exec must not dlopen."""
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def lower_priority(nice: int) -> None:
    """Lower this process's CPU priority (runs in the child, after setsid).

    With autogroup scheduling (Linux's default on desktops and many servers) each session is
    its own scheduling group and a plain nice only ranks processes inside it, so the new
    session's group gets the same nice value.
    """
    os.nice(nice)
    try:
        with open("/proc/self/autogroup", "w") as fh:
            fh.write(str(nice))
    except OSError:
        pass  # no autogroup: the plain nice is enough


def set_command_line(args: list[str]) -> bool:
    """Show ``args`` as this process's command line (``ps``, ``/proc/PID/cmdline``), written over
    the one it started with, as far as that reaches (Linux only); True if it was written.

    A process forked to run a job (:mod:`areal_eval.launchers.fork_server`) would otherwise show
    its server's command line: start the server with room to spare (a long last argument)."""
    import ctypes

    try:
        with open("/proc/self/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end: fields 48 and 49
    except (OSError, IndexError, ValueError):
        return False
    room = end - start - 1  # the last NUL stays, so that the kernel reads no further
    if room <= 0:
        return False
    text = b"\0".join(a.encode(errors="replace") for a in args)[:room]
    ctypes.memmove(start, text.ljust(room, b"\0"), room)
    return True

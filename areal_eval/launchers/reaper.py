"""Nothing a run starts outlives it: a reaper process cleans up after its owner, however it dies.

``kill -9`` of the flow process leaves its children running: training ranks, warm evaluation
workers, and the temporary Prefect server, which Prefect starts with no way to tie it to its
parent. Torchrun jobs also die with their parent (``launcher.die_with_parent``); the reaper
catches everything else. The owner marks its environment with a token that every process it
starts inherits; a small separate process waits for the owner to exit and then ends every
process still carrying the token (SIGTERM, then SIGKILL).

    python -m areal_eval.launchers.reaper TOKEN OWNER_PID   (started by watch_over_children)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

OWNER_ENV = "AREAL_EVAL_OWNER"


def watch_over_children() -> str:
    """Start this process's reaper (once); returns the token its descendants carry."""
    if os.environ.get(OWNER_ENV, "").startswith(f"{os.getpid()}-"):
        return os.environ[OWNER_ENV]
    token = f"{os.getpid()}-{time.time_ns()}"
    env = {k: v for k, v in os.environ.items() if k != OWNER_ENV}  # the reaper must not reap itself
    subprocess.Popen(
        [sys.executable, "-m", "areal_eval.launchers.reaper", token, str(os.getpid())],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    os.environ[OWNER_ENV] = token
    return token


def carriers(token: str) -> list:
    """Live processes whose environment carries ``token``."""
    import psutil

    found = []
    for proc in psutil.process_iter():
        try:
            if proc.pid != os.getpid() and proc.environ().get(OWNER_ENV) == token and proc.status() != "zombie":
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def reap(token: str, grace_s: float = 5.0) -> int:
    """End every process carrying ``token``; returns how many there were."""
    import psutil

    procs = carriers(token)
    for proc in procs:
        try:
            proc.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for proc in alive + carriers(token):  # and any started meanwhile
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    return len(procs)


def main(argv: list[str]) -> int:
    import psutil

    token, owner_pid = argv[0], int(argv[1])
    try:
        owner = psutil.Process(owner_pid)
        started = owner.create_time()
        while owner.is_running() and owner.create_time() == started and owner.status() != psutil.STATUS_ZOMBIE:
            time.sleep(0.5)
    except psutil.NoSuchProcess:
        pass
    reap(token)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

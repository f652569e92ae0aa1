import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from areal_eval.launchers import fork_server
from areal_eval.launchers.local import TorchrunJob, group_alive
from tests.helpers import alive, live_processes, wait_for

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]

SHOW = (
    "import json, os, torch; print('SHOW', json.dumps({'agent': os.getppid(), 'session': os.getsid(0),"
    " 'group': os.environ.get('WANDB_RUN_GROUP'), 'threads': torch.get_num_threads(),"
    " 'cwd': os.getcwd(), 'nice': os.nice(0), 'cpus': sorted(os.sched_getaffinity(0))}))"
)
"""Run by a job's rank (``timeit`` runs it once): what the rank was given."""


def shown(log: Path) -> dict:
    [line] = [line for line in log.read_text().splitlines() if line.startswith("SHOW ")]
    return json.loads(line[5:])


def server_of(job: TorchrunJob) -> psutil.Process:
    """The fork server that forked ``job``'s agent (it outlives the job)."""
    return psutil.Process(job.proc.server_pid)


def test_jobs_are_forked_by_one_server_each_as_popen_would_have_started_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first = TorchrunJob("timeit", ["-n", "1", "-r", "1", SHOW], 1, tmp_path / "first.log", env={"WANDB_RUN_GROUP": "g"})
    assert first.wait(120) == 0, (tmp_path / "first.log").read_text()
    second = TorchrunJob("timeit", ["-n", "1", "-r", "1", SHOW], 1, tmp_path / "second.log", nice=5)
    server = server_of(second)
    failing = TorchrunJob("timeit", ["-n", "1", "-r", "1", "raise SystemExit(3)"], 1, tmp_path / "failing.log")
    assert second.wait(120) == 0 and failing.wait(120) != 0
    with pytest.raises(Exception, match="torchrun exit"):
        failing.raise_for_status("the job")

    assert isinstance(second.proc, fork_server.ForkedProcess)
    assert "areal_eval.launchers.fork_server" in " ".join(server.cmdline())
    assert server.ppid() == os.getpid()  # a child of this process, which forked both jobs
    assert server_of(failing).pid == server.pid
    one, two = shown(tmp_path / "first.log"), shown(tmp_path / "second.log")
    assert one["agent"] == first.pid == one["session"]  # each job is a session of its own
    assert two["agent"] == second.pid == two["session"]
    assert first.proc.server_pid == server.pid  # differing only in what is read late
    assert one["group"] == "g" and two["group"] is None  # a job's own environment
    assert one["cwd"] == two["cwd"] == str(tmp_path)
    assert (one["nice"], two["nice"]) == (0, 5)
    assert one["threads"] == 1  # OMP_NUM_THREADS, as the launcher sets it


def test_a_job_whose_imports_would_read_another_environment_gets_a_server_of_its_own(tmp_path):
    first = TorchrunJob("timeit", ["-n", "1", "-r", "1", SHOW], 1, tmp_path / "first.log")
    first_server = server_of(first)
    assert first.wait(120) == 0
    other = TorchrunJob("timeit", ["-n", "1", "-r", "1", SHOW], 1, tmp_path / "other.log", env={"OMP_NUM_THREADS": "2"})
    other_server = server_of(other)
    assert other.wait(120) == 0
    assert other_server.pid != first_server.pid
    assert shown(tmp_path / "other.log")["threads"] == 2  # read by OpenMP as torch loaded, in its server
    assert other_server.environ()["OMP_NUM_THREADS"] == "2"


def test_turned_off_every_job_is_a_fresh_interpreter(tmp_path, monkeypatch):
    monkeypatch.setenv(fork_server.ENABLE_ENV, "0")
    job = TorchrunJob("timeit", ["-n", "1", "-r", "1", SHOW], 1, tmp_path / "job.log")
    assert isinstance(job.proc, subprocess.Popen) and job.wait(120) == 0
    assert job.pid == shown(tmp_path / "job.log")["agent"]


def test_a_killed_job_takes_its_ranks_and_kill_9_of_the_owner_leaves_nothing(tmp_path):
    log = tmp_path / "killed.log"
    job = TorchrunJob("tests.hang_after_done", [str(tmp_path / "rows.jsonl"), "--no-done"], 2, log)
    wait_for(lambda: log.exists() and log.read_text().count("hanging") == 2, 120, "both ranks to hang")
    ranks = psutil.Process(job.pid).children()
    for process in [psutil.Process(job.pid), *ranks]:  # ``ps`` shows the job's command, not the server's
        assert process.cmdline()[: len(job.command)] == job.command
    assert str(tmp_path) in " ".join(psutil.Process(job.pid).cmdline())
    job.kill()
    assert job.poll() is not None and not group_alive(job.pid)
    assert not [p for p in ranks if alive(p)]

    # An owner that starts a job and is then killed outright: its server, the job's agent and
    # ranks all end.
    args, owned = [str(tmp_path / "rows2.jsonl"), "--no-done"], str(tmp_path / "owned.log")
    owner_script = (
        "import sys; from areal_eval.launchers.local import TorchrunJob\n"
        f"job = TorchrunJob('tests.hang_after_done', {args!r}, 2, {owned!r})\n"
        "print(job.pid, flush=True); sys.stdin.read()\n"
    )
    owner = subprocess.Popen(
        [sys.executable, "-c", owner_script], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    agent = psutil.Process(int(owner.stdout.readline()))
    wait_for(lambda: (tmp_path / "owned.log").read_text().count("hanging") == 2, 120, "the owner's ranks to hang")
    family = [agent.parent(), agent, *agent.children()]
    assert family[0].ppid() == owner.pid and len(family) >= 4  # the server, the agent, 2 ranks
    owner.kill()
    owner.wait(10)

    def gone():
        return not [p for p in family if alive(p)]

    wait_for(gone, 60, "the server, agent and ranks of a killed owner to end")


def test_a_job_killed_as_soon_as_it_is_started_leaves_nothing(tmp_path):
    """Its process group exists once its pid is known: a kill at once reaches it, whether its
    server was still importing (the first job) or already warm."""
    for i in range(4):
        env = {"OMP_NUM_THREADS": "4"} if i == 0 else None  # the first waits for a new server's imports
        job = TorchrunJob(
            "tests.hang_after_done", [str(tmp_path / f"rows{i}.jsonl"), "--no-done"], 1, tmp_path / f"{i}.log", env=env
        )
        job.kill()
        assert job.poll() is not None
        wait_for(lambda: not live_processes(str(tmp_path)), 30, f"job {i}'s processes to end")


def test_a_server_that_dies_ends_its_jobs_and_the_next_job_gets_a_new_one(tmp_path):
    log = tmp_path / "orphaned.log"
    job = TorchrunJob("tests.hang_after_done", [str(tmp_path / "rows.jsonl"), "--no-done"], 1, log)
    wait_for(lambda: log.exists() and "hanging" in log.read_text(), 120, "the rank to hang")
    server = server_of(job)
    server.send_signal(signal.SIGKILL)
    assert job.wait(60) == -signal.SIGKILL
    wait_for(lambda: not group_alive(job.pid), 60, "the agent and rank to die with their server")
    after = TorchrunJob("timeit", ["-n", "1", "-r", "1", SHOW], 1, tmp_path / "after.log")
    assert after.wait(120) == 0 and after.proc.server_pid != server.pid


def test_a_job_whose_server_dies_before_forking_it_fails_saying_so(tmp_path):
    # A server of its own (another OMP_NUM_THREADS), killed while it still imports.
    job = TorchrunJob("timeit", ["-n", "1", "-r", "1", "pass"], 1, tmp_path / "job.log", env={"OMP_NUM_THREADS": "5"})
    assert job.poll() is None  # returned at once, as Popen returns
    psutil.Process(job.proc.server_pid).kill()
    assert job.wait(60) == 1 and job.proc.pid is None
    job.kill()  # nothing to kill, and no error
    assert "the fork server" in job.tail() and "ended before it started this job" in job.tail()


def test_what_a_job_runs_is_read_when_it_runs(tmp_path, monkeypatch):
    """A module written after its server started is found, as a fresh interpreter finds it."""
    monkeypatch.chdir(tmp_path)  # where ``python -m`` looks first
    warm = TorchrunJob("timeit", ["-n", "1", "-r", "1", "pass"], 1, tmp_path / "warm.log")
    assert warm.wait(120) == 0
    (tmp_path / "written_later.py").write_text("def main(argv):\n    print('LATER', argv)\n    return 0\n")
    job = TorchrunJob("written_later", ["x"], 1, tmp_path / "later.log")
    assert job.wait(120) == 0, (tmp_path / "later.log").read_text()
    assert "LATER ['x']" in (tmp_path / "later.log").read_text()
    assert job.proc.server_pid == warm.proc.server_pid


def test_an_idle_server_is_given_back_and_jobs_asked_as_it_goes_each_start(tmp_path, monkeypatch):
    """Its client closes a server idle for IDLE_EXIT_S, under the lock a request takes: a job
    asked just before, as or after that moment starts, on that server or a new one."""
    monkeypatch.setattr(fork_server, "IDLE_EXIT_S", 0.3)
    env = {"OMP_NUM_THREADS": "3"}  # servers of this test's own
    first = TorchrunJob("timeit", ["-n", "1", "-r", "1", "pass"], 1, tmp_path / "first.log", env=env)
    assert first.wait(120) == 0
    psutil.Process(first.proc.server_pid).wait(60)  # given back: it exits
    servers = set()
    for i in range(5):
        job = TorchrunJob("timeit", ["-n", "1", "-r", "1", "pass"], 1, tmp_path / f"job{i}.log", env=env)
        assert job.wait(120) == 0, (tmp_path / f"job{i}.log").read_text()
        servers.add(job.proc.server_pid)
        time.sleep(0.15 * i)  # idle 0 to 0.6 s: before, about and after the limit
    assert len(servers) > 1  # some jobs found their server given back and got a new one

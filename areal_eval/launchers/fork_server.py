"""A process that imports torch and transformers once and forks the agent of each torchrun job.

Every forked-rank job (:mod:`areal_eval.launchers.forked_ranks`) started as a fresh interpreter
pays 5-9 CPU-seconds of imports before its agent does anything. A process that starts many jobs
(a flow evaluating checkpoint after checkpoint without warm workers, a warm slot restarted after
a fault, a test run) starts them from a fork server instead: a child of its own that has done
those imports and forks one agent per job, in a fraction of a second.

What a job gets is what :class:`subprocess.Popen` would have given it: its own session (so a
timeout or a kill takes its whole process group), its own environment, working directory, CPU
cores, priority and output pipe, and death with its owner: the server dies with the process that
started it (``PR_SET_PDEATHSIG``), and each agent with the server, so ``kill -9`` of a flow
still leaves nothing running. ``ps`` shows a job's own command line (written over the room the
server's leaves for it) and its name (``ps -o comm``, ``top``), e.g. ``worker-agent``.

What the imports read from the environment when they ran (OpenMP's thread count, glibc's heap
settings, Hugging Face's offline switches, ...) cannot change in a fork, so a server serves only
jobs whose environment equals its own but for what is read later (:data:`LATE_KEYS`); a job
that differs gets a server of its own. ``AREAL_EVAL_FORK_SERVER=0`` starts every job as a fresh interpreter.

    python -m areal_eval.launchers.fork_server FD ROOM   (started by :func:`spawn`, FD its socket)
"""

from __future__ import annotations

import collections
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

ENABLE_ENV = "AREAL_EVAL_FORK_SERVER"
"""``0``: every torchrun job is a fresh interpreter, as ``subprocess.Popen`` starts it."""

LATE_KEYS = frozenset(
    {
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHINDUCTOR_CACHE_DIR",  # set by torch itself in a process that compiled
        "PYTEST_CURRENT_TEST",
        "AREAL_EVAL_INJECT_FAULT",
        "AREAL_EVAL_NNODES",
        "AREAL_EVAL_NODE_RANK",
        "AREAL_EVAL_MASTER_ADDR",
        "AREAL_EVAL_MASTER_PORT",
        "AREAL_EVAL_NPROC_PER_NODE",
    }
)
LATE_PREFIXES = ("AWS_", "MLFLOW_", "PREFECT_", "WANDB_", "SLURM_", "NCCL_", "GLOO_")
"""Environment variables read when a job runs, not when torch and transformers are imported:
jobs whose environments differ only in these share a server (the job's own values are what it
reads). The server's own environment, which ``/proc/PID/environ`` shows for every process it
forks, is the first such job's, without them. ``CUDA_VISIBLE_DEVICES`` is not among them, though
nothing reads it before a job runs: what ``/proc`` shows of a job's devices stays true."""


def _late(key: str) -> bool:
    return key in LATE_KEYS or key.startswith(LATE_PREFIXES)


IDLE_EXIT_S = 120.0
"""A server with no job running or asked for this long is closed by its client (it then exits),
giving its memory back. The client decides, under the lock a request takes: a server that left on
its own could leave with a request already sent to it."""

MAX_MESSAGE = 1 << 20

COMMAND_LINE_ROOM = " " * 4096
"""The server's last argument: room for each job's own command line, written over it."""


def enabled() -> bool:
    return os.environ.get(ENABLE_ENV, "1") != "0"


class ForkedProcess:
    """A job's agent, forked by a server: the part of :class:`subprocess.Popen` the launcher
    uses. It is returned at once; until the server has forked it (the first job of a server
    waits for its imports), :attr:`pid` waits and :meth:`poll` says it is running."""

    def __init__(self, args: list[str], stdout, write_fd: int, server_pid: int):
        self.args, self.stdout, self.server_pid = args, stdout, server_pid
        self.returncode: int | None = None
        self._pid: int | None = None
        self._write_fd: int | None = write_fd  # kept until forked, to say so if it never is
        self._started, self._ended = threading.Event(), threading.Event()

    @property
    def pid(self) -> int | None:
        """The agent's pid (its process group's id); None if its server died before forking it."""
        self._started.wait()
        return self._pid

    def _start(self, pid: int) -> None:
        self._pid = pid
        self._close_write_end()
        self._started.set()

    def _never_started(self, why: str) -> None:
        try:
            os.write(self._write_fd, f"{why}\n".encode())
        except OSError:
            pass
        self._close_write_end()
        self._end(1)
        self._started.set()

    def _close_write_end(self) -> None:
        if self._write_fd is not None:
            os.close(self._write_fd)
            self._write_fd = None

    def _end(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
        self._ended.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode


class ForkServer:
    """The client's side of one server: starts it, asks it for jobs, and learns how they end."""

    def __init__(self, env: dict[str, str]):
        self.env = env
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.pending: collections.deque[ForkedProcess] = collections.deque()  # in the order asked
        self.jobs: dict[int, ForkedProcess] = {}
        self.lock = threading.Lock()
        self.alive = True
        self.idle_since = time.monotonic()
        self.proc: subprocess.Popen | None = None
        started = threading.Event()
        # The kernel sends PR_SET_PDEATHSIG when the *thread* that forked ends: the server is
        # started from a thread that lives as long as it does.
        threading.Thread(target=self._own, args=(theirs, started), name="fork-server", daemon=True).start()
        started.wait()
        theirs.close()
        threading.Thread(target=self._listen, name="fork-server-replies", daemon=True).start()

    def _own(self, theirs: socket.socket, started: threading.Event) -> None:
        from areal_eval.launchers.process_control import die_with_parent, libc_prctl

        libc_prctl()  # looked up before the fork: the child must not dlopen
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "areal_eval.launchers.fork_server", str(theirs.fileno()), COMMAND_LINE_ROOM],
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,  # its jobs get pipes of their own; its own errors go to stderr
                pass_fds=[theirs.fileno()],
                start_new_session=True,
                preexec_fn=lambda: die_with_parent(signal.SIGKILL),
            )
        finally:
            started.set()
        self.proc.wait()

    def _listen(self) -> None:
        while True:
            try:
                raw = self.sock.recv(MAX_MESSAGE)
            except OSError:
                raw = b""
            if not raw:
                break
            message = json.loads(raw)
            with self.lock:
                if "pid" in message:  # the server forks in the order asked, and says so before any exit
                    job = self.pending.popleft()
                    self.jobs[message["pid"]] = job
                    job._start(message["pid"])
                elif message["exit"] in self.jobs:
                    self.jobs.pop(message["exit"])._end(message["code"])
                    if not self.busy:
                        self._idle()
        with self.lock:
            self.alive = False
            for job in self.pending:
                job._never_started(
                    f"areal-eval: the fork server (pid {self.server_pid}) ended before it started this job"
                )
            for job in self.jobs.values():  # its agents die with it
                job._end(-signal.SIGKILL)
            self.pending.clear()
            self.jobs.clear()

    @property
    def server_pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def spawn(self, args: list[str], env: dict[str, str], *, nice: int = 0, cpus: set[int] | None = None):
        """Ask for an agent running ``args`` (``python -m areal_eval.launchers.forked_ranks`` and
        its arguments); None if the server is gone."""
        read, write = os.pipe()
        request = {"command": args, "env": env, "cwd": os.getcwd(), "nice": nice, "cpus": sorted(cpus or ())}
        with self.lock:
            if self.alive:
                try:
                    socket.send_fds(self.sock, [json.dumps(request).encode()], [write])
                except OSError:
                    self.alive = False
            if not self.alive:
                os.close(read)
                os.close(write)
                return None
            job = ForkedProcess(args, os.fdopen(read, "rb"), write, self.server_pid)
            self.pending.append(job)
            self.idle_since = None
            return job

    @property
    def busy(self) -> bool:
        return bool(self.pending or self.jobs)

    def _idle(self) -> None:
        """(Under the lock.) Close the server once it stays idle for :data:`IDLE_EXIT_S`."""
        self.idle_since = since = time.monotonic()
        timer = threading.Timer(IDLE_EXIT_S, lambda: self.close_if_idle(since))
        timer.daemon = True
        timer.start()

    def close_if_idle(self, since: float | None) -> bool:
        """Close the server if it has been idle since ``since`` (no job asked of it since then);
        whether it was closed."""
        with self.lock:  # one hold: no job can be asked of it between the look and the close
            if self.busy or self.idle_since is None or self.idle_since != since:
                return False
            self.alive = False
        self._hang_up()
        return True

    def close(self) -> None:
        """The server exits once its jobs have ended."""
        with self.lock:
            self.alive = False
        self._hang_up()

    def _hang_up(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


_servers: dict[frozenset, ForkServer] = {}
_servers_lock = threading.Lock()


def spawn(args: list[str], env: dict[str, str], *, nice: int = 0, cpus: set[int] | None = None):
    """A :class:`ForkedProcess` running ``args`` with ``env``, from this process's server for that
    environment (started if needed); None where a fork server cannot serve it (then start it
    with :class:`subprocess.Popen`)."""
    if not enabled() or args[1:3] != ["-m", "areal_eval.launchers.forked_ranks"] or args[0] != sys.executable:
        return None
    key = frozenset((k, v) for k, v in env.items() if not _late(k))
    with _servers_lock:
        for _ in range(2):  # the server chosen was closed as idle just now: a new one
            server = _servers.get(key)
            if server is None or not server.alive:
                for other_key, other in list(_servers.items()):  # idle ones for other environments
                    if not other.alive or other.close_if_idle(other.idle_since):
                        del _servers[other_key]
                server = _servers[key] = ForkServer(dict(key))
            job = server.spawn(args, env, nice=nice, cpus=cpus)
            if job is not None:
                return job
    return None


# The server's side. It stays single-threaded, so that every fork is safe.


def _run_job(request: dict, out_fd: int, sock: socket.socket, session_fd: int) -> None:
    """In the forked child: become the job, as a fresh ``python -m ...forked_ranks`` would be."""
    code = 1
    try:
        sock.close()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.setsid()
        os.close(session_fd)  # tells the server its session exists
        from areal_eval.launchers import forked_ranks
        from areal_eval.launchers.process_control import die_with_parent, lower_priority, name_process, set_command_line

        die_with_parent()
        if request["cpus"]:
            os.sched_setaffinity(0, set(request["cpus"]))
        if request["nice"]:
            lower_priority(request["nice"])
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        os.close(null)
        os.close(out_fd)
        os.environ.clear()
        os.environ.update(request["env"])
        os.environ.setdefault(*forked_ranks.NVML_CHECK)  # as a fresh agent sets it
        os.chdir(request["cwd"])
        sys.path[0] = request["cwd"]  # as ``python -m`` would have it
        import importlib

        importlib.invalidate_caches()  # modules written since the server started
        set_command_line(request["command"])  # what ``ps`` shows: the job's, not the server's
        args = request["command"][3:]
        sys.argv = [forked_ranks.__file__, *args]
        module = args[args.index("-m") + 1] if "-m" in args else ""
        name_process(f"{module.rsplit('.', 1)[-1]}-agent")
        forked_ranks.main(args)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        try:
            import atexit

            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve(sock: socket.socket) -> None:
    import selectors

    from areal_eval.launchers import forked_ranks

    forked_ranks.warm_up()
    for module in forked_ranks.JOB_MODULES:
        try:
            forked_ranks.warm_up(module)
        except ImportError:  # a job that needs it imports it, and fails, as a fresh one would
            pass
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    running: set[int] = set()
    closed = False
    while not (closed and not running):  # closed by the client (IDLE_EXIT_S), or the client died
        for key, _ in selector.select(timeout=5.0):
            if key.fileobj is sock:
                message, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 1)
                if not message:
                    closed = True
                    selector.unregister(sock)
                    continue
                session_r, session_w = os.pipe()
                pid = os.fork()
                if pid == 0:
                    os.close(session_r)
                    _run_job(json.loads(message), fds[0], sock, session_w)
                os.close(fds[0])
                os.close(session_w)
                os.read(session_r, 1)  # until its session exists: a kill of its group right after reaches it
                os.close(session_r)
                running.add(pid)
                sock.send(json.dumps({"pid": pid}).encode())
            else:
                os.read(wake_r, 512)
        while running:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            running.discard(pid)
            if not closed:
                try:
                    sock.send(json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)}).encode())
                except OSError:
                    closed = True


if __name__ == "__main__":
    serve(socket.socket(fileno=int(sys.argv[1])))

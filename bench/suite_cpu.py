"""Where the test suite's CPU goes: each Python process it starts, by kind and by test.

    .venv/bin/python bench/suite_cpu.py [--top 15] -- bash scripts/test.sh -q

Runs the command with a hook in this environment's site-packages (a ``.pth`` file, removed
afterwards) that appends each exiting Python process's own CPU seconds (a forked-rank agent's
include its ranks', which exit without running hooks), its command line, its parent's and the
test it ran under (``PYTEST_CURRENT_TEST``, inherited) to a file. The whole command's CPU comes
from ``RUSAGE_CHILDREN``; what no hook saw (processes killed outright, Ray's and Slurm's
daemons, W&B's service, vLLM's environment, Chromium) is the difference; a thread that reads
``/proc`` twice a second names it, by the processes started after this one (so run it alone).
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path

HOOK = """import atexit, json, os, sys

def _areal_eval_cpu_audit():
    try:
        t = os.times()
        with open({log!r}, "a") as f:
            argv = " ".join(sys.argv)[:300]
            try:
                with open(f"/proc/{{os.getppid()}}/cmdline", "rb") as p:
                    parent = p.read().replace(b"\\0", b" ").decode(errors="replace")[:300]
            except OSError:
                parent = ""
            if "execnet.gateway_base" in sys.modules:  # a pytest-xdist lane: its argv is just "-c"
                argv = "pytest lane " + argv
            cpu = t.user + t.system
            if "forked_ranks" in argv:  # its ranks are forks that exit without atexit hooks
                cpu += t.children_user + t.children_system
            f.write(json.dumps({{"argv": argv, "parent": parent, "cpu": cpu,
                                "test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]}}) + "\\n")
    except Exception:
        pass

atexit.register(_areal_eval_cpu_audit)
"""

KINDS = [
    ("pytest lanes", ("pytest lane ", "exec(eval(")),
    ("fork servers (their imports, done once for the jobs they fork)", ("fork_server",)),
    ("evaluation job (agent and forked ranks)", ("evaluation.worker", "worker-rank", "worker-agent")),
    ("training job (agent and forked ranks)", ("areal_eval.train ", "train-rank", "train-agent")),
    ("Prefect flow run", ("prefect/engine", "prefect.engine")),
    ("Prefect worker", ("prefect worker",)),
    ("prefect server start", ("prefect server start",)),
    ("the lanes' Prefect test servers", ("prefect.server.api.server",)),
    ("prefect CLI", ("bin/prefect",)),
    ("train-and-evaluate command", ("flows/train_and_evaluate", "flows.train_and_evaluate")),
    ("examples' training loops", ("examples/", "examples.")),
    ("vLLM's engine processes", ("VLLM", "EngineCore")),
    ("Ray: daemons, agents, workers", ("ray",)),
    ("MLflow servers", ("mlflow",)),
    ("Slurm's daemons and steps", ("slurmctld", "slurmd", "slurmstepd", "munged", "srun", "sbatch")),
    ("W&B's service", ("wandb-core",)),
    ("Chromium", ("chrom",)),
]
"""Kinds of process, by the first whose marker is in a process's command line: as the hook sees
it (``sys.argv``, paths) or as ``/proc`` shows it (its name, then ``-m`` modules)."""


def kind_of(command: str) -> str:
    return next((kind for kind, markers in KINDS if any(m in command for m in markers)), "other")


class ProcSampler(threading.Thread):
    """Each process started after this one, its own CPU as last read from ``/proc`` (what a
    process spends after its last reading, or in one that lives under half a second, is missed)."""

    def __init__(self):
        super().__init__(daemon=True)
        self.tick = os.sysconf("SC_CLK_TCK")
        self.since = self._starttime(os.getpid())
        self.cpu: dict[int, tuple[str, float]] = {}
        self.done = threading.Event()

    @staticmethod
    def _starttime(pid: int) -> int:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat[stat.rindex(")") + 2 :].split()[19])

    def run(self):
        while not self.done.wait(0.5):
            for entry in Path("/proc").iterdir():
                if not entry.name.isdigit():
                    continue
                try:
                    stat = (entry / "stat").read_text()
                    fields = stat[stat.rindex(")") + 2 :].split()
                    if int(fields[19]) < self.since:
                        continue
                    command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                    comm = stat[stat.index("(") + 1 : stat.rindex(")")]
                except (OSError, ValueError):
                    continue
                pid = int(entry.name)
                if not command.strip() and pid in self.cpu:  # exited: a zombie's command line is empty
                    command = self.cpu[pid][0].split(" ", 1)[-1]
                self.cpu[pid] = (f"{comm} {command}"[:300], (int(fields[11]) + int(fields[12])) / self.tick)


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def by_kind(rows) -> dict:
    """``(command, CPU-s)`` rows summed by :func:`kind_of`, with how many processes each."""
    kinds, counts = collections.Counter(), collections.Counter()
    for command, seconds in rows:
        kind = kind_of(command)
        kinds[kind] += seconds
        counts[kind] += 1
    return {k: {"cpu_s": round(v, 1), "processes": counts[k]} for k, v in kinds.most_common()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=15, help="tests shown, by the CPU of what they started")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command (e.g. bash scripts/test.sh -q)")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to measure after --")
    log = Path(tempfile.mkdtemp(prefix="suite-cpu-")) / "processes.jsonl"
    site = Path(sysconfig.get_paths()["purelib"])
    module, pth = site / "_areal_eval_cpu_audit.py", site / "zz_areal_eval_cpu_audit.pth"
    module.write_text(HOOK.format(log=str(log)))
    pth.write_text("import _areal_eval_cpu_audit\n")
    start = time.monotonic()
    sampler = ProcSampler()
    sampler.start()
    try:
        code = subprocess.run(command).returncode
    finally:
        sampler.done.set()
        pth.unlink()
        module.unlink()
    wall, total = time.monotonic() - start, children_cpu_s()
    rows = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    tests = collections.Counter()
    for row in rows:
        if kind_of(row["argv"]) != "pytest lanes":
            tests[row["test"] or "(outside a test)"] += row["cpu"]
    seen = sum(row["cpu"] for row in rows)
    result = {
        "command": " ".join(command),
        "exit_code": code,
        "wall_s": round(wall, 1),
        "cpu_s": round(total, 1),
        "cores_busy": round(total / wall, 2),
        "cpu_by_kind": by_kind((row["argv"], row["cpu"]) for row in rows),
        "cpu_unseen_s": round(total - seen, 1),
        "cpu_sampled_by_kind": by_kind(sampler.cpu.values()),
        "cpu_by_test": {t: round(v, 1) for t, v in tests.most_common(args.top)},
    }
    result["processes_log"] = str(log)
    sampled = log.with_name("sampled.jsonl")
    sampled.write_text("".join(json.dumps({"command": c, "cpu": v}) + "\n" for c, v in sampler.cpu.values()))
    result["sampled_log"] = str(sampled)
    print(json.dumps(result))
    sys.exit(code)


if __name__ == "__main__":
    main()

"""Where the test suite's CPU goes: each Python process it starts, by kind and by test.

    .venv/bin/python bench/suite_cpu.py [--top 15] -- bash scripts/test.sh -q

Runs the command with a hook in this environment's site-packages (a ``.pth`` file, removed
afterwards) that appends each exiting Python process's own CPU seconds (a forked-rank agent's
include its ranks', which exit without running hooks), its command line, its parent's and the
test it ran under (``PYTEST_CURRENT_TEST``, inherited) to a file. The whole command's CPU comes
from ``RUSAGE_CHILDREN``; what no hook saw (processes killed outright, Ray's and Slurm's
daemons, W&B's service, vLLM's environment, Chromium) is the difference. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import collections
import json
import resource
import subprocess
import sys
import sysconfig
import tempfile
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
    ("evaluation job (agent and forked ranks)", "evaluation.worker"),
    ("training job (agent and forked ranks)", "areal_eval.train"),
    ("Prefect flow run", "prefect/engine"),
    ("Prefect worker", "prefect worker"),
    ("prefect CLI or server", "bin/prefect"),
    ("train-and-evaluate command", "flows/train_and_evaluate"),
    ("examples' training loops", "examples/"),
    ("pytest lanes", "pytest lane "),
    ("fork servers (their imports, done once for the jobs they fork)", "launchers/fork_server"),
]


def kind_of(argv: str) -> str:
    return next((kind for kind, marker in KINDS if marker in argv), "other")


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


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
    try:
        code = subprocess.run(command).returncode
    finally:
        pth.unlink()
        module.unlink()
    wall, total = time.monotonic() - start, children_cpu_s()
    rows = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    kinds, counts, tests = collections.Counter(), collections.Counter(), collections.Counter()
    for row in rows:
        kinds[kind_of(row["argv"])] += row["cpu"]
        counts[kind_of(row["argv"])] += 1
        if kind_of(row["argv"]) != "pytest lanes":
            tests[row["test"] or "(outside a test)"] += row["cpu"]
    seen = sum(kinds.values())
    result = {
        "command": " ".join(command),
        "exit_code": code,
        "wall_s": round(wall, 1),
        "cpu_s": round(total, 1),
        "cores_busy": round(total / wall, 2),
        "cpu_by_kind": {k: {"cpu_s": round(v, 1), "processes": counts[k]} for k, v in kinds.most_common()},
        "cpu_unseen_s": round(total - seen, 1),
        "cpu_by_test": {t: round(v, 1) for t, v in tests.most_common(args.top)},
    }
    result["processes_log"] = str(log)
    print(json.dumps(result))
    sys.exit(code)


if __name__ == "__main__":
    main()

"""What a vLLM engine's start costs on the CPU, with its engine core in processes of its own
(vLLM's default, and what a torchrun rank must use) against in the calling process.

    .venv-vllm/bin/python bench/vllm_engine_start.py [--rounds 2] [--model models/smollm2-135m-instruct]

Each start is a fresh interpreter that imports vLLM and starts an engine as the vllm backend
does (float32, eager, 1 GiB of KV cache), in turns: ``VLLM_ENABLE_V1_MULTIPROCESSING`` 1, then
0. vLLM's CPU platform starts its engine core and worker by ``spawn``, so each imports vLLM
again. Reports the wall time of the import and of the start, and the CPU of the whole tree
(``RUSAGE_CHILDREN``). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

START = """
import json, sys, time

def main():
    started = time.monotonic()
    from vllm import LLM
    imported = time.monotonic()
    LLM(model=sys.argv[1], dtype="float32", seed=0, enforce_eager=True, disable_log_stats=True,
        kv_cache_memory_bytes=1 << 30)
    print(json.dumps({"import_s": imported - started, "start_s": time.monotonic() - imported}), flush=True)

if __name__ == "__main__":  # vLLM spawns its engine core, which imports this module again
    main()
"""


def one_start(model: Path, multiprocessing: bool, script: Path) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": str(int(multiprocessing)), "VLLM_CONFIGURE_LOGGING": "0"}
    command = [sys.executable, str(script), str(model)]
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "cpu_s": cpu}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "smollm2-135m-instruct")
    args = parser.parse_args()
    script = Path(os.environ.get("TMPDIR", "/tmp")) / f"vllm-engine-start-{os.getpid()}.py"
    script.write_text(START)
    runs: dict[str, list[dict]] = {"own_processes": [], "in_process": []}
    try:
        for _ in range(args.rounds):
            runs["own_processes"].append(one_start(args.model, True, script))
            runs["in_process"].append(one_start(args.model, False, script))
    finally:
        script.unlink()
    summary = {
        name: {key: round(statistics.median(r[key] for r in rs), 2) for key in ("import_s", "start_s", "cpu_s")}
        for name, rs in runs.items()
    }
    own, inproc = summary["own_processes"], summary["in_process"]
    print(
        json.dumps(
            {
                "benchmark": "vllm_engine_start",
                "model": str(args.model),
                "rounds": args.rounds,
                **summary,
                "start_ratio": round(own["start_s"] / inproc["start_s"], 2),
                "cpu_ratio": round(own["cpu_s"] / inproc["cpu_s"], 2),
            }
        )
    )


if __name__ == "__main__":
    main()

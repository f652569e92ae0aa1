"""A training job that writes its ``done`` row, then never exits (a rank stuck tearing down);
with ``--exit CODE``, one that fails after it instead; with ``--no-done``, one that hangs
before it (after printing ``hanging``)."""

import json
import os
import time


def main(argv: list[str]) -> int:
    if os.environ.get("RANK", "0") == "0" and "--no-done" not in argv:
        with open(argv[0], "a") as fh:
            fh.write(json.dumps({"step": 1, "done": True}) + "\n")
    if "--exit" in argv:
        return int(argv[argv.index("--exit") + 1])
    print("hanging", flush=True)
    time.sleep(3600)
    return 0

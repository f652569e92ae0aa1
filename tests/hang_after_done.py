"""A training job that writes its ``done`` row, then never exits (a rank stuck tearing down)."""

import json
import time


def main(argv: list[str]) -> int:
    with open(argv[0], "a") as fh:
        fh.write(json.dumps({"step": 1, "done": True}) + "\n")
    time.sleep(3600)
    return 0

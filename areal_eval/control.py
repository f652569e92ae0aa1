"""Control from the orchestrator to training: a stop request as a file in the run directory.

A file, not an RPC: training needs no server, survives an orchestrator restart, and the
request is visible to anyone looking at the run directory.
"""

from __future__ import annotations

import json
import time
from pathlib import Path


class StopSignal:
    def __init__(self, path: str | Path):
        self.path = Path(path)

    def request(self, reason: str) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"reason": reason, "time": time.time()}))
        tmp.replace(self.path)

    def requested(self) -> str | None:
        """The stop reason, or None. Cheap enough to call every step (one stat)."""
        if not self.path.exists():
            return None
        try:
            return json.loads(self.path.read_text())["reason"]
        except (OSError, ValueError, KeyError):
            return "stop requested"

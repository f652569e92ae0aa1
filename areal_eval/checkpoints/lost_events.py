"""Who evaluates a checkpoint whose event never reached the server: the trainer's warning names it.

The evaluation service catches up the runs it serves once it reconnects; it marks each one in
its run directory (``evaluation-service.json``, touched while it lives). Any other run waits for
a ``sweep-checkpoints`` deployment whose store holds it, at its next scheduled run. The publisher
learns the sweeps from the server while the server answers (plain HTTP, no Prefect client), so
that it can still name them when it does not.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import socket
import threading
import time
import urllib.request
from pathlib import Path

from areal_eval import jsonl
from areal_eval.checkpoints.store import is_s3

SERVICE_FILE = "evaluation-service.json"
SERVICE_BEAT_S = 60.0
"""How often the service touches its marks."""
SWEEP_FLOW = "sweep-checkpoints"


def mark_served(run_root: Path) -> None:
    """The evaluation service serves the run in ``run_root`` (and touches the mark while it lives)."""
    jsonl.write_json(run_root / SERVICE_FILE, {"pid": os.getpid(), "host": socket.gethostname()})


def unmark_served(run_root: Path) -> None:
    (run_root / SERVICE_FILE).unlink(missing_ok=True)


def serving_service(run_root: Path) -> dict | None:
    """The live service that serves this run (its pid and host), if any: a mark touched lately."""
    mark = run_root / SERVICE_FILE
    try:
        if time.time() - mark.stat().st_mtime > 3 * SERVICE_BEAT_S:
            return None  # a service that died without removing it
    except OSError:
        return None
    found = jsonl.read_json(mark, None)
    return found if isinstance(found, dict) else None


class ServedRuns:
    """The runs an evaluation service serves, marked in their directories while it lives."""

    def __init__(self, beat_s: float = SERVICE_BEAT_S):
        self._roots: set[Path] = set()
        self._stop = threading.Event()
        self._beat_s = beat_s

    def add(self, manifest: str) -> None:
        """Mark the run of ``manifest`` served (a local run: S3 runs have no directory to mark)."""
        root = None if is_s3(manifest) else Path(manifest).resolve().parent
        if root is None or root in self._roots:
            return
        try:
            mark_served(root)
        except OSError:
            return  # a directory the service may not write: trainers are told of the sweep instead
        self._roots.add(root)

    def _beat(self) -> None:
        while not self._stop.wait(self._beat_s):
            for root in list(self._roots):
                try:
                    mark_served(root)
                except OSError:
                    pass  # a run directory removed: nothing to say there

    def __enter__(self) -> ServedRuns:
        threading.Thread(target=self._beat, name="served-runs", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for root in self._roots:
            unmark_served(root)


@dataclasses.dataclass(frozen=True)
class Sweep:
    """A ``sweep-checkpoints`` deployment, as the server described it."""

    name: str
    """``sweep-checkpoints/<deployment>``."""
    store: str
    schedules: tuple[str, ...] = ()
    """Its active schedules, as words (``cron */30 * * * *``, ``every 1800 s``)."""
    next_runs: tuple[float, ...] = ()
    """The expected start times of its scheduled runs (epoch seconds), soonest first."""

    def covers(self, manifest: str) -> bool:
        """The sweep looks at this run: its store is the run's directory or holds it."""
        if is_s3(manifest) or is_s3(self.store):
            run = manifest.rsplit("/", 1)[0]
            return self.store.rstrip("/") in (run, run.rsplit("/", 1)[0])
        run = Path(manifest).resolve().parent
        return Path(self.store).resolve() in (run, run.parent)


def _post(api_url: str, path: str, body: dict, timeout_s: float):
    request = urllib.request.Request(
        api_url.rstrip("/") + path, json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read())


def _schedule_words(schedule: dict) -> str:
    if schedule.get("cron"):
        return f"cron {schedule['cron']}"
    if schedule.get("interval"):
        return f"every {schedule['interval']:.0f} s"
    return f"rrule {schedule.get('rrule', '?')}"


def find_sweeps(api_url: str, timeout_s: float = 2.0) -> list[Sweep]:
    """The server's ``sweep-checkpoints`` deployments, their active schedules and next runs.
    Raises what the server's API raises."""
    deployments = _post(api_url, "/deployments/filter", {"flows": {"name": {"any_": [SWEEP_FLOW]}}}, timeout_s)
    sweeps = []
    for d in deployments:
        active = () if d.get("paused") else tuple(s for s in d.get("schedules") or [] if s.get("active"))
        upcoming = _post(
            api_url,
            "/flow_runs/filter",
            {
                "deployments": {"id": {"any_": [d["id"]]}},
                "flow_runs": {"state": {"type": {"any_": ["SCHEDULED"]}}},
                "sort": "EXPECTED_START_TIME_ASC",
                "limit": 5,
            },
            timeout_s,
        )
        starts = [datetime.datetime.fromisoformat(r["expected_start_time"]).timestamp() for r in upcoming]
        sweeps.append(
            Sweep(
                f"{SWEEP_FLOW}/{d['name']}",
                str((d.get("parameters") or {}).get("store", "")),
                tuple(_schedule_words(s["schedule"]) for s in active),
                tuple(starts) if active else (),
            )
        )
    return sweeps


def who_evaluates(manifest: str, sweeps: list[Sweep] | None, now: float | None = None) -> str:
    """What evaluates a checkpoint of ``manifest`` whose event was lost, in words: the service
    that serves the run, else the sweep whose store holds it (with its next time), else what to
    run. ``sweeps``: what the server said of its sweeps (None: it never answered)."""
    if not is_s3(manifest) and (service := serving_service(Path(manifest).resolve().parent)):
        return (
            f"the evaluation service serving this run (pid {service.get('pid')} on {service.get('host')}) "
            "evaluates it from the manifest once it reconnects"
        )
    if sweeps is None:
        return "a sweep-checkpoints run whose store holds this run evaluates it from the manifest"
    now = time.time() if now is None else now
    for sweep in (s for s in sweeps if s.covers(manifest)):
        if upcoming := [t for t in sweep.next_runs if t > now]:
            at = datetime.datetime.fromtimestamp(upcoming[0]).astimezone()
            return f"{sweep.name} evaluates it from the manifest at its next run, {at:%H:%M %Z}"
        if sweep.schedules:
            return f"{sweep.name} evaluates it from the manifest at its next run ({', '.join(sweep.schedules)})"
        return f"{sweep.name} would, but its schedule is paused: run `prefect deployment run {sweep.name}`"
    store = str(Path(manifest).resolve().parent) if not is_s3(manifest) else manifest.rsplit("/", 1)[0]
    name = sweeps[0].name if sweeps else f"{SWEEP_FLOW}/every-30-minutes"
    return f'no sweep\'s store holds this run: run `prefect deployment run {name} --params \'{{"store": "{store}"}}\'`'

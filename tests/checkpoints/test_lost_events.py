"""What a trainer whose checkpoint event was lost is told will evaluate the checkpoint. The
server's side of it (its sweeps, read back over HTTP) is in tests/flows/test_published_checkpoints.py,
and a live service's mark through a server restart in tests/flows/test_server_faults.py."""

import os
import time

from areal_eval.checkpoints.lost_events import SERVICE_FILE, ServedRuns, Sweep, serving_service, who_evaluates


def test_a_service_marks_the_runs_it_serves_while_it_lives_and_a_dead_ones_mark_is_ignored(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    manifest = str(run / "manifest.jsonl")
    with ServedRuns(beat_s=0.05) as served:
        served.add(manifest)
        served.add("s3://bucket/runs/other/manifest.jsonl")  # nothing to mark
        assert serving_service(run)["pid"] == os.getpid()
        assert "evaluation service serving this run (pid" in who_evaluates(manifest, [])
        os.utime(run / SERVICE_FILE, (time.time() - 3600, time.time() - 3600))
        time.sleep(0.5)  # the beat touches it again
        assert serving_service(run) is not None
    assert not (run / SERVICE_FILE).exists()
    (run / SERVICE_FILE).write_text('{"pid": 1, "host": "gone"}')
    os.utime(run / SERVICE_FILE, (time.time() - 3600, time.time() - 3600))  # its service died
    assert serving_service(run) is None


def test_the_sweep_whose_store_holds_the_run_is_named_with_its_next_run_or_what_to_run(tmp_path):
    store = tmp_path / "runs"
    manifest = str(store / "mine" / "manifest.jsonl")
    now = time.time()
    later = Sweep("sweep-checkpoints/every-30-minutes", str(store), ("cron */30 * * * *",), (now - 60, now + 600))
    said = who_evaluates(manifest, [later], now=now)
    assert said.startswith("sweep-checkpoints/every-30-minutes evaluates it from the manifest at its next run, ")
    assert time.strftime("%H:%M", time.localtime(now + 600)) in said
    unscheduled = Sweep("sweep-checkpoints/every-30-minutes", str(store / "mine"), ("cron */30 * * * *",))
    assert who_evaluates(manifest, [unscheduled], now=now).endswith("at its next run (cron */30 * * * *)")
    paused = Sweep("sweep-checkpoints/nightly", str(store))
    assert "its schedule is paused: run `prefect deployment run sweep-checkpoints/nightly`" in who_evaluates(
        manifest, [paused]
    )
    elsewhere = Sweep("sweep-checkpoints/every-30-minutes", str(tmp_path / "other"), ("cron */30 * * * *",))
    said = who_evaluates(manifest, [elsewhere])
    assert said.startswith("no sweep's store holds this run") and f'"store": "{store / "mine"}"' in said
    assert who_evaluates(manifest, None).startswith("a sweep-checkpoints run whose store holds this run")
    on_s3 = Sweep("sweep-checkpoints/every-30-minutes", "s3://bucket/runs", ("cron */30 * * * *",))
    assert on_s3.covers("s3://bucket/runs/mine/manifest.jsonl") and not on_s3.covers("s3://bucket/other/manifest.jsonl")

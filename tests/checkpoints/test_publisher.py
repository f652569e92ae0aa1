"""Publishing checkpoints from a training loop outside the flow: local and S3 stores, and the
event posted over HTTP (to a loopback receiver standing where the Prefect API would be)."""

import boto3

from areal_eval.checkpoints.manifest import Manifest
from areal_eval.checkpoints.publisher import CHECKPOINT_SAVED, flush_events, publish_checkpoint
from areal_eval.checkpoints.store import S3Config


def written_checkpoint(tmp_path):
    directory = tmp_path / "ckpt" / "step-40"
    directory.mkdir(parents=True)
    (directory / "model.safetensors").write_bytes(b"weights" * 100)
    (directory / "config.json").write_text("{}")
    return directory


def test_publish_local_appends_the_manifest_then_posts_the_event(tmp_path, webhook):
    directory = written_checkpoint(tmp_path)
    event = publish_checkpoint(
        directory,
        tmp_path / "manifest.jsonl",
        "run-7",
        40,
        epoch=1,
        epoch_step=15,
        train_metrics={"loss": 0.4},
        api_url=webhook.url,
    )
    assert Manifest(tmp_path / "manifest.jsonl").events() == [event]
    assert flush_events() == 0
    assert event.uri == str(directory) and {f.name: f.size for f in event.files} == {
        "config.json": 2,
        "model.safetensors": 700,
    }
    [request] = [r for r in webhook.requests if r["path"] == "/events"]  # (and it asks for the sweeps)
    [posted] = request["json"]
    assert posted["event"] == CHECKPOINT_SAVED and posted["resource"]["areal.source"] == "publisher"
    assert posted["payload"]["global_step"] == 40 and posted["payload"]["manifest"] == str(tmp_path / "manifest.jsonl")


def test_publish_to_s3_uploads_verifies_and_mirrors_the_manifest(s3_server, s3_bucket, tmp_path, webhook):
    directory = written_checkpoint(tmp_path)
    event = publish_checkpoint(
        directory,
        tmp_path / "manifest.jsonl",
        "run-7",
        40,
        store=f"s3://{s3_bucket}/ckpts",
        s3=S3Config(endpoint_url=s3_server.url),
        api_url=webhook.url,
        final=True,  # (training is over: nothing polls S3 for evaluation's requests after this test)
    )
    assert event.uri == f"s3://{s3_bucket}/ckpts/run-7/step-40"
    keys = {
        o["Key"] for o in boto3.client("s3", endpoint_url=s3_server.url).list_objects_v2(Bucket=s3_bucket)["Contents"]
    }
    assert keys == {
        "ckpts/run-7/step-40/model.safetensors",
        "ckpts/run-7/step-40/config.json",
        "ckpts/run-7/manifest.jsonl",
    }
    assert flush_events() == 0
    assert [r for r in webhook.requests if r["path"] == "/events"][0]["json"][0]["payload"][
        "manifest"
    ] == f"s3://{s3_bucket}/ckpts/run-7/manifest.jsonl"


def test_a_directory_without_model_weights_is_refused_naming_it_and_nothing_is_announced(tmp_path):
    import pytest

    from areal_eval.checkpoints.manifest import CheckpointError

    directory = tmp_path / "step-8"
    directory.mkdir()
    (directory / "config.json").write_text("{}")
    (directory / "optimizer.pt").write_bytes(b"state")
    with pytest.raises(CheckpointError, match=f"{directory}: no model weights"):
        publish_checkpoint(directory, tmp_path / "manifest.jsonl", "run-7", 8)
    assert not (tmp_path / "manifest.jsonl").exists()


def test_a_missing_valid_data_path_is_refused_at_publish_before_the_manifest(tmp_path):
    import pytest

    directory = written_checkpoint(tmp_path)
    with pytest.raises(FileNotFoundError, match="valid_data: .*nowhere.jsonl: no such validation data file"):
        publish_checkpoint(directory, tmp_path / "manifest.jsonl", "run-7", 40, valid_data=tmp_path / "nowhere.jsonl")
    assert not (tmp_path / "manifest.jsonl").exists()


def test_an_event_api_that_is_down_or_hangs_is_a_warning_and_the_manifest_line_stands(tmp_path, caplog):
    import socket
    import threading

    from tests.helpers import free_port

    hanging = socket.create_server(("127.0.0.1", 0))  # accepts, never answers
    accepted = []
    threading.Thread(target=lambda: accepted.append(hanging.accept()), daemon=True).start()
    directory = written_checkpoint(tmp_path)
    for step, api_url in (
        (40, f"http://127.0.0.1:{free_port()}/api"),
        (80, f"http://127.0.0.1:{hanging.getsockname()[1]}/api"),
    ):
        event = publish_checkpoint(
            directory, tmp_path / "manifest.jsonl", "run-7", step, api_url=api_url, event_timeout_s=1
        )
        assert event.global_step == step
    assert flush_events(10) == 0  # each posted, or failed within its timeout
    hanging.close()
    assert [e.global_step for e in Manifest(tmp_path / "manifest.jsonl").events()] == [40, 80]
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 2 and all("is in the manifest, but its event did not reach" in w for w in warned), warned


def test_training_does_not_wait_for_an_event_api_that_hangs(tmp_path, caplog):
    """The event is posted from a thread of its own: publish returns while the API still holds the
    request, and the event arrives once the API answers. A publish that waited for the answer
    would give up after its timeout and warn."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    answer, received = threading.Event(), []

    class Slow(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path.endswith("/events"):  # (the publisher also asks for the server's sweeps)
                received.append(body)
            answer.wait(120)
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    api_url = f"http://127.0.0.1:{server.server_address[1]}/api"
    directory = written_checkpoint(tmp_path)
    for step in (40, 80):
        publish_checkpoint(directory, tmp_path / "manifest.jsonl", "run-7", step, api_url=api_url, event_timeout_s=60)
    assert not answer.is_set() and [e.global_step for e in Manifest(tmp_path / "manifest.jsonl").events()] == [40, 80]
    answer.set()
    assert flush_events(60) == 0
    server.shutdown()
    assert [r[0]["payload"]["global_step"] for r in received] == [40, 80]  # in publish order
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


def test_the_final_publish_waits_for_its_event_even_where_exit_hooks_never_run(tmp_path, webhook):
    """A child forked by multiprocessing ends without running exit hooks: its final publish
    posts the event before it returns."""
    import multiprocessing

    directory = written_checkpoint(tmp_path)
    publish_checkpoint(directory, tmp_path / "manifest.jsonl", "run-7", 40, api_url=webhook.url)
    assert flush_events() == 0  # the parent's sending thread is up before the fork

    def trainer():
        publish_checkpoint(directory, tmp_path / "manifest.jsonl", "run-7", 80, final=True, api_url=webhook.url)

    child = multiprocessing.get_context("fork").Process(target=trainer)
    child.start()
    child.join(60)
    assert child.exitcode == 0
    events = [r for r in webhook.requests if r["path"] == "/events"]
    assert [r["json"][0]["payload"]["global_step"] for r in events] == [40, 80]


def test_bad_arguments_are_refused_before_anything_is_uploaded_or_announced(tmp_path):
    import pytest
    import torch

    directory = written_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="global_step: a non-negative integer, got '40'"):
        publish_checkpoint(directory, tmp_path / "manifest.jsonl", "run-7", "40")
    with pytest.raises(ValueError, match=r"train_metrics\['loss'\]: a tensor or array of 4 elements"):
        publish_checkpoint(directory, tmp_path / "manifest.jsonl", "run-7", 40, train_metrics={"loss": torch.ones(4)})
    assert not (tmp_path / "manifest.jsonl").exists()
    event = publish_checkpoint(
        directory, tmp_path / "manifest.jsonl", "run-7", 40, train_metrics={"loss": torch.tensor(0.5)}
    )
    assert Manifest(tmp_path / "manifest.jsonl").events()[0].train_metrics == {"loss": 0.5} == event.train_metrics


def test_a_payload_that_names_no_checkpoint_is_told_apart_with_the_reason():
    from areal_eval.checkpoints.publisher import payload_problem

    good = {"run_id": "r", "global_step": 40, "manifest": "/runs/r/manifest.jsonl"}
    assert payload_problem(good) is None
    assert payload_problem([]) == "the payload is list, not an object"
    assert payload_problem({**good, "global_step": "40"}) == "global_step '40' is not a non-negative integer"
    assert payload_problem({**good, "global_step": True}) == "global_step True is not a non-negative integer"
    assert payload_problem({"global_step": 40}) == "manifest None is not a path or URI"

"""The S3 checkpoint store against a real S3-compatible server (moto, its own process), with
faults injected by a proxy in front of it."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import boto3
import pytest

from areal_eval.checkpoints.manifest import CheckpointError, FileEntry, Manifest, describe_files
from areal_eval.checkpoints.saving import CheckpointWriter
from areal_eval.checkpoints.store import (
    LocalStore,
    S3Config,
    S3Store,
    StorageConfig,
    content_key,
    open_store,
    safe_relative_key,
    split_s3_uri,
)
from tests.helpers import NoTokenizer, TinyModel
from tests.s3_servers import FaultProxy

SMALL_PARTS = {"multipart_threshold_mb": 5, "multipart_chunksize_mb": 5, "max_concurrency": 4}


def staged_checkpoint(tmp_path, big_mb=12):
    directory = tmp_path / "staged" / "global_step_00000010"
    directory.mkdir(parents=True)
    (directory / "model.safetensors").write_bytes(os.urandom(big_mb << 20))
    (directory / "config.json").write_text('{"hidden_size": 8}')
    return directory, describe_files(directory)


def test_upload_retries_injected_faults_then_download_is_verified_once_per_cache(s3_server, s3_bucket, tmp_path):
    proxy = FaultProxy(s3_server.url, kinds=("503", "500", "reset"), every=3, limit=6)
    store = S3Store(f"s3://{s3_bucket}/runs/r1", S3Config(endpoint_url=proxy.url, **SMALL_PARTS), keep_local_copy=False)
    staged, files = staged_checkpoint(tmp_path)
    uri = store.publish(staged, files)

    assert uri == f"s3://{s3_bucket}/runs/r1/global_step_00000010"
    assert {kind for kind, _, _ in proxy.injected} == {"503", "500", "reset"}  # each retried by botocore
    assert any("uploadId" in path for _, path in proxy.requests)  # the big file went up in parts
    assert not staged.exists()  # the staging copy is gone once the upload is verified
    head = boto3.client("s3", endpoint_url=s3_server.url).head_object(
        Bucket=s3_bucket, Key="runs/r1/global_step_00000010/model.safetensors"
    )
    assert head["ContentLength"] == 12 << 20 and head["Metadata"]["sha256"] == files[1].sha256

    local = store.fetch(uri, files, tmp_path / "cache")
    assert local == tmp_path / "cache" / content_key(files)
    assert describe_files(local) == files
    gets = sum(1 for method, _ in proxy.requests if method == "GET")
    assert store.fetch(uri, files, tmp_path / "cache") == local
    assert sum(1 for method, _ in proxy.requests if method == "GET") == gets  # cached: not fetched again
    proxy.stop()


def test_threads_fetching_one_checkpoint_at_once_get_the_same_verified_copy(s3_server, s3_bucket, tmp_path):
    import threading

    store = S3Store(f"s3://{s3_bucket}/runs/r2", S3Config(endpoint_url=s3_server.url))
    staged, files = staged_checkpoint(tmp_path, big_mb=1)
    uri = store.publish(staged, files)
    barrier, fetched = threading.Barrier(4), []

    def fetch():
        barrier.wait()
        fetched.append(store.fetch(uri, files, tmp_path / "cache"))

    threads = [threading.Thread(target=fetch) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert fetched == [tmp_path / "cache" / content_key(files)] * 4
    assert describe_files(fetched[0]) == files
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [content_key(files)]  # no partial left


def test_failed_upload_never_enters_the_manifest(s3_server, s3_bucket, tmp_path):
    proxy = FaultProxy(s3_server.url, kinds=("500",), every=1, limit=10**6, methods=("PUT",))
    store = S3Store(f"s3://{s3_bucket}/r", S3Config(endpoint_url=proxy.url, max_attempts=2))
    manifest = Manifest(tmp_path / "manifest.jsonl")
    writer = CheckpointWriter(TinyModel(), NoTokenizer(), tmp_path / "ckpt", manifest, "run-1", store=store)
    writer.save(0, 0, 0, {})
    with pytest.raises(CheckpointError, match="InternalError"):
        writer.close()
    assert manifest.events() == []
    proxy.stop()


def test_a_crash_mid_upload_announces_nothing(s3_server, s3_bucket, tmp_path):
    # The uploading process is killed while a part of the weights is in flight (the proxy stalls it).
    proxy = FaultProxy(s3_server.url, kinds=("stall",), every=1, limit=1, methods=("PUT",), match="partNumber=")
    staged, _ = staged_checkpoint(tmp_path, big_mb=6)
    script = textwrap.dedent(f"""
        from pathlib import Path
        from areal_eval.checkpoints.saving import CheckpointWriter
        from areal_eval.checkpoints.manifest import describe_files
        from areal_eval.checkpoints.store import S3Config, S3Store
        from areal_eval.checkpoints.manifest import CheckpointEvent, Manifest
        store = S3Store("s3://{s3_bucket}/r", S3Config(endpoint_url="{proxy.url}", **{SMALL_PARTS!r}))
        staged = Path("{staged}")
        uri = store.publish(staged, describe_files(staged))
        Manifest("{tmp_path / "manifest.jsonl"}").append(CheckpointEvent("run", uri, 0, 0, 10, 0.0, {{}}))
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], env={**os.environ, "PYTHONPATH": os.getcwd()})
    deadline = time.monotonic() + 60
    while not proxy.injected and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert proxy.injected, "the upload never reached the proxy"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "manifest.jsonl").exists()
    listed = boto3.client("s3", endpoint_url=s3_server.url).list_objects_v2(Bucket=s3_bucket, Prefix="r/")
    assert "model.safetensors" not in str(listed.get("Contents", []))  # no complete weights object either
    proxy.stop()


def upload_directly(s3_server, bucket, tmp_path):
    store = S3Store(f"s3://{bucket}/r", S3Config(endpoint_url=s3_server.url))
    staged, files = staged_checkpoint(tmp_path, big_mb=1)
    return store, store.publish(staged, files), files, boto3.client("s3", endpoint_url=s3_server.url)


def test_corrupt_and_truncated_objects_are_refused_with_the_object_named(s3_server, s3_bucket, tmp_path):
    store, uri, files, client = upload_directly(s3_server, s3_bucket, tmp_path)
    key = "r/global_step_00000010/model.safetensors"
    client.put_object(Bucket=s3_bucket, Key=key, Body=os.urandom(1 << 20))  # same size, other bytes
    with pytest.raises(CheckpointError, match=rf"{uri}/model.safetensors: sha256 differs"):
        store.fetch(uri, files, tmp_path / "cache")
    client.put_object(Bucket=s3_bucket, Key=key, Body=b"short")
    with pytest.raises(CheckpointError, match=rf"{uri}/model.safetensors: size 5 != recorded {1 << 20}"):
        store.fetch(uri, files, tmp_path / "cache")
    client.delete_object(Bucket=s3_bucket, Key=key)
    with pytest.raises(CheckpointError, match=rf"{uri}/model.safetensors: download failed"):
        store.fetch(uri, files, tmp_path / "cache")
    assert not list((tmp_path / "cache").iterdir())  # nothing half-fetched is left to be loaded


def test_keys_that_escape_their_prefix_are_refused(s3_server, s3_bucket, tmp_path):
    store, uri, files, _ = upload_directly(s3_server, s3_bucket, tmp_path)
    for name in ("../../escape", "/etc/passwd", "a/../../b", "a\\b", ""):
        with pytest.raises(CheckpointError, match="refused key"):
            safe_relative_key(name)
    evil = (FileEntry("../../../escape.txt", files[0].size, files[0].sha256),)
    with pytest.raises(CheckpointError, match="refused key"):
        store.fetch(uri, evil, tmp_path / "cache" / "deep")
    assert not list(tmp_path.rglob("escape.txt"))
    with pytest.raises(CheckpointError, match="refused key"):
        split_s3_uri(f"s3://{s3_bucket}/r/../other/global_step_00000010")
    with pytest.raises(ValueError, match="storage.checkpoint_uri"):
        StorageConfig(checkpoint_uri="/local/dir")


def test_delete_and_listing(s3_server, s3_bucket, tmp_path):
    store, uri, files, client = upload_directly(s3_server, s3_bucket, tmp_path)
    manifest = tmp_path / "manifest.jsonl"
    manifest.write_text("")
    store.mirror(manifest, "manifest.jsonl")
    assert S3Store(f"s3://{s3_bucket}", S3Config(endpoint_url=s3_server.url)).run_prefixes() == ["r"]
    store.delete(uri)
    assert [o["Key"] for o in client.list_objects_v2(Bucket=s3_bucket)["Contents"]] == ["r/manifest.jsonl"]
    assert isinstance(open_store(None), LocalStore) and isinstance(open_store(uri, S3Config()), S3Store)

"""Where published checkpoints live: the run directory, or an S3 prefix through boto3.

Training writes each checkpoint locally first (fast, never blocking the loop), then the store
publishes it: locally that is the directory itself; on S3 it is a concurrent multipart upload
through boto3's transfer manager, verified object by object against the recorded sizes and
sha256 before the checkpoint may enter the manifest. Evaluation workers ``fetch`` a verified
local copy: on S3, into a node-local cache keyed by the checkpoint's content hash.

Credentials come from boto3's standard chain (environment, config files, instance roles) and
are never part of the config, so they cannot leak into params, tags or logs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import tempfile
from pathlib import Path, PurePosixPath

from areal_eval.checkpoints.manifest import CheckpointError, FileEntry, verify_checkpoint
from areal_eval.checkpoints.retention import RetentionConfig

S3_SCHEME = "s3://"
SHA256_METADATA = "sha256"


@dataclasses.dataclass
class S3Config:
    endpoint_url: str | None = None
    """S3-compatible endpoint (MinIO, Ceph, R2, moto); None: boto3's chain, which reads
    ``$AWS_ENDPOINT_URL_S3`` / ``$AWS_ENDPOINT_URL`` and otherwise uses AWS."""
    region_name: str | None = None
    """Region; None: boto3's chain (``$AWS_DEFAULT_REGION``, config file)."""
    max_attempts: int = 10
    """Attempts per request, the first included: 5xx, throttling and connection resets are
    retried with exponential backoff by botocore."""
    retry_mode: str = "standard"
    """botocore retry mode: ``standard``, or ``adaptive`` (adds client-side rate limiting)."""
    multipart_threshold_mb: int = 8
    """Files at least this large go up and down in parts."""
    multipart_chunksize_mb: int = 8
    """Part size of multipart transfers."""
    max_concurrency: int = 8
    """Parallel requests of one store (all files of a checkpoint share them)."""
    connect_timeout_s: float = 10.0
    """Connection timeout per request."""
    read_timeout_s: float = 60.0
    """Read timeout per request (a stalled connection is retried)."""
    control_poll_s: float = 5.0
    """How often a trainer publishing here looks beside its checkpoints for what evaluation asks
    of it (a stop, directives) and sends back its answers, from a thread of its own."""

    def __post_init__(self):
        if not isinstance(self.control_poll_s, (int, float)) or not self.control_poll_s > 0:
            raise ValueError(f"storage.s3.control_poll_s: {self.control_poll_s!r} is not a positive number of seconds")


@dataclasses.dataclass
class StorageConfig:
    checkpoint_uri: str | None = None
    """Where checkpoints are published: None keeps them in the run directory;
    ``s3://bucket/prefix`` uploads each to ``prefix/<run_id>/global_step_N/`` (the manifest and
    the validation data are mirrored beside them, so a sweep can find the run there)."""
    s3: S3Config = dataclasses.field(default_factory=S3Config)
    """boto3 client settings."""
    cache_dir: str | None = None
    """Node-local cache of downloaded checkpoints, keyed by content hash
    (None: ``<work_dir>/checkpoint-cache``)."""
    keep_local_copy: bool = False
    """Keep the local staging copy of a checkpoint after its upload is verified."""
    retention: RetentionConfig = dataclasses.field(default_factory=RetentionConfig)
    """Which published checkpoints to keep (default: all)."""

    def __post_init__(self):
        if self.checkpoint_uri is not None and not is_s3(self.checkpoint_uri):
            raise ValueError(
                f"storage.checkpoint_uri: {self.checkpoint_uri!r} is not s3://bucket/prefix "
                "(leave it unset to keep checkpoints in the run directory)"
            )
        if self.checkpoint_uri is not None:
            split_s3_uri(self.checkpoint_uri)

    def run_root(self, run_id: str) -> str | None:
        """Where a training run's checkpoints go (None: its run directory)."""
        return f"{self.checkpoint_uri.rstrip('/')}/{run_id}" if self.checkpoint_uri else None


def is_s3(uri: str | os.PathLike) -> bool:
    return str(uri).startswith(S3_SCHEME)


def split_s3_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/a/b`` -> (``bucket``, ``a/b``); keys that leave their prefix are refused."""
    if not is_s3(uri):
        raise ValueError(f"{uri}: not an s3:// URI")
    bucket, _, key = uri[len(S3_SCHEME) :].partition("/")
    if not bucket:
        raise ValueError(f"{uri}: no bucket in the URI")
    key = key.strip("/")
    if key:
        safe_relative_key(key, context=uri)
    return bucket, key


def safe_relative_key(name: str, context: str = "") -> str:
    """A relative, normalized object key or file name; ``..``, absolute and empty parts are refused,
    so a manifest or a listing can never make a download write outside its directory."""
    path = PurePosixPath(name)
    if not name or "\\" in name or path.is_absolute() or any(part in ("..", ".", "") for part in name.split("/")):
        raise CheckpointError(f"{context + ': ' if context else ''}refused key {name!r}: it would escape its prefix")
    return str(path)


def content_key(files: tuple[FileEntry, ...]) -> str:
    """A checkpoint's identity by content: equal files, equal key (the download cache's name)."""
    digest = hashlib.sha256()
    for entry in sorted(files, key=lambda f: f.name):
        digest.update(f"{entry.name}\0{entry.size}\0{entry.sha256}\n".encode())
    return digest.hexdigest()[:32]


class LocalStore:
    """Checkpoints stay where training wrote them; fetching is verifying."""

    def publish(self, staged_dir: Path, files: tuple[FileEntry, ...]) -> str:
        return str(Path(staged_dir).resolve())

    def mirror(self, local_file: Path, relative: str) -> None:
        """Nothing to mirror: the run directory is the store."""

    def fetch(self, uri: str, files: tuple[FileEntry, ...], cache_dir: Path) -> Path:
        verify_checkpoint(uri, files)
        return Path(uri)

    def local_path(self, uri: str, files: tuple[FileEntry, ...], cache_dir: Path) -> Path:
        return Path(uri)

    def delete(self, uri: str) -> None:
        shutil.rmtree(uri, ignore_errors=True)


class S3Store:
    """Checkpoints under ``root`` (``s3://bucket/prefix``) on any S3-compatible endpoint."""

    def __init__(self, root: str, cfg: S3Config, keep_local_copy: bool = True):
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        self.root = root.rstrip("/")
        self.keep_local_copy = keep_local_copy
        self.control_poll_s = cfg.control_poll_s
        self.bucket, self.prefix = split_s3_uri(self.root)
        self.client = boto3.client(
            "s3",
            endpoint_url=cfg.endpoint_url,
            region_name=cfg.region_name,
            config=Config(
                retries={"max_attempts": cfg.max_attempts, "mode": cfg.retry_mode},
                connect_timeout=cfg.connect_timeout_s,
                read_timeout=cfg.read_timeout_s,
                max_pool_connections=max(10, cfg.max_concurrency),
            ),
        )
        self.transfer_config = TransferConfig(
            multipart_threshold=cfg.multipart_threshold_mb << 20,
            multipart_chunksize=cfg.multipart_chunksize_mb << 20,
            max_concurrency=cfg.max_concurrency,
            use_threads=True,
        )

    def _key(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *(safe_relative_key(p, self.root) for p in parts)) if p)

    def _uri(self, key: str) -> str:
        return f"{S3_SCHEME}{self.bucket}/{key}"

    def publish(self, staged_dir: Path, files: tuple[FileEntry, ...]) -> str:
        """Upload every file (multipart, concurrently), then verify each object's size and sha256."""
        from boto3.s3.transfer import create_transfer_manager

        staged_dir = Path(staged_dir)
        with create_transfer_manager(self.client, self.transfer_config) as manager:
            futures = [
                manager.upload(
                    str(staged_dir / f.name),
                    self.bucket,
                    self._key(staged_dir.name, f.name),
                    extra_args={"Metadata": {SHA256_METADATA: f.sha256}},
                )
                for f in files
            ]
            for future in futures:
                future.result()
        for entry in files:
            key = self._key(staged_dir.name, entry.name)
            head = self.client.head_object(Bucket=self.bucket, Key=key)
            if head["ContentLength"] != entry.size or head.get("Metadata", {}).get(SHA256_METADATA) != entry.sha256:
                raise CheckpointError(
                    f"{self._uri(key)}: uploaded object has size {head['ContentLength']} and sha256 "
                    f"{head.get('Metadata', {}).get(SHA256_METADATA)}, recorded {entry.size} / {entry.sha256}"
                )
        if not self.keep_local_copy:
            shutil.rmtree(staged_dir, ignore_errors=True)
        return self._uri(self._key(staged_dir.name))

    def mirror(self, local_file: Path, relative: str) -> None:
        """Copy a small run file (manifest, validation data) beside the checkpoints."""
        self.write(relative, Path(local_file).read_bytes())

    def local_path(self, uri: str, files: tuple[FileEntry, ...], cache_dir: Path) -> Path:
        return Path(cache_dir) / content_key(files)

    def fetch(self, uri: str, files: tuple[FileEntry, ...], cache_dir: Path) -> Path:
        """A verified local copy of the checkpoint at ``uri``, downloaded once per cache."""
        from boto3.s3.transfer import create_transfer_manager

        bucket, key = split_s3_uri(uri)
        target = self.local_path(uri, files, cache_dir)
        if target.is_dir():
            verify_checkpoint(target, files, shown_as=uri)
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        # This fetch's own directory: another thread or process may be fetching the same content.
        partial = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.", suffix=".partial"))
        try:
            with create_transfer_manager(self.client, self.transfer_config) as manager:
                futures = [
                    (f, manager.download(bucket, f"{key}/{safe_relative_key(f.name, uri)}", str(partial / f.name)))
                    for f in files
                ]
                for entry, future in futures:
                    try:
                        future.result()
                    except Exception as exc:  # a missing object names itself, not a generic 404
                        raise CheckpointError(f"{uri}/{entry.name}: download failed: {exc}") from exc
            verify_checkpoint(partial, files, shown_as=uri)
            partial.rename(target)
        except OSError:
            if not target.is_dir():  # a concurrent fetch of the same content may have won the rename
                raise
        finally:
            shutil.rmtree(partial, ignore_errors=True)
        return target

    def delete(self, uri: str) -> None:
        bucket, key = split_s3_uri(uri)
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=bucket, Prefix=key + "/"):
            objects = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if objects:
                self.client.delete_objects(Bucket=bucket, Delete={"Objects": objects, "Quiet": True})

    def read(self, relative: str) -> bytes | None:
        """A small run file beside the checkpoints, or None when there is none."""
        try:
            return self.client.get_object(Bucket=self.bucket, Key=self._key(relative))["Body"].read()
        except self.client.exceptions.NoSuchKey:
            return None

    def write(self, relative: str, body: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self._key(relative), Body=body)

    def download_file(self, relative: str, target: Path) -> None:
        target.parent.mkdir(parents=True, exist_ok=True)
        self.client.download_file(self.bucket, self._key(relative), str(target), Config=self.transfer_config)

    def run_prefixes(self) -> list[str]:
        """Run prefixes directly under the root that hold a mirrored manifest."""
        found = []
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=(self.prefix + "/") if self.prefix else ""):
            for obj in page.get("Contents", []):
                relative = obj["Key"][len(self.prefix) + 1 if self.prefix else 0 :]
                if relative.endswith("/manifest.jsonl") and relative.count("/") == 1:
                    found.append(safe_relative_key(relative.split("/")[0], self.root))
                elif relative == "manifest.jsonl":
                    found.append("")
        return sorted(found)


def open_store(root: str | None, s3: S3Config | None = None, keep_local_copy: bool = True):
    """The store for a checkpoint URI or root: S3 for ``s3://``, the local file system otherwise."""
    if root is not None and is_s3(root):
        return S3Store(root, s3 or S3Config(), keep_local_copy)
    return LocalStore()

"""S3 checkpoint transfers against plain boto3, and training blocked by saves with S3 on.

    .venv/bin/python bench/s3_transfer.py [--file-mb 64] [--files 2] [--rounds 3] [--steps 150]

Starts moto's S3 server on loopback (its own process). Upload: the store's ``publish``
(transfer manager, every file of the checkpoint in flight at once, then each object verified)
against ``client.upload_file`` per file with boto3's defaults, which is what ``aws s3 cp`` does.
Download: the store's ``fetch`` (concurrent, then sha256-verified) against ``client.download_file``
per file. A and B alternate. Then the same training job with checkpoints on S3 and on local
disk, alternating: the share of training time the loop was blocked by checkpoint saves, and
training throughput. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from common import ROOT, emit, median, prepared_run

TEST_S3 = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}


def make_checkpoint(directory: Path, files: int, file_mb: int) -> None:
    directory.mkdir(parents=True)
    for i in range(files):
        (directory / f"model-{i:05d}-of-{files:05d}.safetensors").write_bytes(os.urandom(file_mb << 20))
    (directory / "config.json").write_text('{"architectures": ["LlamaForSequenceClassification"]}')


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def transfer_round(url: str, bucket: str, staged: Path, work: Path, n: int) -> dict:
    import boto3

    from areal_eval.checkpoints.manifest import describe_files
    from areal_eval.checkpoints.store import S3Config, S3Store

    files = describe_files(staged)
    client = boto3.client("s3", endpoint_url=url)
    store = S3Store(f"s3://{bucket}/store-{n}", S3Config(endpoint_url=url), keep_local_copy=True)
    plain_prefix = f"plain-{n}/{staged.name}"

    def plain_upload():
        for f in files:
            client.upload_file(str(staged / f.name), bucket, f"{plain_prefix}/{f.name}")

    def plain_download():
        target = work / f"plain-{n}"
        target.mkdir()
        for f in files:
            client.download_file(bucket, f"{plain_prefix}/{f.name}", str(target / f.name))

    uri_holder = {}
    t = {
        "plain_up": timed(plain_upload),
        "store_up": timed(lambda: uri_holder.setdefault("uri", store.publish(staged, files))),
        "plain_down": timed(plain_download),
        "store_down": timed(lambda: store.fetch(uri_holder["uri"], files, work / f"cache-{n}")),
    }
    for prefix in (plain_prefix, uri_holder["uri"]):
        store.delete(prefix if prefix.startswith("s3://") else f"s3://{bucket}/{prefix}")
    shutil.rmtree(work / f"plain-{n}")
    shutil.rmtree(work / f"cache-{n}")
    return t


def train_blocked(cfg, run) -> dict:
    from areal_eval.launchers.local import TorchrunJob

    for stale in (run.manifest, run.train_log):
        stale.unlink(missing_ok=True)
    shutil.rmtree(run.checkpoints, ignore_errors=True)
    job = TorchrunJob("areal_eval.train", ["--config", str(run.train_config)], cfg.train.nproc, run.logs / "train.log")
    job.wait(900)
    job.raise_for_status("training")
    rows = [json.loads(line) for line in run.train_log.read_text().splitlines()]
    done = rows[-1]
    samples = max(r["step"] for r in rows) * cfg.train.batch_size * cfg.train.nproc
    return {"blocked_share": done["blocked_s"] / done["train_s"], "samples_per_s": samples / done["train_s"]}


def main() -> None:
    import sys

    sys.path.insert(0, str(ROOT))
    import boto3

    from tests.s3_servers import MotoServer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--file-mb", type=int, default=64)
    parser.add_argument("--files", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=150)
    args = parser.parse_args()
    os.environ.update(TEST_S3)
    work = Path(tempfile.mkdtemp(prefix="bench-s3-"))
    server = MotoServer(work / "moto.log")
    try:
        boto3.client("s3", endpoint_url=server.url).create_bucket(Bucket="bench")
        staged = work / "staged" / "global_step_00000100"
        make_checkpoint(staged, args.files, args.file_mb)
        rounds = [transfer_round(server.url, "bench", staged, work, n) for n in range(args.rounds)]
        mb = args.files * args.file_mb

        storage = {"checkpoint_uri": "s3://bench/checkpoints", "s3": {"endpoint_url": server.url}}
        cfg_s3, run_s3 = prepared_run("s3-on", work, train={"max_steps": args.steps}, storage=storage)
        cfg_local, run_local = prepared_run("s3-off", work, train={"max_steps": args.steps})
        s3_runs, local_runs = [], []
        for _ in range(2):  # alternate: this machine is noisy
            s3_runs.append(train_blocked(cfg_s3, run_s3))
            local_runs.append(train_blocked(cfg_local, run_local))
    finally:
        server.stop()
    rate = lambda key: median(mb / r[key] for r in rounds)  # noqa: E731
    emit(
        {
            "benchmark": "s3_transfer",
            "checkpoint_mb": mb,
            "files": args.files + 1,
            "rounds": args.rounds,
            "upload_mb_s_store": round(rate("store_up"), 1),
            "upload_mb_s_plain_boto3": round(rate("plain_up"), 1),
            "upload_ratio_store_plain": round(rate("store_up") / rate("plain_up"), 3),
            "download_mb_s_store": round(rate("store_down"), 1),
            "download_mb_s_plain_boto3": round(rate("plain_down"), 1),
            "download_ratio_store_plain": round(rate("store_down") / rate("plain_down"), 3),
            "note": "store timings include verification: HEAD per object after upload, "
            "sha256 of every file after download",
            "train_steps": args.steps,
            "blocked_share_s3": round(max(r["blocked_share"] for r in s3_runs), 5),
            "blocked_share_local": round(max(r["blocked_share"] for r in local_runs), 5),
            "train_samples_per_s_s3": round(median(r["samples_per_s"] for r in s3_runs), 1),
            "train_samples_per_s_local": round(median(r["samples_per_s"] for r in local_runs), 1),
        }
    )
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

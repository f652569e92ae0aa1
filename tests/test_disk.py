"""A full disk, named (``areal_eval.disk``), on a real tmpfs filled to the last block."""

import contextlib

import pytest

from areal_eval.disk import DiskFull, is_disk_full, named_if_disk_full
from tests.helpers import tmpfs

pytestmark = pytest.mark.integration  # mounts a file system


def fill(disk):
    with contextlib.suppress(OSError), (disk / "filler").open("wb") as out:
        while True:
            out.write(b"x" * 4096)
            out.flush()


def test_an_opaque_error_on_a_full_disk_is_named_and_one_with_room_is_left_alone(tmp_path):
    opaque = RuntimeError("worker wrote no result")
    assert named_if_disk_full(opaque, tmp_path, "the evaluation of step 3") is opaque
    with tmpfs(tmp_path / "disk", "64k") as disk:
        fill(disk)
        named = named_if_disk_full(opaque, disk, "the evaluation of step 3")
    assert isinstance(named, DiskFull) and is_disk_full(named) and named.__cause__ is opaque
    assert str(named) == f"no space left on the disk of {disk} while writing the evaluation of step 3 ({opaque})"
    assert named_if_disk_full(named, tmp_path, "anything") is named

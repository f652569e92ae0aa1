import subprocess
import sys

import psutil
import pytest

from areal_eval.launchers.process_control import lower_priority
from tests.helpers import alive, wait_for

pytestmark = pytest.mark.integration


def test_lower_priority_reaches_the_scheduler():
    # Run in a new session as the launcher does: with autogroup on, the group's nice is what counts.
    out = subprocess.run(
        ["sh", "-c", "nice; cat /proc/self/autogroup 2>/dev/null || true"],
        start_new_session=True,
        preexec_fn=lambda: lower_priority(7),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\n")
    assert out[0] == "7"
    if out[1]:
        assert out[1].endswith("nice 7")


def test_a_process_dies_with_its_parent_and_carries_its_name():
    """A parent killed outright (``kill -9``) takes its child along; ``ps`` shows the child's name."""
    child = (
        "from areal_eval.launchers.process_control import die_with_parent, name_process\n"
        "import time; die_with_parent(); name_process('eval-test-child'); print('ready', flush=True); time.sleep(600)"
    )
    parent = (
        f"import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', {child!r}]); "
        "print(p.pid, flush=True); p.wait()"
    )
    outer = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True)
    process = psutil.Process(int(outer.stdout.readline()))
    wait_for(lambda: process.name() == "eval-test-child", 60, "the child to name itself")
    outer.kill()
    outer.wait(10)
    wait_for(lambda: not alive(process), 30, "the child to die")

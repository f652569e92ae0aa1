"""The package installs beside a user's own torch; the project's set-up pins its CPU build."""

import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]


def test_torch_is_a_range_in_the_package_and_pinned_only_in_the_set_ups_constraints():
    # The [project] dependencies' torch line (tomllib is not in Python 3.10).
    [line] = re.findall(r'^\s*"(torch[^"]*)",', (ROOT / "pyproject.toml").read_text(), re.M)
    torch = Requirement(line)
    assert not any(spec.operator == "==" for spec in torch.specifier)
    assert "2.11.0" in torch.specifier  # a user's CUDA torch 2.11 stays
    constraints = (ROOT / "constraints.txt").read_text().splitlines()
    pins = [Requirement(c) for c in constraints if c and not c.startswith("#")]
    # torch, and the Ray the cluster launcher was measured with: both ranges in the package.
    assert [(p.name, str(p.specifier)) for p in pins] == [("torch", "==2.13.0"), ("ray", "==2.60.0")]
    [ray] = re.findall(r'^ray = \["(ray[^"]*)"\]', (ROOT / "pyproject.toml").read_text(), re.M)
    assert not any(spec.operator == "==" for spec in Requirement(ray).specifier)
    assert "-c constraints.txt" in (ROOT / "scripts" / "setup.sh").read_text()


@pytest.mark.integration
def test_pip_resolves_the_package_beside_another_torch_and_installs_no_torch(tmp_path):
    """A user's environment with its own torch (2.11 here, as a CUDA build would be): pip's
    resolver, offline, keeps it and installs the package alone. The package's other
    dependencies come from this project's environment (on the new one's path)."""
    import json
    import subprocess
    import sys
    import sysconfig

    env = tmp_path / "user-env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    python = env / "bin" / "python"
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (Path(site) / "project-env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    users_torch = Path(site) / "torch-2.11.0.dist-info"
    users_torch.mkdir()
    (users_torch / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.11.0\n")
    report = tmp_path / "report.json"
    subprocess.run(
        [python, "-m", "pip", "install", "--dry-run", "--no-index", "--no-build-isolation", "--quiet"]
        + ["--report", str(report), str(ROOT)],
        check=True,
    )
    installs = [i["metadata"]["name"] for i in json.loads(report.read_text())["install"]]
    assert installs == ["areal-eval"]

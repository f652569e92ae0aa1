"""The package installs beside a user's own torch; the project's set-up pins its CPU build."""

import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]


def test_torch_is_a_range_in_the_package_and_pinned_only_in_the_set_ups_constraints():
    # The [project] dependencies' torch line.
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


def test_each_requirement_installed_here_runs_on_the_oldest_python_the_package_admits():
    """``requires-python`` is what the set-up works on: every dependency and extra that this
    environment installed (their versions as resolved here) admits its oldest Python."""
    import importlib.metadata
    import tomllib

    from packaging.specifiers import SpecifierSet

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    admitted = SpecifierSet(project["requires-python"])
    oldest = next(v for v in (f"3.{minor}" for minor in range(8, 20)) if v in admitted)
    requirements = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    refused, checked = [], 0
    for requirement in map(Requirement, requirements):
        if requirement.marker is not None and not requirement.marker.evaluate({"python_version": oldest}):
            continue
        try:
            needs = importlib.metadata.metadata(requirement.name).get("Requires-Python")
        except importlib.metadata.PackageNotFoundError:
            continue  # an extra this environment does not install (vllm: its own environment)
        checked += 1
        if needs and oldest not in SpecifierSet(needs):
            refused.append(f"{requirement.name} needs Python {needs}")
    assert refused == [] and checked >= 20, (oldest, refused)

"""The package installs beside a user's own torch; the project's set-up pins its CPU build."""

import re
from pathlib import Path

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
    assert [(p.name, str(p.specifier)) for p in pins] == [("torch", "==2.13.0")]
    assert "-c constraints.txt" in (ROOT / "scripts" / "setup.sh").read_text()

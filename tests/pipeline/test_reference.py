"""The config reference page is generated from the config classes, and the docs build."""

import subprocess
import sys
from pathlib import Path

import pytest

from areal_eval.pipeline.reference import render

ROOT = Path(__file__).resolve().parents[2]


def test_the_committed_config_reference_is_what_the_config_classes_say():
    page = ROOT / "docs" / "reference" / "config.md"
    assert page.read_text() == render() + "\n", (
        "docs/reference/config.md is stale: "
        ".venv/bin/python -m areal_eval.pipeline.reference > docs/reference/config.md"
    )
    for field in ("`run_name`", "`max_prompt_tokens`", "`webhook_url`", "## `alerts.rules[]`", "## `eval.generation`"):
        assert field in page.read_text()


def test_the_readme_is_a_front_door_and_every_docs_page_is_in_the_site():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = sorted(p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md"))
    assert all(f": {page}" in nav for page in pages), pages
    linked = [p for p in pages if p != "index.md"]
    assert all(f"docs/{page}" in readme for page in linked)


@pytest.mark.integration
def test_the_docs_build_with_every_link_resolved(tmp_path):
    done = subprocess.run(
        [str(Path(sys.executable).with_name("mkdocs")), "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "reference" / "config" / "index.html").exists()

"""The documentation site builds in strict mode (MkDocs, mkdocs.yml): a broken link, a missing anchor or a page
left out of the navigation fails the build, so the site cannot rot unnoticed."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None,
                                reason="mkdocs and mkdocs-material are not installed (the 'docs' extra)")


def build(site: Path, config: Path = ROOT / "mkdocs.yml") -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, NO_MKDOCS_2_WARNING="1"))


def test_the_site_builds_in_strict_mode(tmp_path):
    r = build(tmp_path / "site")
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "site" / "index.html").is_file() and (tmp_path / "site" / "changelog" / "index.html").is_file()
    assert (tmp_path / "site" / "api" / "index.html").is_file()  # the placeholder make docs fills with pdoc's reference


def test_a_broken_link_fails_the_build(tmp_path):
    docs = tmp_path / "docs"
    subprocess.run(["cp", "-r", str(ROOT / "docs"), str(docs)], check=True)
    (docs / "cli.md").write_text((docs / "cli.md").read_text() + "\n[a page that is not there](nowhere.md)\n")
    config = tmp_path / "mkdocs.yml"
    config.write_text((ROOT / "mkdocs.yml").read_text().replace("docs_dir: docs", f"docs_dir: {docs}")
                      .replace("  - docs/hooks.py", f"  - {ROOT / 'docs' / 'hooks.py'}"))
    r = build(tmp_path / "site", config)
    assert r.returncode != 0 and "nowhere.md" in r.stdout + r.stderr

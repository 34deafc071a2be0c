"""The API reference (``make docs``: tests/reference/reference.py over pdoc) builds, opens on the entry points, and documents
every public name of every package, every public submodule, the golden_plan fixture and every CLI command, with
real defaults in its signatures."""
from __future__ import annotations

import importlib
import inspect
import re
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

pytest.importorskip("pdoc", reason="pdoc (the API reference tool) is in the dev extra")
pytest.importorskip("typer", reason="the command pages are generated from the CLI (the cli extra)")

DOCS = Path(__file__).resolve().parent / "reference"
sys.path.insert(0, str(DOCS))
import reference  # noqa: E402


class _Page(HTMLParser):
    """The ids, the links and the text of one HTML page."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: list[str] = []
        self.links: list[str] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if a.get("id"):
            self.ids.append(a["id"])
        if tag == "a" and a.get("href"):
            self.links.append(a["href"])

    def handle_data(self, data):
        self.text.append(data)


def page(root: Path, rel: str) -> _Page:
    p = _Page()
    p.feed((root / rel).read_text())
    return p


def module_page(name: str) -> str:
    return name.replace(".", "/") + ".html"


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("docs")
    reference.render(out)
    return out


def public_names(module) -> list[str]:
    """A module's public names: its ``__all__``, else the functions and classes it defines without a leading ``_``."""
    if hasattr(module, "__all__"):
        return list(module.__all__)
    return [n for n, v in vars(module).items() if not n.startswith("_") and (inspect.isfunction(v) or inspect.isclass(v))
            and getattr(v, "__module__", None) == module.__name__]


def test_the_index_opens_on_the_entry_points(built):
    index = page(built, "index.html")
    text = " ".join(index.text)
    expected = [e for e in reference.ENTRY_POINTS if importlib.util.find_spec(e.rsplit(".", 1)[0]) is not None]
    assert len(expected) >= 4  # plan_transfer, TransferPlan, get_executor, create_worker (and the vLLM spec once it exists)
    hrefs = [h for h in index.links if "#" in h and h.split("#")[1] in {e.rsplit(".", 1)[1] for e in expected}]
    names = [f"{h.split('#')[0][:-5].replace('/', '.')}.{h.split('#')[1]}" for h in hrefs]
    assert list(dict.fromkeys(names)) == expected  # in this order, before anything else links into a page
    for href in hrefs:  # every entry point link lands on its entry
        target, anchor = href.split("#")
        assert anchor in page(built, target).ids, href
    assert text.index("Entry points") < text.index("Packages") < text.index("Command line") < text.index("pytest plugin")
    assert "layout: kvxfer.planner.layout.Layout" in text  # the signature, with its first argument


def test_every_public_name_of_every_package_has_an_entry(built):
    missing = []
    for pkg in reference.packages():
        module = importlib.import_module(pkg)
        ids = set(page(built, module_page(pkg)).ids)
        for name in public_names(module):
            value = getattr(module, name, None)
            if inspect.ismodule(value):
                if not (built / module_page(f"{pkg}.{name}")).is_file():
                    missing.append(f"{pkg}.{name} (its page)")
            elif name not in ids:
                missing.append(f"{pkg}.{name}")
    assert not missing, f"undocumented: {missing}"


def test_every_public_submodule_has_a_page_documenting_its_names(built):
    subs = [m for m in reference.SUBMODULES if reference.exists(m)]
    assert {"kvxfer.planner.presets", "kvxfer.planner.viz", "kvxfer.executors.torch_layout", "kvxfer.executors.config",
            "kvxfer.testing.pytest_plugin"} <= set(subs)
    assert any(m.endswith("file_tier") for m in subs)  # the file tier, wherever it lives
    missing = []
    for name in subs:
        ids = set(page(built, module_page(name)).ids)
        missing += [f"{name}.{n}" for n in public_names(importlib.import_module(name)) if n not in ids]
        parent = name.rsplit(".", 1)[0]
        assert module_page(name).split("/")[-1] in " ".join(page(built, module_page(parent)).links), name
    assert not missing, f"undocumented: {missing}"


def test_signatures_show_real_defaults(built):
    pages = [p for p in built.rglob("*.html")]
    assert not [p.name for p in pages if "PydanticUndefined" in p.read_text()]
    planner = (built / "kvxfer/planner.html").read_text()
    field = re.search(r'id="PlanOptions\.coalesce"[^>]*>(.*?)</div>', planner, re.S)[1]
    assert "True" in field  # a field with a default shows it
    required = re.search(r'id="BlockMapping\.direction"[^>]*>(.*?)</div>', planner, re.S)[1]
    assert "=" not in re.sub(r"<[^>]+>", "", required)  # a required field shows none


def test_the_testing_page_shows_signatures_and_docstrings(built):
    text = (built / "kvxfer/testing.html").read_text()
    entry = re.search(r'<section id="expected_copies">.*?</section>', text, re.S)[0]
    plain = re.sub(r"<[^>]+>", "", entry)
    assert "layout" in plain and "mapping" in plain and "Every piece the transfer must copy" in plain


def test_the_golden_plan_fixture_is_documented(built):
    plugin = page(built, "kvxfer/testing/pytest_plugin.html")
    assert "golden_plan" in plugin.ids and "GoldenPlan" in plugin.ids
    assert "case_or_plan" in " ".join(plugin.text)
    assert plugin.ids.index("golden_plan") < plugin.ids.index("GoldenPlan")  # the fixture first


def test_every_command_has_a_page_with_its_options(built):
    for cmd in reference.cli_commands():
        p = page(built, f"{reference.CLI_FOLDER}/{cmd.page}")
        text = " ".join(p.text)
        assert f"kvxfer {cmd.path}".strip() in text
        for param in cmd.params:
            assert param.names in text, (cmd.path, param.names)
    paths = {c.path for c in reference.cli_commands()}
    assert {"demo", "plan", "diff", "golden check", "golden update", "schema", "run", "bench"} <= paths
    run = (built / reference.CLI_FOLDER / "run.html").read_text()
    seed = re.sub(r"<[^>]+>", " ", re.search(r'<tr id="--seed">(.*?)</tr>', run, re.S)[1]).split()
    assert seed[:3] == ["--seed", "N", "0"]  # a real default, even a falsy one

"""Docs that must stay true: docs/envvars.md is generated from the env table; the README's quick
start is exactly the two commands .ci/run runs; docs/recipes.md examples run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fp_recipes.recipes.env import TABLE, render_markdown

ROOT = Path(__file__).resolve().parents[1]


def test_envvars_doc_is_not_stale():
    doc = (ROOT / "docs" / "envvars.md").read_text()
    assert doc == render_markdown(), (
        "docs/envvars.md is stale: regenerate it with "
        "`python -m fp_recipes env --markdown > docs/envvars.md`")


def test_envvars_doc_lists_every_variable():
    doc = render_markdown()
    for var in TABLE:
        assert f"`{var.name}`" in doc


def _quick_start_commands():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```(?:bash|sh)?\n(.*?)```", section, flags=re.S)
    return [line.strip() for block in blocks for line in block.splitlines()
            if line.strip() and not line.strip().startswith("#")]


def test_readme_quick_start_is_two_commands():
    cmds = _quick_start_commands()
    assert cmds == [
        "pip install torch==2.13.0 && pip install -e . && python -m fp_recipes demo",
        'pip install torch==2.13.0 && pip install -e ".[test]" && python -m pytest -q',
    ]


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    test_cmd = _quick_start_commands()[1]
    lines = [l.strip() for l in ci.splitlines() if l.strip() and not l.strip().startswith("#")]
    assert test_cmd in lines, "`.ci/run` must run the README's test command verbatim"


def test_readme_links_exist():
    readme = (ROOT / "README.md").read_text()
    for link in re.findall(r"\]\(((?:docs|benchmarks|fp_recipes|tests)/[^)#]+)", readme):
        assert (ROOT / link).exists(), link


_BLOCK = re.compile(r"(<!--\s*norun:\s*(?P<why>[^>]*?)\s*-->\s*\n)?```python\n(?P<code>.*?)```", re.S)
DOC_FILES = ["README.md"] + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))


def _python_blocks(path):
    """(code, norun reason or None) of every ```python block; ``<!-- norun: why -->`` just before a block
    marks one that cannot run in CI (it is still compiled)."""
    return [(m.group("code"), m.group("why")) for m in _BLOCK.finditer((ROOT / path).read_text())]


ALL_BLOCKS = [(path, i) for path in DOC_FILES for i in range(len(_python_blocks(path)))]


@pytest.mark.parametrize("path,index", ALL_BLOCKS, ids=[f"{p}[{i}]" for p, i in ALL_BLOCKS])
def test_every_python_block_in_the_docs_runs(path, index, monkeypatch):
    """Every ```python block of README.md and docs/*.md runs as written, on its own, on CPU."""
    import os

    code, norun = _python_blocks(path)[index]
    compiled = compile(code, f"{path}[{index}]", "exec")
    if norun is not None:
        assert norun.strip(), f"{path}[{index}]: a norun marker must say why"
        return  # compiled above: it is valid Python, it just needs what CI lacks (said in the marker)
    for name in [n for n in os.environ if n.startswith(("NVTE_", "FP_RECIPE"))]:
        monkeypatch.delenv(name)  # blocks run in a clean environment; what they set is undone after
    saved = dict(os.environ)
    try:
        exec(compiled, {"__name__": "__doc_example__"})
    finally:
        os.environ.clear()
        os.environ.update(saved)


def test_norun_markers_are_rare():
    marked = [(p, i) for p in DOC_FILES for i, (_, why) in enumerate(_python_blocks(p)) if why is not None]
    assert len(marked) <= 3, marked

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


def _python_blocks(path):
    return re.findall(r"```python\n(.*?)```", (ROOT / path).read_text(), flags=re.S)


@pytest.mark.parametrize("index", range(len(_python_blocks("docs/recipes.md"))))
def test_recipes_doc_examples_run(index, monkeypatch):
    code = _python_blocks("docs/recipes.md")[index]
    exec(compile(code, f"docs/recipes.md[{index}]", "exec"), {"__name__": "__doc_example__"})


@pytest.mark.parametrize("index", range(len(_python_blocks("README.md"))))
def test_readme_examples_run(index):
    code = _python_blocks("README.md")[index]
    exec(compile(code, f"README.md[{index}]", "exec"), {"__name__": "__readme_example__"})

"""The package's shape: no import cycles between its modules, and a root that exports only the public API.

The import graph is read from the source (``ast``), not from ``sys.modules``, so every module counts,
imported by the tests or not. An edge ``A -> B`` means that running A's code imports B: an ``import``
or ``from ... import`` of a module of the package (``from pkg import name`` counts as importing the
submodule ``pkg.name`` when there is one, else ``pkg``), plus each package's ``__init__`` that the
import enters from outside (importing ``fp_recipes.gemm.cublaslt`` from ``fp_recipes.ops.backend`` runs
``fp_recipes/gemm/__init__.py`` first).
"""

from __future__ import annotations

import ast
import pkgutil
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Set

import pytest

import fp_recipes

ROOT = Path(fp_recipes.__file__).resolve().parent

# The public surface of ``import fp_recipes`` (README, docs/recipes.md, docs/modules.md,
# docs/transformer_engine.md use these names); submodules (``fp_recipes.recipe``, TE's recipe module
# name) are not listed. Adding a name here is an API decision.
PUBLIC_API = {
    # recipes
    "Recipe", "Format", "DelayedScaling", "Float8CurrentScaling", "NVFP4BlockScaling", "PerTokenScaling",
    "recipe_from_env",
    # roles and specs
    "QuantizerRole", "QuantizerSpec", "ModuleKind", "TensorKind",
    # autocast
    "autocast", "fp8_autocast", "get_autocast_state",
    # quantized tensors and quantizers
    "QuantizedTensor", "Quantizer", "Float8Tensor", "NVFP4Tensor", "PerTokenTensor", "GroupedTensor",
    "Float8Quantizer", "Float8CurrentScalingQuantizer", "NVFP4Quantizer", "PerTokenQuantizer",
    "GroupedQuantizer", "make_quantizer",
    # functional API
    "quantize", "dequantize", "per_token_cast", "cast_back",
    # modules
    "Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear", "convert_model",
    # CUDA graphs
    "make_graphed_callables",
    # backend
    "backend_info",
}

# Cycles through imports deferred into function bodies that predate this test (each runs only once
# both modules are loaded). A new one fails the test: import one layer down instead (as
# fp_recipes/_extension.py does for the op dispatch and the GEMM launchers).
KNOWN_DEFERRED_CYCLES = [
    {"fp_recipes.recipes", "fp_recipes.recipes.base", "fp_recipes.recipes.env", "fp_recipes.recipes.fp8",
     "fp_recipes.recipes.nvfp4", "fp_recipes.recipes.per_token"},
    # modules/__init__.py re-exports convert_model; convert and hf_moe build fp_recipes modules
    {"fp_recipes.modules", "fp_recipes.integrations.convert", "fp_recipes.integrations.hf_moe"},
]


def _modules() -> Dict[str, tuple]:
    """module name -> (path, is_package) for every .py file of the package."""
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        mods[".".join(parts)] = (path, is_pkg)
    return mods


MODULES = _modules()


def _top_level_imports(body: List[ast.stmt]) -> Iterator[ast.stmt]:
    """Import statements that run when the module is imported (module body, including top-level
    ``if``/``try`` blocks; not ``if TYPE_CHECKING:``, not function or class bodies)."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else None
            if name != "TYPE_CHECKING":
                yield from _top_level_imports(node.body)
            yield from _top_level_imports(node.orelse)
        elif isinstance(node, ast.Try):
            yield from _top_level_imports(node.body)
            for handler in node.handlers:
                yield from _top_level_imports(handler.body)
            yield from _top_level_imports(node.orelse)
            yield from _top_level_imports(node.finalbody)


def _targets(module: str, is_pkg: bool, node: ast.stmt) -> Set[str]:
    """The package modules one import statement loads."""
    names: List[str] = []
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        assert isinstance(node, ast.ImportFrom)
        if node.level:
            base = module.split(".") if is_pkg else module.split(".")[:-1]
            base = base[:len(base) - (node.level - 1)]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        names = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in MODULES else source
                 for alias in node.names]
    out: Set[str] = set()
    for name in names:
        if name.split(".")[0] != "fp_recipes":
            continue
        while name not in MODULES and "." in name:  # ``import fp_recipes.x.y`` of a name inside x.y
            name = name.rsplit(".", 1)[0]
        # the target itself and every package __init__ the import enters from outside
        parts = name.split(".")
        for i in range(2, len(parts) + 1):
            prefix = ".".join(parts[:i])
            if prefix in MODULES and not (module == prefix or module.startswith(prefix + ".")):
                out.add(prefix)
    out.discard(module)
    return out


def import_graph(deferred: bool) -> Dict[str, Set[str]]:
    """module -> modules it imports: at import time only, or (``deferred``) also inside functions."""
    graph: Dict[str, Set[str]] = {}
    for module, (path, is_pkg) in MODULES.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        nodes = ([n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))] if deferred
                 else list(_top_level_imports(tree.body)))
        graph[module] = set().union(*(_targets(module, is_pkg, n) for n in nodes)) if nodes else set()
    return graph


def strongly_connected(graph: Dict[str, Set[str]]) -> List[Set[str]]:
    """Tarjan's strongly connected components with more than one module (each holds a cycle)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    out: List[Set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def find_cycle(graph: Dict[str, Set[str]], within: Set[str]) -> Optional[List[str]]:
    """One cycle inside ``within`` as a path (first module repeated at the end), for the message."""
    start = min(within)
    path, seen = [start], {start}

    def walk(v: str) -> Optional[List[str]]:
        for w in sorted(graph[v] & within):
            if w == start:
                return path + [start]
            if w not in seen:
                seen.add(w)
                path.append(w)
                found = walk(w)
                if found:
                    return found
                path.pop()
        return None

    return walk(start)


def test_the_graph_sees_the_package():
    graph = import_graph(deferred=False)
    assert len(graph) > 50
    assert "fp_recipes.gemm.cublaslt" in graph and "fp_recipes._extension" in graph
    assert "fp_recipes.gemm.cublaslt" in graph["fp_recipes.gemm.grouped"]
    assert "fp_recipes.gemm" in graph["fp_recipes.modules.grouped_linear"]  # the package __init__ it enters
    assert "fp_recipes._extension" in graph["fp_recipes.ops.backend"]
    assert {"fp_recipes.gemm", "fp_recipes.gemm.cublaslt", "fp_recipes.ops.backend"} <= \
        import_graph(deferred=True)["fp_recipes._info"]  # backend_info: above both layers


def test_the_cycle_finder_finds_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert strongly_connected(graph) == [{"a", "b", "c"}]
    assert find_cycle(graph, {"a", "b", "c"}) == ["a", "b", "c", "a"]
    assert strongly_connected({"a": {"b"}, "b": set()}) == []


def test_module_level_imports_are_acyclic():
    graph = import_graph(deferred=False)
    cycles = [find_cycle(graph, comp) for comp in strongly_connected(graph)]
    assert not cycles, "import cycles at module level:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_no_new_cycles_through_deferred_imports():
    """Imports inside functions too: a cycle there is a layering mistake waiting for an import-time use
    (gemm_lt.py and ops/backend.py imported each other that way)."""
    graph = import_graph(deferred=True)
    assert "fp_recipes.ops.backend" not in graph["fp_recipes.gemm.cublaslt"]
    new = [comp for comp in strongly_connected(graph) if not any(comp <= known for known in KNOWN_DEFERRED_CYCLES)]
    assert not new, "new import cycles (deferred imports included):\n" + "\n".join(
        " -> ".join(find_cycle(graph, comp)) for comp in new)
    for comp in strongly_connected(graph):  # the GEMMs and the op dispatch take part in none
        assert not any(m.startswith(("fp_recipes.gemm", "fp_recipes.ops", "fp_recipes._extension")) for m in comp)


def test_no_compatibility_shims_for_the_old_gemm_modules():
    assert not (ROOT / "gemm.py").exists() and not (ROOT / "gemm_lt.py").exists()
    assert (ROOT / "gemm" / "__init__.py").exists()


def test_package_root_exports_only_the_public_surface():
    submodules = {m.name for m in pkgutil.iter_modules(fp_recipes.__path__)}
    public = {name for name in dir(fp_recipes) if not name.startswith("_")}
    assert public - submodules == PUBLIC_API - submodules
    # submodule names the root exports: TE's ``transformer_engine.common.recipe`` module name, and
    # ``autocast`` (the context manager; its module object is callable too, whichever one Python binds)
    assert public & submodules == {"recipe", "autocast"}
    assert "autocast" in PUBLIC_API
    for name in PUBLIC_API:
        assert getattr(fp_recipes, name) is not None
    assert set(fp_recipes.__all__) == PUBLIC_API | {"recipe", "__version__"}


def test_root_imports_nothing_eagerly():
    """``import fp_recipes`` stays cheap: every public name is resolved lazily, and the root module's
    own code imports no other module of the package."""
    assert import_graph(deferred=False)["fp_recipes"] == set()


@pytest.mark.parametrize("package", ["fp_recipes.gemm"])
def test_packaging_finds_the_gemm_package(package):
    """pyproject's ``packages.find`` (``include = ["fp_recipes*"]``) lists the new package."""
    setuptools = pytest.importorskip("setuptools")
    found = setuptools.find_packages(str(ROOT.parent), include=["fp_recipes*"])
    assert package in found

"""The package's shape: imports follow the layer order of docs/architecture.md (no upward import,
e.g. engine -> entrypoints or strategies -> scheduler) and no import loop, not even through a
function-level import (issue #42); both server engine clients implement the EngineClient
protocol."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import cover_vllm

PACKAGE = Path(cover_vllm.__file__).parent

# bottom to top, as in docs/architecture.md ("Layers"); a module may import its own layer and
# the layers below it. The longest matching prefix places a module.
LAYERS = [
    ("foundation", ["cover_vllm.logger", "cover_vllm.outputs", "cover_vllm.cache_refresh",
                    "cover_vllm.config", "cover_vllm.sampling_fields", "cover_vllm.chat",
                    "cover_vllm.text_input", "cover_vllm.device_check", "cover_vllm.inputs",
                    "cover_vllm.step_plan", "cover_vllm.host_transfer",
                    "cover_vllm.tokenizer", "cover_vllm.tasks", "cover_vllm.vllm_args",
                    "cover_vllm.scoring"]),
    # the shared blocks and kernels a family is composed of; they never import a family
    ("layers", ["cover_vllm.layers"]),
    ("model", ["cover_vllm.models", "cover_vllm.attention", "cover_vllm.flops",
               "cover_vllm.scoring.reference"]),
    # SamplingParams checks a request's decoder and its knobs against the strategy registry
    ("strategies", ["cover_vllm.strategies", "cover_vllm.structured_output",
                    "cover_vllm.sampling_params"]),
    ("scheduler", ["cover_vllm.scheduler"]),
    ("worker", ["cover_vllm.worker", "cover_vllm.distributed", "cover_vllm.executor",
                "cover_vllm.reference_decode", "cover_vllm.reference_cache_decode"]),
    ("engine", ["cover_vllm.engine"]),
    ("offline API", ["cover_vllm.llm", "cover_vllm.__init__"]),
    ("applications", ["cover_vllm.eval", "cover_vllm.benchmarks", "cover_vllm.entrypoints.server",
                      "cover_vllm.harness"]),
    ("command line", ["cover_vllm.entrypoints.__init__", "cover_vllm.entrypoints.llm",
                      "cover_vllm.entrypoints.cli", "cover_vllm.entrypoints.cli_types",
                      "cover_vllm.entrypoints.engine_flags", "cover_vllm.entrypoints.serve_cli",
                      "cover_vllm.entrypoints.generate_cli",
                      "cover_vllm.entrypoints.scoring_cli", "cover_vllm.__main__"]),
]


def _modules() -> dict[str, Path]:
    """module name -> file, packages as `pkg.__init__`."""
    root = PACKAGE.parent
    return {".".join(p.relative_to(root).with_suffix("").parts): p
            for p in PACKAGE.rglob("*.py")}


def _target(name: str, modules: dict[str, Path]) -> str:
    """The module an import statement loads (a package means its __init__)."""
    return name if name in modules else f"{name}.__init__"


def _is_type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def _imports(path: Path, modules: dict[str, Path], top_level_only: bool) -> set[str]:
    """The package modules `path` imports (TYPE_CHECKING blocks excluded; with
    `top_level_only`, also every import inside a function: those run later, not at import)."""
    found = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                continue
            if top_level_only and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if (isinstance(child, ast.ImportFrom) and child.level == 0 and child.module
                    and child.module.startswith("cover_vllm")):
                for alias in child.names:       # `from pkg import submodule` loads submodule
                    sub = f"{child.module}.{alias.name}"
                    found.add(sub if sub in modules or f"{sub}.__init__" in modules
                              else child.module)
            elif isinstance(child, ast.Import):
                found.update(a.name for a in child.names if a.name.startswith("cover_vllm"))
            visit(child)

    visit(ast.parse(path.read_text()))
    return {_target(n, modules) for n in found
            if n in modules or f"{n}.__init__" in modules}


def _layer(module: str) -> int:
    best = max(((len(prefix), i) for i, (_, prefixes) in enumerate(LAYERS)
                for prefix in prefixes if module == prefix or module.startswith(prefix + ".")),
               default=None)
    assert best is not None, f"{module} has no layer: add it to LAYERS and docs/architecture.md"
    return best[1]


def test_no_upward_import():
    modules = _modules()
    upward = []
    for name, path in modules.items():
        for target in _imports(path, modules, top_level_only=False):
            if _layer(target) > _layer(name):
                upward.append(f"{name} ({LAYERS[_layer(name)][0]}) imports {target} "
                              f"({LAYERS[_layer(target)][0]})")
    assert not upward, "\n".join(sorted(upward))


@pytest.mark.parametrize("top_level_only", [True, False], ids=["module-level", "any"])
def test_no_import_loop(top_level_only):
    """No loop among module-level imports (it would fail at import), nor through a
    function-level one (a lazy import that only hides a loop: move the shared piece down)."""
    modules = _modules()
    graph = {name: _imports(path, modules, top_level_only=top_level_only) - {name}
             for name, path in modules.items()}
    state: dict[str, int] = {}                       # 1: on the current path, 2: done

    def walk(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path + [node, nxt]
            if nxt not in state:
                loop = walk(nxt, path + [node])
                if loop:
                    return loop
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            loop = walk(start, [])
            assert loop is None, "import loop: " + " -> ".join(loop[loop.index(loop[-1]):])


def _package(module: str) -> str:
    """The first-level package or top-level module a module belongs to ("benchmarks",
    "eval", ...; the package's own __init__ is "__init__")."""
    return module.split(".")[1]


def test_packages_import_one_way():
    """Between first-level packages the arrows never run both ways (e.g. entrypoints ->
    benchmarks -> entrypoints, or worker -> distributed -> worker), TYPE_CHECKING included."""
    modules = _modules()
    arrows: set[tuple[str, str]] = set()
    for name, path in modules.items():
        for target in _imports(path, modules, top_level_only=False):
            arrows.add((_package(name), _package(target)))
    for name, path in modules.items():          # TYPE_CHECKING imports count here too
        for line in path.read_text().splitlines():
            words = line.split()
            if len(words) > 2 and words[0] == "from" and words[1].startswith("cover_vllm."):
                arrows.add((_package(name), _package(words[1])))
    both = sorted(f"{a} <-> {b}" for a, b in arrows if (b, a) in arrows and a < b)
    assert not both, "\n".join(both)


def test_the_checks_catch_what_they_should(tmp_path):
    """The walker sees function-level and `from x import module` imports, skips TYPE_CHECKING."""
    modules = {"cover_vllm.engine.x": tmp_path / "x.py", "cover_vllm.entrypoints.llm": None,
               "cover_vllm.scheduler.request": None}
    (tmp_path / "x.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from cover_vllm.scheduler import request\n"
        "def f():\n    from cover_vllm.entrypoints import llm\n")
    assert _imports(tmp_path / "x.py", modules, False) == {"cover_vllm.entrypoints.llm"}
    assert _imports(tmp_path / "x.py", modules, True) == set()
    assert _layer("cover_vllm.engine.x") < _layer("cover_vllm.entrypoints.llm")


def test_both_engine_clients_implement_the_protocol():
    from cover_vllm.entrypoints.server.client import EngineClient
    from cover_vllm.entrypoints.server.dp_router import DPRouter
    from cover_vllm.entrypoints.server.engine_loop import EngineLoop

    for name, member in inspect.getmembers(EngineClient, inspect.isfunction):
        if name.startswith("_"):
            continue
        for cls in (EngineLoop, DPRouter):
            impl = getattr(cls, name, None)
            assert impl is not None, f"{cls.__name__} lacks {name}"
            assert (inspect.iscoroutinefunction(impl) == inspect.iscoroutinefunction(member)
                    and list(inspect.signature(impl).parameters)
                    == list(inspect.signature(member).parameters)), f"{cls.__name__}.{name}"


def test_no_module_grows_past_400_lines():
    """STYLE.md's house habit: a module owns one thing, aim for <= 300 lines, never past 400."""
    long = {name: n for name, path in _modules().items()
            if (n := len(path.read_text().splitlines())) > 400}
    assert not long, long

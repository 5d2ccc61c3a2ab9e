"""The import contract: kiln's packages form layers, and each module imports only its own layer or below.

    0 trainer.errors                          (user errors; standard library only)
    1 trainer.torchtitan_compat               (torchtitan's key names -> kiln's; standard library only)
    2 trainer.config                          (config dataclasses, parsing, validation; standard library only)
    3 trainer.internals                       (every use of private torch/torchao APIs)
    4 models
    5 float8 | trainer.components             (siblings: neither imports the other)
    6 parallelisms
    7 trainer.build                           (the one model-build path)
    8 trainer.tools                           (dry run, saved-activation report, profiling, guards)
    9 trainer.hooks                           (the train loop's step hooks)
   10 trainer.train                           (the Trainer)
   11 train.py, benchmarks                   (entry points)
   12 launch.py, scripts                     (drive the entry points: the torchrun launcher, the GPU bundle check)

Imports inside functions count too: a lazy import is still a dependency. docs/architecture.md explains the layers.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from tests.common import ROOT

LAYERS: list[tuple[str, ...]] = [
    ("trainer.errors",),
    ("trainer.torchtitan_compat",),  # below trainer.config, which calls it (same-layer siblings may not import)
    ("trainer.config",),
    ("trainer.internals",),
    ("models",),
    ("float8", "trainer.components"),
    ("parallelisms",),
    ("trainer.build",),
    ("trainer.tools",),
    ("trainer.hooks",),
    ("trainer.train",),
    ("train", "benchmarks"),
    ("launch", "scripts"),
]
KILN_TOP = {"trainer", "models", "float8", "parallelisms", "train", "scripts", "benchmarks"}


def _unit(module: str) -> tuple[int, str]:
    """(layer, unit) of a kiln module: the longest prefix named in LAYERS."""
    best: tuple[int, str] | None = None
    for layer, units in enumerate(LAYERS):
        for unit in units:
            if (module == unit or module.startswith(unit + ".")) and (best is None or len(unit) > len(best[1])):
                best = (layer, unit)
    assert best is not None, f"{module} belongs to no layer: add it to LAYERS (and docs/architecture.md)"
    return best


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.glob("**/*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in ("tests", ".git", "gpu_bundle") or rel.parts[0].startswith("."):  # gpu_bundle: generated
            continue
        name = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        if rel.name == "__init__.py" and not _imports(path):
            continue  # an empty package marker belongs to no layer
        out[name] = path
    return out


def _imports(path: Path) -> list[tuple[str, int]]:
    """Every imported module name (absolute), with its line, including imports inside functions."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, node.lineno))
            found += [(f"{node.module}.{a.name}", node.lineno) for a in node.names]
    return found


MODULES = _modules()


def _kiln_imports(name: str) -> list[tuple[str, int]]:
    return [(m, line) for m, line in _imports(MODULES[name]) if m.split(".")[0] in KILN_TOP and m in MODULES]


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_point_down(name: str) -> None:
    layer, unit = _unit(name)
    for target, line in _kiln_imports(name):
        t_layer, t_unit = _unit(target)
        assert t_layer < layer or (t_layer == layer and t_unit == unit), (
            f"{MODULES[name].relative_to(ROOT)}:{line} imports {target} (layer {t_layer}, {t_unit}) "
            f"from layer {layer} ({unit}): imports must point to a lower layer"
        )


def test_bottom_layer_is_standard_library_only() -> None:
    stdlib = set(sys.stdlib_module_names) | {"__future__", "tomli"}
    bottom = ("trainer.errors", "trainer.torchtitan_compat", "trainer.config")
    for name in bottom:
        for module, line in _imports(MODULES[name]):
            top = module.split(".")[0]
            # `from trainer import x` records "trainer" and "trainer.x"; the second is checked on its own
            assert top in stdlib or module == "trainer" or module in bottom or module.rpartition(".")[0] in bottom, (
                f"{name}:{line} imports {module}; the bottom layer must stay standard-library only"
            )


def test_no_import_cycles() -> None:
    graph = {name: {t for t, _ in _kiln_imports(name)} for name in MODULES}
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(nxt) :] + [nxt]))
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for name in graph:
        if name not in state:
            visit(name, [name])

"""The import contract: kiln's folders are layers, and each module imports only its own layer or below.

Folders, bottom to top (nothing imports a folder above its own):

    kiln_base      errors and exit statuses, files others made, the config (schema, parser, checks), the private
                   torch/torchao uses
    models         Llama 3: args per flavor, the nn.Module, FLOPs per token
    float8         the torchao converter, environment facts, first-step checks, the numerics observatory
    parallelisms   ParallelDims and the mesh, TP, activation checkpointing, compile, FSDP
    trainer        components < data < checkpoint < evaluation < step < build < tools < hooks < trainer (the
                   Trainer)
    entry points   train.py, benchmarks; then launch.py and scripts, which drive them

Within a folder, modules are layered too (LAYERS below). Imports inside functions count: a lazy import is still a
dependency. docs/architecture.md explains the layers.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

from tests.helpers.common import ROOT, project_files

LAYERS: list[tuple[str, ...]] = [
    ("kiln_base.errors", "kiln_base.files"),
    ("kiln_base.config",),  # schema < values < torchtitan_compat, checks < parse (no cycles: see below)
    ("kiln_base.internals",),
    ("models",),
    ("float8",),
    ("parallelisms",),
    ("trainer.components",),
    ("trainer.data",),
    ("trainer.checkpoint",),
    ("trainer.evaluation",),
    ("trainer.step",),  # step < guards, fault_tolerance (the wrappers)
    ("trainer.build",),
    ("trainer.tools",),
    ("trainer.hooks",),
    ("trainer.trainer",),
    ("train", "benchmarks"),
    ("launch", "scripts"),
]
FOLDERS = ["kiln_base", "models", "float8", "parallelisms", "trainer", "entry points"]
KILN_TOP = {"kiln_base", "trainer", "models", "float8", "parallelisms", "train", "launch", "scripts", "benchmarks"}
STANDARD_LIBRARY_ONLY = ("kiln_base.errors", "kiln_base.files", "kiln_base.config")


def _unit(module: str) -> tuple[int, str]:
    """(layer, unit) of a kiln module: the longest prefix named in LAYERS."""
    best: tuple[int, str] | None = None
    for layer, units in enumerate(LAYERS):
        for unit in units:
            if (module == unit or module.startswith(unit + ".")) and (best is None or len(unit) > len(best[1])):
                best = (layer, unit)
    assert best is not None, f"{module} belongs to no layer: add it to LAYERS (and docs/architecture.md)"
    return best


def _folder(module: str) -> int:
    top = module.split(".")[0]
    return FOLDERS.index(top) if top in FOLDERS else len(FOLDERS) - 1


def _modules() -> dict[str, Path]:
    out = {}
    for path in project_files(".py"):
        rel = path.relative_to(ROOT)
        # gpu_bundle: generated; assets: data, e.g. the loader lm-eval runs beside a task's files (assets/eval)
        if rel.parts[0] in ("tests", ".git", "gpu_bundle", "assets") or rel.parts[0].startswith("."):
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


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_folder_imports_a_folder_above_it(name: str) -> None:
    """The folder rule on its own: float8/, parallelisms/ and models/ never reach up into trainer/."""
    for target, line in _kiln_imports(name):
        assert _folder(target) <= _folder(name), (
            f"{MODULES[name].relative_to(ROOT)}:{line} imports {target}: folder {FOLDERS[_folder(target)]} sits "
            f"above {FOLDERS[_folder(name)]}"
        )


def test_the_config_and_errors_are_standard_library_only() -> None:
    stdlib = set(sys.stdlib_module_names) | {"__future__", "tomli"}
    for name in (n for n in MODULES if n.startswith(STANDARD_LIBRARY_ONLY)):
        for module, line in _imports(MODULES[name]):
            top = module.split(".")[0]
            inside = module.startswith(STANDARD_LIBRARY_ONLY) or module == "kiln_base"
            assert top in stdlib or inside, (
                f"{name}:{line} imports {module}; the config must stay standard-library only"
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


def test_nothing_cites_a_document_outside_the_repository() -> None:
    """Docstrings and docs name only documents a reader of the repository can open."""
    outside = ("DESIGN.md", "STYLE.md", "shared/seeds")
    for path in project_files(".py", ".md", ".sh"):
        rel = path.relative_to(ROOT)
        if rel.parts[0].startswith(".") or rel.parts[0] == "gpu_bundle" or rel == Path(__file__).relative_to(ROOT):
            continue
        text = path.read_text(errors="replace")
        for name in outside:
            assert name not in text, f"{rel} cites {name}, which is not in the repository"


def test_every_document_the_code_names_exists() -> None:
    """Each docs/*.md that the code names (--help and the config's help strings, error messages, docstrings,
    scripts) is in the repository: `train.py --help` once sent users to docs/observability.md, which is not."""
    from kiln_base.config import format_help

    named: dict[str, str] = {}
    for path in project_files(".py", ".sh"):
        rel = path.relative_to(ROOT)
        if rel == Path(__file__).relative_to(ROOT):  # this docstring names the missing one
            continue
        for doc in re.findall(r"docs/[\w./-]+?\.md", path.read_text(errors="replace")):
            named.setdefault(doc, str(rel))
    for doc in re.findall(r"docs/[\w./-]+?\.md", format_help()):
        named.setdefault(doc, "train.py --help")
    missing = {doc: where for doc, where in named.items() if not (ROOT / doc).is_file()}
    assert len(named) > 10 and not missing, f"named but not in docs/: {missing}"


def _test_module_imports(path: Path) -> list[str]:
    """The imports in `path` of a test module or conftest (tests.<folder>.test_*, conftest), and relative imports."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level:
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {'.' * node.level}{node.module or ''}")
    lines = set()
    for module, line in _imports(path):  # `from a import b` lists a, then a.b: one finding per line
        parts = module.split(".")
        other_test = any(p.startswith("test_") or p == "conftest" for p in parts)
        if (other_test or (parts[0] == "tests" and parts[1:2] != ["helpers"])) and line not in lines:
            lines.add(line)
            found.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    return found


def test_no_test_module_imports_another() -> None:
    """Tests share code through tests/helpers/ and fixtures through conftest.py, never by importing a test module:
    tests.helpers.* is the only part of tests/ anything under tests/ imports."""
    found = [f for path in sorted((ROOT / "tests").rglob("*.py")) for f in _test_module_imports(path)]
    assert not found, "move what is shared into tests/helpers/:\n" + "\n".join(found)

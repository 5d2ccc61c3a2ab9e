"""Files of scripts/ (not a package) imported as modules, for tests that call their functions in-process.

    conv = load_script("convert_hf")

One module per name for the whole session (registered in sys.modules under that name), as an import would give.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from types import ModuleType

from tests.helpers.common import ROOT


@functools.cache
def load_script(name: str) -> ModuleType:
    """scripts/{name}.py, imported as the module `name`, with scripts/ on sys.path: a worker a script spawns
    (tokenize_data) finds the script's functions by that module name."""
    folder = str(ROOT / "scripts")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module

"""A script under bench/ loaded as a module, for tests of its pure parts."""

from __future__ import annotations

import importlib.util
from types import ModuleType

from tests.servers import ROOT


def load(name: str) -> ModuleType:
    """bench/`name`.py as a module (run nothing: its `main` is behind `__name__`)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

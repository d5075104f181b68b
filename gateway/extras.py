"""Optional dependencies ("extras"): import them where they are used, and when one is not
installed say which extra brings it, instead of a bare `ModuleNotFoundError` deep in a
traceback. The core install (`pip install cache-gateway`) carries only what `gateway serve`
needs; see pyproject.toml for the extras."""

from __future__ import annotations

import importlib
from types import ModuleType

DIST = "cache-gateway"


class MissingExtra(ImportError):
    """An optional package is not installed; the message names the extra to install."""


def install_hint(extra: str) -> str:
    return f"pip install '{DIST}[{extra}]'"


def require(module: str, *, extra: str, feature: str) -> ModuleType:
    """Import `module`, or raise `MissingExtra` naming `feature` and the extra to install."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        # Only the package itself being absent is a missing extra; a broken install of it
        # (one of its own imports failing) keeps its real traceback.
        top = module.partition(".")[0]
        if exc.name is None or exc.name.partition(".")[0] != top:
            raise
        raise MissingExtra(
            f"{feature} needs the {top!r} package, which is not installed: "
            f"{install_hint(extra)}"
        ) from exc

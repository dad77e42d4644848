"""Lazy re-exports for package ``__init__`` files (PEP 562).

Flower's simulation imports the ServerApp in one thread while another thread imports the ClientApp. A package
``__init__`` that eagerly imports its submodules then deadlocks against a thread importing one of those
submodules directly (Python raises "deadlock detected by _ModuleLock", seen here with fedpdm_flower.fedapp.privacy). Resolving
the re-exported names on first access keeps ``from fedpdm_flower.fedapp.data import load_dataset`` working without
``__init__`` importing anything.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, Sequence[str]]) -> tuple[Callable[[str], Any], list[str]]:
    """``__getattr__`` and ``__all__`` for `package`, given {submodule: [names it provides]}."""
    where = {name: f"{package}.{module}" for module, names in exports.items() for name in names}

    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(where[name]), name)

    return __getattr__, sorted(where)

"""Lazy package exports: one mechanism for every `__init__` (names resolve on first use)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, namespace: dict[str, Any], exports: dict[str, str]) -> tuple[Callable, Callable]:
    """(__getattr__, __dir__) for a package whose `exports` map name -> defining module.

    A resolved name is cached in the package namespace, so it costs one import once.
    """

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(exports) | {n for n in namespace if not n.startswith("_")})

    return __getattr__, __dir__

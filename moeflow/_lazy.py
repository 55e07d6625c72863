"""Lazy package exports: one mechanism for every `__init__` (names resolve on first use).

`after_import(name, callback)`: run `callback(module)` once module `name` has been imported,
without importing it (for a registration with another library that only matters if it is used).
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
import warnings
from collections.abc import Callable
from types import ModuleType
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


class _AfterImport(importlib.abc.MetaPathFinder):
    """A meta path finder that wraps the loader of one module so that callbacks run after it executes."""

    # Marks every such finder, whichever copy of this module made it (a reload or a second import of moeflow
    # makes another class): each skips them all when it looks for the real finder, so none recurses into another.
    moeflow_after_import = True

    def __init__(self, name: str) -> None:
        self.name = name
        self.callbacks: list[Callable[[ModuleType], None]] = []

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        for finder in sys.meta_path:  # the finder that would have found it, without this one
            if getattr(finder, "moeflow_after_import", False) or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        callbacks, exec_module = self.callbacks, loader.exec_module

        class _Loader(importlib.abc.Loader):
            def __getattr__(self, name):  # get_source, is_package, ...: the original loader's
                return getattr(loader, name)

            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                exec_module(module)
                for callback in callbacks:
                    try:
                        callback(module)
                    except Exception as exc:  # never break the other library's import
                        warnings.warn(f"moeflow: after importing {module.__name__}: {exc!r}", stacklevel=2)

        spec.loader = _Loader()
        return spec


def after_import(name: str, callback: Callable[[ModuleType], None]) -> None:
    """Run `callback(module)` when module `name` is imported (now, if it already is); it is not imported here."""
    module = sys.modules.get(name)
    if module is not None:
        callback(module)
        return
    for finder in sys.meta_path:
        if getattr(finder, "moeflow_after_import", False) and finder.name == name:
            finder.callbacks.append(callback)
            return
    finder = _AfterImport(name)
    finder.callbacks.append(callback)
    sys.meta_path.insert(0, finder)

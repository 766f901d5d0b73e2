"""Names a package exports from submodules it imports only on first use (PEP 562).

A package whose submodules pull torch (or another heavy import) but whose callers often need only
its light part re-exports the heavy names through this: `import pkg` stays light, `pkg.Name` and
`from pkg import Name` import the submodule the first time.

    _EXPORTS = {"Transformer": "model", ...}        # name -> submodule of this package
    __getattr__ = lazy_exports(__name__, _EXPORTS, globals())
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(package: str, exports: Mapping[str, str],
                 namespace: dict[str, Any]) -> Callable[[str], Any]:
    """The package's module `__getattr__`: `exports[name]` is the submodule that defines `name`;
    a name loaded once is kept in `namespace` (the package's globals), so the next access is a
    plain attribute."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        namespace[name] = value
        return value

    return __getattr__

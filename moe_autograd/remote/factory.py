"""Experts factories named on a command line: ``package.module:function``.

Why a module of its own: the CLI, the loopback helpers and the Ray server
all build a server's experts from such a name, in the process that serves
them; this is the one place that imports it (below all of them, so that none
reaches up into another for it).

Invariant: a name is resolved by importing its module in *this* process,
from its own code and path; it never comes from a message (servers address
experts by the names they registered, :mod:`.endpoint`).
"""
import importlib
from typing import Any

__all__ = ["load_object"]


def load_object(path: str) -> Any:
    """Imports ``package.module:attribute`` (the attribute may be dotted)."""
    module_name, sep, attribute = path.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(f"expected 'package.module:function', got {path!r}")
    obj: Any = importlib.import_module(module_name)
    for part in attribute.split("."):
        obj = getattr(obj, part)
    return obj

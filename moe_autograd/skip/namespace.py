"""Namespaces that keep skip names of different module instances apart.

A skip connection is keyed by ``(namespace, name)``, not by name alone. Without
a namespace, two instances of the same ``@skippable`` pair inside one
``nn.Sequential`` would both stash and pop ``'skip'`` and the second stash
would overwrite the first. ``layer.isolate(Namespace())`` moves a layer's
names into a fresh namespace so the pairs no longer collide.

Invariants:

* ``None`` is the *default namespace*: every skip name lives there until it is
  isolated. ``isinstance(None, Namespace)`` is true so that the default fits
  every ``Namespace``-typed parameter.
* Namespaces are equal only to themselves and hash by identity of a random
  UUID, so they are safe dictionary keys across threads. They carry no order;
  code that needs a deterministic order sorts by :func:`sort_key`.
"""
import abc
import uuid
from typing import Any, Optional, Tuple

__all__ = ["Namespace", "default_namespace", "sort_key"]


class Namespace(metaclass=abc.ABCMeta):
    """A namespace for skip names; create one per isolated group of layers.

    ::

        ns = Namespace()
        model = nn.Sequential(
            StashSkip().isolate(ns),
            ...,
            PopSkip().isolate(ns),
        )
    """

    __slots__ = ("id",)

    def __init__(self) -> None:
        self.id = uuid.uuid4()

    def __repr__(self) -> str:
        return f"<Namespace '{self.id}'>"

    def __hash__(self) -> int:
        return hash(self.id)

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, Namespace) and other is not None and self.id == other.id

    def __ne__(self, other: Any) -> bool:
        return not self == other


# The default namespace is ``None``. Registering its type makes
# ``isinstance(None, Namespace)`` true, so the default satisfies every
# ``Namespace`` annotation at run time.
Namespace.register(type(None))

#: The namespace of every skip name that has not been isolated.
default_namespace: Namespace = None  # type: ignore[assignment]


def sort_key(ns: Optional[Namespace]) -> Tuple[int, str]:
    """A total order over namespaces: the default first, then by UUID.

    The order itself carries no meaning; it only makes layouts deterministic.
    """
    if ns is None:
        return (0, "")
    return (1, str(ns.id))

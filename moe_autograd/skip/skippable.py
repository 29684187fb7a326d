"""``@skippable``: layers that hand tensors to later layers, skipping the ones between.

Why: a Sequential (or a pipeline partition, or an expert) only passes one
value from layer to layer. A skippable layer's ``forward`` is a generator that
``yield stash(name, tensor)`` to leave a tensor behind and
``tensor = yield pop(name)`` to pick one up::

    @skippable(stash=["identity"])
    class Stash(nn.Module):
        def forward(self, x):
            yield stash("identity", x)
            return self.linear(x)

    @skippable(pop=["identity"])
    class Pop(nn.Module):
        def forward(self, x):
            identity = yield pop("identity")
            return x + identity

The decorator returns a :class:`Skippable` subclass that builds the original
module and runs its generator against :func:`~moe_autograd.skip.tracker.
current_skip_tracker`, so the same layer works plainly, in a Sequential, under
checkpointing, and in a pipeline that installs a portal tracker.

Invariants:

* A layer stashes exactly the names it declares in ``stash`` and pops
  exactly those in ``pop``, once each per forward; anything else raises
  RuntimeError.
* Pops are loaded from the tracker *before* the wrapped forward runs (so a
  portal can order them after the input) and stashes are saved *after* it
  returns (so a portal can tie them to the output).
* Names are keyed by ``(namespace, name)``; :meth:`Skippable.isolate` moves a
  layer's names out of the default namespace ``None``.
"""
from types import GeneratorType
from typing import Any, Callable, ClassVar, Dict, FrozenSet, Iterable, Iterator, List, Optional, Tuple, Type, TypeVar, cast

from torch import Tensor, nn

from ..microbatch import Batch
from .namespace import Namespace, default_namespace
from .tracker import current_skip_tracker

__all__ = ["skippable", "stash", "pop", "verify_skippables", "Skippable"]

SkipKey = Tuple[Namespace, str]
T = TypeVar("T", bound="Skippable")


class stash:
    """The command ``yield stash(name, tensor)``: leave ``tensor`` as ``name``."""

    __slots__ = ("name", "tensor")

    def __init__(self, name: str, tensor: Optional[Tensor]) -> None:
        self.name = name
        self.tensor = tensor


class pop:
    """The command ``tensor = yield pop(name)``: pick up what was stashed as ``name``."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


def _unwrap(batch: Batch) -> Any:
    return batch.tensor if batch.atomic else batch.values


class Skippable(nn.Module):
    """Base of the classes :func:`skippable` creates; wraps ``module_cls``."""

    module_cls: ClassVar[Type[nn.Module]]
    stashable_names: ClassVar[FrozenSet[str]]
    poppable_names: ClassVar[FrozenSet[str]]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        self.module = self.module_cls(*args, **kwargs)
        self.namespaces: Dict[str, Namespace] = {}

    def __repr__(self) -> str:
        return f"@skippable({self.module})"

    def namespaced(self, name: str) -> SkipKey:
        """``(namespace, name)`` for one of this layer's skip names."""
        return (self.namespaces.get(name, default_namespace), name)

    def stashable(self) -> Iterator[SkipKey]:
        """The ``(namespace, name)`` this layer stashes."""
        for name in sorted(self.stashable_names):
            yield self.namespaced(name)

    def poppable(self) -> Iterator[SkipKey]:
        """The ``(namespace, name)`` this layer pops."""
        for name in sorted(self.poppable_names):
            yield self.namespaced(name)

    def isolate(self: T, ns: Namespace, *, only: Optional[Iterable[str]] = None) -> T:
        """Moves this layer's skip names (or just ``only``) into ``ns``; returns self."""
        names = self.stashable_names | self.poppable_names if only is None else set(only)
        unknown = set(names) - (self.stashable_names | self.poppable_names)
        if unknown:
            raise ValueError(f"{type(self).__name__} declares no skip named {sorted(unknown)}")
        for name in names:
            self.namespaces[name] = ns
        return self

    def dispatch(
        self,
        input: Any,
        handle_stash: Callable[[str, Optional[Tensor]], None],
        handle_pop: Callable[[str], Optional[Tensor]],
    ) -> Any:
        """Runs the wrapped forward, serving its stash/pop commands."""
        generator = self.module(input)
        if not isinstance(generator, GeneratorType):
            return generator  # A plain forward: no commands.
        try:
            op = next(generator)
            while True:
                if isinstance(op, stash):
                    handle_stash(op.name, op.tensor)
                    op = next(generator)
                elif isinstance(op, pop):
                    op = generator.send(handle_pop(op.name))
                else:
                    raise TypeError(f"{op!r} is not a command from @skippable (yield stash(...) or pop(...))")
        except StopIteration as stop:
            return stop.value

    def forward(self, input: Any) -> Any:  # type: ignore[override]
        skip_tracker = current_skip_tracker()
        stashed: Dict[str, Optional[Tensor]] = {}

        # Load every declared pop first; the tracker may fork the input.
        batch = Batch(input)
        poppable: Dict[str, Optional[Tensor]] = {}
        for ns, name in self.poppable():
            try:
                poppable[name] = skip_tracker.load(batch, ns, name)
            except KeyError:
                raise RuntimeError(f"{type(self).__name__} pops {name!r} but it has not been stashed") from None
        input = _unwrap(batch)

        def handle_stash(name: str, tensor: Optional[Tensor]) -> None:
            if name not in self.stashable_names:
                raise RuntimeError(f"{type(self).__name__} stashed {name!r}, which it did not declare in stash=")
            if name in stashed:
                raise RuntimeError(f"{type(self).__name__} stashed {name!r} twice")
            stashed[name] = tensor

        def handle_pop(name: str) -> Optional[Tensor]:
            if name not in self.poppable_names:
                raise RuntimeError(f"{type(self).__name__} popped {name!r}, which it did not declare in pop=")
            if name not in poppable:
                raise RuntimeError(f"{type(self).__name__} popped {name!r} twice")
            return poppable.pop(name)

        output = self.dispatch(input, handle_stash, handle_pop)

        not_stashed = self.stashable_names - stashed.keys()
        if not_stashed:
            raise RuntimeError(f"{type(self).__name__} must stash {_names(not_stashed)} but did not")
        if poppable:
            raise RuntimeError(f"{type(self).__name__} must pop {_names(poppable)} but did not")

        # Save the stashes; the tracker may join them into the output.
        batch = Batch(output)
        for ns, name in self.stashable():
            skip_tracker.save(batch, ns, name, stashed[name])
        return _unwrap(batch)


def _names(names: Iterable[str]) -> str:
    return ", ".join(repr(n) for n in sorted(names))


def skippable(
    stash: Iterable[str] = (),
    pop: Iterable[str] = (),
) -> Callable[[Type[nn.Module]], Type[Skippable]]:
    """Class decorator: the module may stash the names in ``stash`` and pop those in ``pop``.

    The decorated name becomes a :class:`Skippable` subclass; its constructor
    takes the original class's arguments and the original instance is
    ``.module``.
    """
    stashable_names = frozenset(stash)
    poppable_names = frozenset(pop)

    def extend_skippable(module_cls: Type[nn.Module]) -> Type[Skippable]:
        attrs = {
            "module_cls": module_cls,
            "stashable_names": stashable_names,
            "poppable_names": poppable_names,
            "__module__": module_cls.__module__,
            "__qualname__": module_cls.__qualname__,
            "__doc__": module_cls.__doc__,
        }
        return cast(Type[Skippable], type(module_cls.__name__, (Skippable,), attrs))

    return extend_skippable


def verify_skippables(module: nn.Sequential) -> None:
    """Checks that every stash in ``module`` is popped by a later layer, once.

    Raises TypeError listing every mismatch, each naming the layer and the
    skip: a name both stashed and popped by one layer, a stash or pop repeated
    in one namespace, a pop with no earlier stash, a stash never popped.
    """
    stashed: Dict[SkipKey, str] = {}  # (ns, name) -> layer that stashed it
    popped: Dict[SkipKey, str] = {}  # (ns, name) -> layer that popped it
    msgs: List[str] = []

    for layer_name, layer in module.named_children():
        if not isinstance(layer, Skippable):
            continue

        for name in sorted(layer.stashable_names & layer.poppable_names):
            msgs.append(f"layer '{layer_name}' declared '{name}' both as stashable and as poppable")

        for ns, name in layer.stashable():
            if name in layer.poppable_names:
                continue
            if (ns, name) in stashed:
                msgs.append(
                    f"layer '{layer_name}' stashes '{name}' again (already stashed by layer "
                    f"'{stashed[(ns, name)]}'); isolate one of them with a Namespace"
                )
                continue
            stashed[(ns, name)] = layer_name

        for ns, name in layer.poppable():
            if name in layer.stashable_names:
                continue
            if (ns, name) in popped:
                msgs.append(
                    f"layer '{layer_name}' pops '{name}' again (already popped by layer "
                    f"'{popped[(ns, name)]}'); isolate one of them with a Namespace"
                )
                continue
            if (ns, name) not in stashed:
                msgs.append(f"layer '{layer_name}' pops '{name}' but no earlier layer stashes it")
                continue
            popped[(ns, name)] = layer_name

    for key, layer_name in stashed.items():
        if key not in popped:
            msgs.append(f"layer '{layer_name}' stashes '{key[1]}' but no later layer pops it")

    if msgs:
        raise TypeError(
            "one or more pairs of stash and pop do not match:\n\n" + "\n".join(f"* {m}" for m in msgs)
        )


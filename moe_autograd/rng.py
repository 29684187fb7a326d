"""Per-call random number generation that recomputation can replay exactly.

Why
---
A checkpointed call runs its function twice: once in forward (without saving
activations) and once more in backward to rebuild them. Both runs must draw the
*same* random numbers, or the recomputed dropout mask differs from the one the
forward output was computed with and the gradients are silently wrong.

``torch.utils.checkpoint`` saves the global generator state before the forward
and restores it around the recomputation. That is not enough here: the runtime
runs many calls at once on several threads, and they all draw from the same
global generator. Between "save" and "draw", another thread may draw first, so
the forward sees a shifted stream; and restoring the state during a
recomputation rewinds the generator under every other thread's feet.

How
---
Each call gets a :class:`CallRng`: a 64-bit seed, forked from the default CPU
generator (so a whole run stays reproducible under :func:`torch.manual_seed`).
``with rng.activate():`` pushes a :class:`~torch.utils._python_dispatch.
TorchDispatchMode` that sees every aten op issued *on this thread* and routes
each random op to private :class:`torch.Generator`\\ s seeded from that seed,
one per device, created fresh on every entry:

* ops whose schema has a ``generator`` argument left at ``None`` (``bernoulli_``
  behind ``F.dropout``, ``normal_``, ``uniform_``, ``exponential_`` behind
  ``F.gumbel_softmax``, ``multinomial``, ``rrelu_with_noise``, ...) get the
  private generator of their device;
* seeded ops without one (``rand``, ``randn``, ``randint``, ``randperm``,
  ``rand_like``, ``randn_like``, ``randint_like``) are redirected to their
  ``generator`` overload;
* ``native_dropout`` (the fused dropout used on CUDA) is rewritten as a
  ``bernoulli_`` mask drawn from the private generator;
* any other seeded op that would really draw (an attention kernel or cuDNN RNN
  with dropout) raises :class:`RuntimeError` naming the op: the mode never lets
  an op fall back to the global generator silently. The same ops with a zero
  dropout probability, ``train=False``, or in their ``*_backward`` form (which
  replay saved state) pass through.

Dispatch modes are thread-local, so other threads are unaffected and keep using
the global generator.

Invariant
---------
The same seed and the same sequence of random ops on the activating thread give
the same values, whatever other threads draw meanwhile. The global generators
are neither read nor advanced inside :meth:`CallRng.activate`.
:meth:`CallRng.fork` called inside an active call draws from that call's stream,
so a nested call gets the same seed again when its parent is recomputed.

Limits
------
Random ops issued from threads that the call itself spawns are not covered
(they draw from the global generator), nor are kernels that consult a global
generator without an aten op (custom C++/CUDA extensions). Ops that pass an
explicit ``generator`` keep it.
"""
import threading
import zlib
from contextlib import contextmanager
from typing import Any, Dict, Generator, List, Optional, Tuple

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["CallRng"]

_MASK64 = (1 << 64) - 1
_fork_lock = threading.Lock()


def _mix64(value: int) -> int:
    """splitmix64: decorrelates the per-device seeds derived from one seed."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


class CallRng:
    """The random stream of one call: a seed, replayed by :meth:`activate`."""

    __slots__ = ("seed", "drew")

    def __init__(self, seed: int) -> None:
        self.seed: int = int(seed) & _MASK64
        #: Whether a random op drew from this stream during the last
        #: :meth:`activate` (None before the first). A replay of a run that drew
        #: nothing needs no routing: the same ops draw nothing again.
        self.drew: Optional[bool] = None

    @classmethod
    def fork(cls, generator: Optional[torch.Generator] = None) -> "CallRng":
        """Draws a fresh 64-bit seed from ``generator`` (default: the default
        CPU generator, or the active call's stream if this thread is in one)."""
        with _fork_lock:
            seed = torch.empty((), dtype=torch.int64).random_(-(1 << 63), None, generator=generator)
        return cls(int(seed.item()))

    @contextmanager
    def activate(self) -> Generator[None, None, None]:
        """Routes this thread's random ops to generators seeded by :attr:`seed`."""
        mode = _CallRngMode(self.seed)
        try:
            with mode:
                yield
        finally:
            self.drew = mode.drew

    def __repr__(self) -> str:
        return f"CallRng(seed={self.seed:#018x})"


# Per-op decisions, computed once per OpOverload.
_ROUTE = "route"        # has a `generator` argument
_SIBLING = "sibling"    # redirect to the overload that takes a generator
_DROPOUT = "dropout"    # aten.native_dropout: rewritten
_GUARD = "guard"        # cannot be routed: raise unless it draws nothing
_plans: Dict[Any, Tuple[str, Any]] = {}


def _arg_names(op: Any) -> List[str]:
    return [a.name for a in op._schema.arguments]


def _plan(func: Any) -> Tuple[str, Any]:
    plan = _plans.get(func)
    if plan is None:
        names = _arg_names(func)
        if "generator" in names:
            plan = (_ROUTE, None)
        elif func in (torch.ops.aten.native_dropout.default, torch.ops.aten.native_dropout.out):
            plan = (_DROPOUT, None)
        else:
            plan = (_GUARD, None)
            wanted = set(names) | {"generator"}
            for overload in func.overloadpacket.overloads():
                sibling = getattr(func.overloadpacket, overload)
                if set(_arg_names(sibling)) == wanted:
                    plan = (_SIBLING, sibling)
                    break
        _plans[func] = plan
    return plan


def _bind(op: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Dict[str, Any]:
    values = {a.name: v for a, v in zip(op._schema.arguments, args)}
    values.update(kwargs)
    return values


def _call(op: Any, values: Dict[str, Any]) -> Any:
    args: List[Any] = []
    kwargs: Dict[str, Any] = {}
    positional = True
    for arg in op._schema.arguments:
        if arg.name not in values:
            positional = False
        elif positional and not arg.kwarg_only:
            args.append(values[arg.name])
        else:
            kwargs[arg.name] = values[arg.name]
    return op(*args, **kwargs)


def _device_of(values: Dict[str, Any]) -> torch.device:
    device = values.get("device")
    if device is not None:
        return torch.device(device)
    for leaf in tree_leaves(list(values.values())):
        if isinstance(leaf, Tensor):
            return leaf.device
    return torch.device("cpu")


def _draws_nothing(func: Any, values: Dict[str, Any]) -> bool:
    if func.overloadpacket.__name__.endswith("_backward"):
        return True  # replays the philox seed/offset saved by its forward
    given = {a.name: a.default_value for a in func._schema.arguments if a.has_default_value()}
    given.update(values)
    if given.get("train", True) is False:
        return True
    probabilities = [given[k] for k in ("dropout_p", "dropout") if k in given]
    return bool(probabilities) and all(p == 0 for p in probabilities)


def _native_dropout(input: Tensor, p: float, train: Optional[bool], gen: torch.Generator) -> Tuple[Tensor, Tensor]:
    if train is False:
        return input.clone(), torch.ones_like(input, dtype=torch.bool)
    keep = 1.0 - p
    scale = 0.0 if keep == 0 else 1.0 / keep
    mask = torch.empty_like(input, memory_format=torch.contiguous_format).bernoulli_(keep, generator=gen)
    return input.mul(mask).mul_(scale), mask.to(torch.bool)


class _CallRngMode(TorchDispatchMode):
    """Dispatch mode behind :meth:`CallRng.activate` (one per activation)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.seed = seed
        self.generators: Dict[torch.device, torch.Generator] = {}
        self.lock = threading.Lock()
        self.drew = False

    def generator(self, device: torch.device) -> torch.Generator:
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        with self.lock:
            gen = self.generators.get(device)
            if gen is None:
                code = zlib.crc32(f"{device.type}:{device.index}".encode())
                gen = torch.Generator(device=device)
                gen.manual_seed(_mix64(self.seed ^ code))
                self.generators[device] = gen
            return gen

    def __torch_dispatch__(self, func: Any, types: Any, args: Tuple[Any, ...] = (),
                           kwargs: Optional[Dict[str, Any]] = None) -> Any:
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded not in func.tags:
            return func(*args, **kwargs)
        kind, sibling = _plan(func)
        values = _bind(func, args, kwargs)
        if kind == _ROUTE and values.get("generator") is not None:
            return func(*args, **kwargs)  # the caller chose a generator
        device = _device_of(values)
        if device.type == "meta":
            return func(*args, **kwargs)  # nothing is drawn
        self.drew = True
        if kind == _ROUTE:
            values["generator"] = self.generator(device)
            return _call(func, values)
        if kind == _SIBLING:
            values["generator"] = self.generator(device)
            return _call(sibling, values)
        if kind == _DROPOUT:
            out, mask = _native_dropout(values["input"], values["p"], values.get("train"), self.generator(device))
            if "out0" not in values:
                return out, mask
            out0, out1 = values["out0"], values["out1"]
            out0.resize_(out.shape).copy_(out)
            out1.resize_(mask.shape).copy_(mask)
            return out0, out1
        if _draws_nothing(func, values):
            return func(*args, **kwargs)
        raise RuntimeError(
            f"{func} draws from the global random generator and cannot be routed to the "
            "call's private generator (moe_autograd.rng.CallRng); its result could not be "
            "recomputed exactly. Use a dropout-free variant inside the call or apply the "
            "dropout separately (e.g. F.dropout or the math attention backend)."
        )

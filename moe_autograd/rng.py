"""Per-call random streams that recomputation can replay exactly, at no cost to
ops that draw nothing.

Why
---
A checkpointed call runs its function twice: once in forward (without saving
activations) and once more in backward to rebuild them. Both runs must draw the
*same* random numbers, or the recomputed dropout mask differs from the one the
forward output was computed with and the gradients are silently wrong. And the
runtime runs many calls at once on several threads: if they all drew from the
global generator, results would depend on thread interleaving.

``torch.utils.checkpoint`` saves the global generator state before the forward
and restores it around the recomputation. That is not enough here: between
"save" and "draw", another thread may draw first, so the forward sees a
shifted stream; and restoring the state during a recomputation rewinds the
generator under every other thread's feet.

How
---
A *stream* is active on a thread inside ``with stream.activate():``. Two kinds:

* :class:`CallRng`: a 64-bit seed, forked from the default CPU generator in
  call order (so a whole run stays reproducible under
  :func:`torch.manual_seed`), and drawn from it only once one of the batch's
  calls draws a random number. Every activation draws the same numbers from
  private generators seeded afresh by it, one per device.
* :class:`ReplayRng`: what :func:`~moe_autograd.checkpoint.checkpoint` uses.
  Its first activation draws what the code would have drawn without it, from
  private copies of the generators the thread would have used (the enclosing
  stream's, or the default generators), and advances those generators as the
  code would have; every later activation replays these numbers from the
  recorded states. So a checkpointed call computes exactly what the plain call
  computes, and its recomputation replays exactly whatever other threads draw.

Routing costs nothing for ops that draw nothing. Python kernels are registered
for every aten op tagged ``torch.Tag.nondeterministic_seeded`` on one dispatch
key (:data:`DISPATCH_KEY`) that nothing else in PyTorch uses, with a
fallthrough for every other op; :meth:`activate` turns the key on in this
thread's dispatch TLS. An op that draws nothing skips the key inside the C++
dispatcher (no Python); a random op reaches its kernel, which:

* passes the active stream's generator for the op's device to ops whose schema
  has a ``generator`` argument left at ``None`` (``bernoulli_`` behind
  ``F.dropout``, ``normal_``, ``uniform_``, ``exponential_`` behind
  ``F.gumbel_softmax``, ``multinomial``, ``rrelu_with_noise``, ...), then
  redispatches past the key;
* redirects seeded ops without one (``rand``, ``randn``, ``randint``,
  ``randperm``, ``rand_like``, ``randn_like``, ``randint_like``, their ``out``
  forms) to their ``generator`` overload, run with the key off (everything
  it draws comes from the generator it was given, so it needs no second hop);
* rewrites ``native_dropout`` (the fused dropout ``F.dropout`` uses on CUDA)
  as ``_fused_dropout`` with the stream's generator on CUDA, as a
  ``bernoulli_`` mask elsewhere;
* raises :class:`RuntimeError` naming the op for any other seeded op that would
  really draw (an attention kernel or cuDNN RNN with dropout): nothing ever
  falls back to the global generator silently. The same ops with a zero dropout
  probability, ``train=False``, on the meta device, or in their ``*_backward``
  form (which replay saved state) pass through. Composite ops (``dropout``,
  ``scaled_dot_product_attention``, ``lstm``) are not intercepted: they reach
  the key again through the ops they decompose into.

The key sits above autograd, autocast, functorch and the Python key (only the
tracing keys PreDispatch and PythonDispatcher come first), so a random op is
routed before autograd, autocast, functorch or ``__torch_dispatch__`` see it;
they see the op with its generator filled in.

Invariants
----------
* The same stream and the same sequence of random ops on the activating thread
  give the same values, whatever other threads draw meanwhile.
* Inside :meth:`CallRng.activate` the global generators are neither read nor
  advanced, but for the one draw of a lazily forked batch's seeds (from the
  default CPU generator, at the batch's first random op): a batch of calls that
  draw nothing leaves every global generator as a plain loop of them would,
  and so does a batch that raises in a call before any call that drew
  (:func:`rewind_unrun_draws`: the loop stopped before the drawing calls). Inside the first :meth:`ReplayRng.activate` they are read at the
  first draw per device and advanced once, at exit, to where the plain code
  would have left them (unless another thread drew from them meanwhile: then
  they are left as that thread left them).
* The innermost activation on a thread rules; leaving it restores the outer one
  and the thread's dispatch state. Leaving one that is not innermost (a
  generator-based context closed late) leaves the ones above it in force: the
  one right above it restores, when it is left, what it would have restored.
* :meth:`CallRng.fork` inside an active :class:`CallRng` derives the child's
  seed from the parent's seed and the fork's place in the activation, without
  drawing (a nested batch that draws nothing leaves every generator alone, and
  the parent's own draws are not shifted); inside a :class:`ReplayRng` it
  draws from that stream. Either way a nested call gets the same seed again
  when its parent is recomputed.
* A seeded op that the router cannot route raises instead of drawing from a
  global generator.

Limits
------
* Only the activating thread is routed. Random ops on threads the call starts
  itself draw from the global generators. Threads that inherit PyTorch's
  dispatch TLS but not Python's (autograd engine device threads running a
  backward started inside an activation, ``torch.jit.fork`` tasks) raise on a
  random op.
* Kernels that consult a global generator without a seeded aten op (custom
  C++/CUDA extensions) are not covered, nor are seeded ops registered after
  this module is imported (only ``aten`` is scanned). Ops that pass an explicit
  ``generator`` keep it.
* While ops are recorded into a graph (``make_fx``, AOTAutograd under
  ``torch.compile``) random ops keep ``generator=None``: the graph is routed
  when it runs, to whatever stream is active then.
* ``torch.manual_seed`` is replaced (at import) by a function that, inside
  a :class:`CallRng` activation, reseeds that call's stream only (its
  generators on every device start from the seed, as the loop's call would
  draw from the reseeded global generators; the global generators are not
  touched, where the loop would leave them reseeded: a difference the
  README's semantics table states). Outside activations it is PyTorch's.
* ``torch.get_rng_state`` / ``torch.set_rng_state`` are replaced (at import)
  by functions that, inside a :class:`CallRng` activation, read and set the
  stream's CPU generator (see the table above the router): so
  ``torch.utils.checkpoint`` *inside* a call recomputes with the random
  numbers its forward drew, on any thread. Outside activations they are
  PyTorch's. CUDA's ``torch.cuda.get_rng_state`` is not covered: a CUDA
  expert's own ``torch.utils.checkpoint`` recomputes from the device's
  global generator; use :func:`moe_autograd.checkpoint.checkpoint` there.
* :data:`DISPATCH_KEY` is ``TESTING_ONLY_GenericMode``, which PyTorch reserves
  for its own C++ tests: a process that registers kernels on it elsewhere
  conflicts with this module (registration fails at import).
"""
import threading
import zlib
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple, Union

import torch
from torch import Tensor
from torch.library import Library, fallthrough_kernel

__all__ = ["CallRng", "ReplayRng", "RandomStream", "active_stream", "routed_ops",
           "mark_concurrent", "rewind_unrun_draws", "DISPATCH_KEY"]

_MASK64 = (1 << 64) - 1

#: The dispatch key random ops are routed on, while a stream is active.
DISPATCH_KEY = "TESTING_ONLY_GenericMode"
# The key has no name in torch._C.DispatchKey; parse it from its name (the
# constructor accepts a string, the stubs do not say so).
_KEY = torch._C.DispatchKeySet(DISPATCH_KEY).highestPriorityTypeId()  # type: ignore[arg-type]
_is_included = torch._C._dispatch_tls_is_dispatch_key_included
_is_excluded = torch._C._dispatch_tls_is_dispatch_key_excluded
_set_included = torch._C._dispatch_tls_set_dispatch_key_included
_set_excluded = torch._C._dispatch_tls_set_dispatch_key_excluded
_CPU = torch.device("cpu")


def _mix64(value: int) -> int:
    """splitmix64: decorrelates the per-device seeds derived from one seed."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


class _Local(threading.local):
    def __init__(self) -> None:
        self.stack: List["_Activation"] = []
        self.seed_buffer: Optional[Tensor] = None  # CallRng.fork draws into it
        # Generators of finished activations, reseeded (or given a state) before
        # any reuse: creating one costs more than seeding it.
        self.spare: Dict[torch.device, List[torch.Generator]] = {}


_SPARE_PER_DEVICE = 4
_DEVICE_CODES: Dict[torch.device, int] = {}  # per-device seed salt, see CallRng._generator


def _new_generator(device: torch.device) -> torch.Generator:
    spare = _local.spare.get(device)
    return spare.pop() if spare else torch.Generator(device=device)


_local = _Local()

RandomStream = Union["CallRng", "ReplayRng"]


def active_stream() -> Optional[RandomStream]:
    """The stream of the innermost activation on this thread, if any."""
    stack = _local.stack
    return stack[-1].stream if stack else None


class _Activation:
    """One ``with stream.activate():``. Holds the generators it created."""

    __slots__ = ("stream", "outer", "generators", "drew", "forks", "capture", "restored",
                 "override", "replay", "copies", "_saved", "seeded", "held")

    def __init__(self, stream: RandomStream, override: bool = False) -> None:
        self.stream = stream
        self.outer: Optional[_Activation] = None
        self.generators: Dict[torch.device, torch.Generator] = {}
        self.drew = False
        #: Streams forked in this activation so far (see :meth:`derive`).
        self.forks = 0
        #: device -> the CallRng whose initial state ``torch.set_rng_state``
        #: put this activation at (seeded from it at the next draw).
        self.restored: Dict[torch.device, "CallRng"] = {}
        #: Pushed by ``torch.set_rng_state`` of a stream's state outside any
        #: activation (see :func:`_set_rng_state`); it records nothing.
        self.override = override
        #: For the capturing activation of a ReplayRng: device -> (source, state).
        self.capture: Optional[Dict[torch.device, Tuple[torch.Generator, Tensor]]] = None
        #: A CallRng activation after the stream's first (a recomputation):
        #: explicit generators replay from copies (see :meth:`explicit`).
        self.replay = False
        self.copies: Dict[int, torch.Generator] = {}
        #: The generators ``copies`` stand for, kept alive while it lasts: a
        #: key is a C++ address, which a freed generator would hand on.
        self.held: List[torch.Generator] = []
        self._saved = (False, False)
        #: The seed a ``torch.manual_seed`` inside this activation set (its
        #: generators for devices not drawn from yet start there too).
        self.seeded: Optional[int] = None

    def __enter__(self) -> None:
        stack = _local.stack
        self.outer = stack[-1] if stack else None
        self.stream._opened(self)
        self._saved = (_is_included(_KEY), _is_excluded(_KEY))
        stack.append(self)
        _set_included(_KEY, True)
        if self._saved[1]:
            _set_excluded(_KEY, False)

    def __exit__(self, *exc: Any) -> None:
        stack = _local.stack
        if stack and stack[-1] is self:
            stack.pop()
            included, excluded = self._saved
            _set_included(_KEY, included)
            if excluded:
                _set_excluded(_KEY, True)
        else:
            # Exited out of order (a generator-based context closed late):
            # the activations above stay in force; the one right above takes
            # over what this one restores, and runs in this one's outer.
            i = stack.index(self)
            above = stack[i + 1]
            above._saved, above.outer = self._saved, self.outer
            del stack[i]
        if not self.override:
            self.stream._closed(self)
        spares = _local.spare
        for device, gen in self.generators.items():
            spare = spares.setdefault(device, [])
            if len(spare) < _SPARE_PER_DEVICE:
                spare.append(gen)
        self.generators = {}

    def derive(self, n: int) -> Optional["_DerivedSeeds"]:
        """Seeds for the next ``n`` streams forked in a :class:`CallRng`'s
        activation, derived from its seed without drawing (None in a
        :class:`ReplayRng`'s: those draw from it). Marks the activation as
        drawn from, so that a replay activates it again and the forks get the
        same seeds."""
        stream = self.stream
        if not isinstance(stream, CallRng):
            return None
        first = self.forks
        self.forks = first + n
        self.drew = True
        return _DerivedSeeds(stream, first)

    def generator(self, device: torch.device) -> torch.Generator:
        """This activation's generator for ``device``; marks it as drawn from."""
        self.drew = True
        gen = self.generators.get(device)
        if gen is None:
            if device.type == "cuda" and device.index is None:
                return self.generator(torch.device("cuda", torch.cuda.current_device()))
            origin = self.restored.pop(device, None)
            if self.seeded is not None and origin is None:
                gen = _new_generator(device)
                gen.manual_seed(self.seeded)
            else:
                gen = (origin or self.stream)._generator(device, self)
            self.generators[device] = gen
        return gen

    def manual_seed(self, seed: int) -> None:
        """``torch.manual_seed(seed)`` inside this (CallRng) activation: its
        random ops on every device draw from generators seeded ``seed`` on,
        as the loop's call would from the reseeded global generators; the
        global generators are not touched."""
        self.seeded = int(seed)
        self.restored.clear()
        for device in list(self.generators):
            gen = _new_generator(device)
            gen.manual_seed(self.seeded)
            self.generators[device] = gen

    def explicit(self, gen: torch.Generator) -> torch.Generator:
        """The generator a random op given ``gen`` explicitly draws from: in a
        CallRng's first activation ``gen`` itself (its state at first use is
        recorded), in a later one (a checkpointed call's recomputation) a
        private copy at that state, so the recomputation draws what the
        forward drew and ``gen`` advances once, as in the loop."""
        stream = self.stream
        if self.override or not isinstance(stream, CallRng) or self._owns(gen):
            return gen
        self.drew = True
        # (The recorded wrapper keeps the generator, so its address, alive.)
        key = _identity(gen)
        if not self.replay:
            lazy = stream._lazy
            users = lazy[0].users if lazy is not None else None
            if users is not None:
                first = users.setdefault(key, lazy[1])  # type: ignore[index]
                if first != lazy[1]:  # type: ignore[index]
                    raise RuntimeError(
                        f"this call and call {first} of the batch draw from the same "
                        "torch.Generator; running at once, their draws would interleave in no "
                        "fixed order, where the loop's come in call order: give each expert a "
                        "generator of its own, or run the batch with mode='inline'")
            states = stream._explicit
            if states is None:
                states = stream._explicit = {}
            if key not in states:
                states[key] = (gen, gen.get_state())
            return gen
        copy = self.copies.get(key)
        if copy is None:
            recorded = stream._explicit or {}
            found = recorded.get(key)
            if found is None:
                # A generator the expert builds in its forward is a new object
                # in the recomputation: the forward's, if it starts at the
                # state one of the forward's had at its first use (issue 46).
                state = gen.get_state()
                found = next((f for f in recorded.values() if f[0].device == gen.device
                              and torch.equal(f[1], state)), None)
            if found is None:
                raise RuntimeError(
                    "a replay of a checkpointed call draws from a torch.Generator that its "
                    "forward did not draw from, at a state none of the forward's generators "
                    "started at: a generator the expert builds in forward must be seeded the "
                    "same way every time (or pass one in); else call it with checkpoint=False")
            copy = self.copies[key] = torch.Generator(device=gen.device)
            copy.set_state(found[1])
            self.held.append(gen)
        return copy

    def _owns(self, gen: torch.Generator) -> bool:
        """Whether ``gen`` is a generator of this activation or of one it
        runs in: what a routed op hands the ops it is made of."""
        key = _identity(gen)
        activation: Optional[_Activation] = self
        while activation is not None:
            if any(_identity(g) == key for g in activation.generators.values()) or any(
                    _identity(g) == key for g in activation.copies.values()):
                return True
            activation = activation.outer
        return False

    def get_state(self, device: torch.device) -> Tensor:
        """``torch.get_rng_state()`` inside this (CallRng) activation: the
        state of the generator its random ops draw from, tagged with the
        stream; before the first draw, a tag for the stream's initial state
        (its seed may not be drawn yet, and need not be)."""
        gen = self.generators.get(device)
        if gen is not None:
            state = gen.get_state()
            setattr(state, _STATE_TAG, (False, self.stream))
            return state
        origin = self.restored.get(device) or self.stream
        state = _initial_state().clone()
        setattr(state, _STATE_TAG, (True, origin))
        return state

    def set_state(self, device: torch.device, state: Tensor) -> None:
        """``torch.set_rng_state(state)`` inside this activation: its random
        ops draw from ``state`` on (a stream's initial state: seeded from
        that stream at the next draw)."""
        tag = getattr(state, _STATE_TAG, None)
        self.generators.pop(device, None)
        self.restored.pop(device, None)
        if tag is not None and tag[0]:
            self.restored[device] = tag[1]
        else:
            gen = _new_generator(device)
            gen.set_state(state)
            self.generators[device] = gen


class _LazySeeds:
    """The seeds of a batch of streams forked outside any stream: drawn from
    the default CPU generator, all at once, when the first of them is needed
    (the first random op of any of the calls). A batch whose calls draw
    nothing leaves the global generator untouched, as the plain calls would.

    A batch that raises in call ``f`` is one whose loop stopped there: if
    only calls after ``f`` drew (they ran concurrently), the loop never moved
    the generator, so :func:`rewind_unrun_draws` puts it back (``first``: the
    lowest call that asked for its seed; ``failed``: the lowest that failed;
    ``states``: the generator's state before and after the draw)."""

    __slots__ = ("n", "values", "lock", "first", "failed", "states", "users")

    def __init__(self, n: int) -> None:
        #: Set by :func:`mark_concurrent`: explicit generator -> its first call.
        self.users: Optional[Dict[int, int]] = None
        self.n = n
        self.values: Optional[List[int]] = None
        self.lock = threading.Lock()
        self.first = n
        self.failed = n
        self.states: Optional[Tuple[Tensor, Tensor]] = None

    def get(self, i: int) -> int:
        values = self.values
        if values is None:
            with self.lock:
                values = self.values
                if values is None:
                    before = torch.default_generator.get_state()
                    # An explicit generator: the router passes it through,
                    # whichever stream is active on the drawing thread.
                    values = self.values = torch.empty(self.n, dtype=torch.int64).random_(
                        -(1 << 63), None, generator=torch.default_generator).tolist()
                    self.states = (before, torch.default_generator.get_state())
        if i < self.first:
            with self.lock:
                self.first = min(self.first, i)
        return values[i]

    def fail(self, i: int) -> None:
        with self.lock:
            self.failed = min(self.failed, i)

    def rewind(self) -> None:
        with self.lock:
            states = self.states
            if states is None or self.first <= self.failed:
                return  # nothing drawn, or a call the loop ran drew
            if torch.equal(torch.default_generator.get_state(), states[1]):
                torch.default_generator.set_state(states[0])  # nobody drew since
            self.states = None


class _DerivedSeeds:
    """The seeds of streams forked inside a :class:`CallRng`'s activation:
    the ``first + i``-th fork's seed is a hash of the parent stream's seed and
    ``first + i``, so the parent's own draws are not shifted by the forks, the
    parent's seed is needed (drawn, if it is lazy) only when a child draws,
    and a recomputation of the parent forks the same seeds again. (A nested
    batch of calls that draw nothing leaves every generator alone, as its
    plain loop would.)"""

    __slots__ = ("parent", "first", "users")

    def __init__(self, parent: "CallRng", first: int) -> None:
        self.parent = parent
        self.first = first
        self.users: Optional[Dict[int, int]] = None  # see _LazySeeds

    def get(self, i: int) -> int:
        return _mix64(self.parent.seed ^ _mix64(_FORK_SALT + self.first + i))

    def fail(self, i: int) -> None:
        pass  # a parent's draw is the parent's (see _LazySeeds.rewind)

    def rewind(self) -> None:
        pass


#: Salts the derived seeds of forks (see :class:`_DerivedSeeds`) apart from the
#: per-device codes a stream's own generators are seeded with.
_FORK_SALT = 0x5EED_F0CC_0000_0000

_Seeds = Union[_LazySeeds, _DerivedSeeds]


class CallRng:
    """The random stream of one call: a seed, replayed by every :meth:`activate`.

    A stream forked outside any stream gets its seed lazily (see
    :class:`_LazySeeds`): the default generator is read only if a call draws."""

    __slots__ = ("_seed", "_lazy", "drew", "_explicit")

    def __init__(self, seed: Optional[int] = None, lazy: Optional[Tuple[_Seeds, int]] = None
                 ) -> None:
        self._seed: Optional[int] = None if seed is None else int(seed) & _MASK64
        self._lazy = lazy
        #: ``generator._cdata -> (generator, state)``: explicit generators at their
        #: first use in the first activation (see :meth:`_Activation.explicit`).
        self._explicit: Optional[Dict[int, Tuple[torch.Generator, Tensor]]] = None
        #: Whether a random op drew from this stream during the last
        #: :meth:`activate` (None before the first). A replay of a run that drew
        #: nothing needs no routing: the same ops draw nothing again.
        self.drew: Optional[bool] = None

    @property
    def seed(self) -> int:
        """The stream's 64-bit seed (drawn now if it is still lazy)."""
        seed = self._seed
        if seed is None:
            assert self._lazy is not None
            seeds, i = self._lazy
            seed = self._seed = seeds.get(i) & _MASK64
        return seed

    @classmethod
    def fork(cls, generator: Optional[torch.Generator] = None) -> "CallRng":
        """A fresh stream: a 64-bit seed drawn now from ``generator``, or from
        the active stream if that is a :class:`ReplayRng`; derived from the
        active :class:`CallRng`'s seed and the fork's place in its activation
        (see :class:`_DerivedSeeds`); otherwise from the default CPU
        generator, drawn when the stream first draws."""
        if generator is None:
            stack = _local.stack
            if not stack:
                return cls(lazy=(_LazySeeds(1), 0))
            derived = stack[-1].derive(1)
            if derived is not None:
                return cls(lazy=(derived, 0))
        buffer = _local.seed_buffer
        if buffer is None:
            buffer = _local.seed_buffer = torch.empty((), dtype=torch.int64)
        return cls(int(buffer.random_(-(1 << 63), None, generator=generator).item()))

    @classmethod
    def fork_many(cls, n: int) -> List["CallRng"]:
        """``n`` streams, forked in order (as :meth:`fork`: derived from the
        active :class:`CallRng`, drawn from an active :class:`ReplayRng` now,
        or from the default CPU generator with one draw of ``n`` seeds when
        one of them first draws)."""
        stack = _local.stack
        seeds: Optional[_Seeds] = _LazySeeds(n) if not stack else stack[-1].derive(n)
        if seeds is not None:
            return [cls(lazy=(seeds, i)) for i in range(n)]
        if n == 1:
            return [cls.fork()]
        drawn = torch.empty(n, dtype=torch.int64).random_(-(1 << 63), None)
        return [cls(seed) for seed in drawn.tolist()]

    def activate(self) -> _Activation:
        """Context manager: routes this thread's random ops to generators
        seeded by :attr:`seed` (fresh ones on every entry)."""
        return _Activation(self)

    def failed(self) -> None:
        """Records that this stream's call failed (see :func:`rewind_unrun_draws`)."""
        if self._lazy is not None:
            seeds, i = self._lazy
            seeds.fail(i)

    def _opened(self, activation: _Activation) -> None:
        activation.replay = self.drew is not None

    def _generator(self, device: torch.device, activation: _Activation) -> torch.Generator:
        code = _DEVICE_CODES.get(device)
        if code is None:
            code = _DEVICE_CODES[device] = zlib.crc32(f"{device.type}:{device.index}".encode())
        gen = _new_generator(device)
        gen.manual_seed(_mix64(self.seed ^ code))
        return gen

    def _closed(self, activation: _Activation) -> None:
        self.drew = activation.drew

    def __repr__(self) -> str:
        if self._seed is None:
            return "CallRng(seed not drawn yet)"
        return f"CallRng(seed={self._seed:#018x})"


def mark_concurrent(streams: Sequence[CallRng]) -> None:
    """The calls of these streams (one batch, from :meth:`CallRng.fork_many`)
    run at once: a ``torch.Generator`` passed explicitly to random ops of two
    of them raises (see :meth:`_Activation.explicit`)."""
    seen: Set[int] = set()
    for stream in streams:
        lazy = stream._lazy
        if lazy is not None and id(lazy[0]) not in seen:
            seen.add(id(lazy[0]))
            lazy[0].users = {}


def rewind_unrun_draws(streams: Sequence[Optional[RandomStream]]) -> None:
    """A batch whose calls ran concurrently raised (a call's
    :meth:`CallRng.failed` was recorded): if its seeds were drawn from the
    default generator only for calls after the first that failed (calls the
    loop never reached), puts the generator back where the draw found it,
    unless something else drew from it since."""
    seen: Set[int] = set()
    for stream in streams:
        lazy = getattr(stream, "_lazy", None)
        if lazy is not None and id(lazy[0]) not in seen:
            seen.add(id(lazy[0]))
            lazy[0].rewind()


def _default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cpu":
        return torch.default_generator
    if device.type == "cuda":
        torch.cuda.init()
        index = torch.cuda.current_device() if device.index is None else device.index
        return torch.cuda.default_generators[index]
    raise RuntimeError(f"moe_autograd.rng.ReplayRng: no default generator known for {device}")


class ReplayRng:
    """The stream the thread would draw from anyway, recorded so that it can
    be replayed: what a checkpointed call uses so that it computes exactly
    what the plain call computes.

    The first :meth:`activate` (the forward) draws, per device, from a private
    copy of the enclosing stream's generator (or of the default generator when
    no stream is active) taken at its first draw there, and at exit advances
    that generator to where the copy ended, as the plain code would have (a
    default generator is left alone if another thread drew from it meanwhile).
    Every later :meth:`activate` replays the same numbers from the recorded
    states, touching no other generator.
    """

    __slots__ = ("drew", "_states", "_capturing")

    def __init__(self) -> None:
        #: Whether the last :meth:`activate` drew (None before the first).
        self.drew: Optional[bool] = None
        self._states: Optional[Dict[torch.device, Tensor]] = None
        self._capturing = False

    @property
    def captured(self) -> bool:
        """Whether the first activation (the one that records) has ended."""
        return self._states is not None

    def activate(self) -> _Activation:
        """Context manager: the first entry records, every later one replays."""
        return _Activation(self)

    def _opened(self, activation: _Activation) -> None:
        if self._states is None:
            if self._capturing:
                raise RuntimeError("ReplayRng activated again before its first activation ended")
            self._capturing = True
            activation.capture = {}

    def _generator(self, device: torch.device, activation: _Activation) -> torch.Generator:
        if activation.capture is not None:
            outer = activation.outer
            source = outer.generator(device) if outer is not None else _default_generator(device)
            state = source.get_state()
            activation.capture[device] = (source, state)
        else:
            assert self._states is not None
            found = self._states.get(device)
            if found is None:
                raise RuntimeError(
                    f"a replay of a checkpointed call draws random numbers on {device}, where its "
                    "forward drew none: the function is not deterministic given its inputs and "
                    "its random stream, so it cannot be recomputed exactly")
            state = found
        gen = _new_generator(device)
        gen.set_state(state)
        return gen

    def _closed(self, activation: _Activation) -> None:
        self.drew = activation.drew
        capture = activation.capture
        if capture is None:
            return
        for device, (source, state) in capture.items():
            # Advance the source as the plain code would have, unless another
            # thread drew from it meanwhile (then leave its draws in place).
            if torch.equal(source.get_state(), state):
                source.set_state(activation.generators[device].get_state())
        self._states = {device: state for device, (_, state) in capture.items()}
        self._capturing = False

    def __repr__(self) -> str:
        devices = "not recorded" if self._states is None else sorted(map(str, self._states))
        return f"ReplayRng({devices})"


# -- torch.get_rng_state / torch.set_rng_state inside a stream ------------------------
# A call's random ops draw from its stream's generators, not from the global
# one; code that saves and restores "the" generator state around a region it
# will run again must see the stream's. torch.utils.checkpoint inside an
# expert does: its forward takes torch.get_rng_state(), its recomputation (in
# backward, on whatever thread, in or outside any activation) runs under
# torch.random.fork_rng with torch.set_rng_state(that state). So:
#
# =========================================  =========================================
# call                                        effect
# =========================================  =========================================
# get, in a CallRng activation                its generator's state, tagged with the
#                                             stream (or a tag for the stream's initial
#                                             state before its first draw: no seed drawn)
# set(tagged or not), in a CallRng activation  its random ops draw from that state on
# set(tagged), outside any CallRng activation  pushes an *override* activation drawing
#                                             from that state; the global generator is
#                                             not touched
# set(untagged), with an override on top      pops it (fork_rng's restore of the state
#                                             it found); the global generator was never
#                                             touched, so it is left as it is
# anything else                               PyTorch's own functions
# =========================================  =========================================
#
# So an expert's torch.utils.checkpoint recomputes with the random numbers its
# forward drew, whatever thread runs the recomputation, and concurrent
# recomputations never save and restore the global generator under each
# other's feet.
_STATE_TAG = "_moe_autograd_stream"
_torch_get_rng_state = torch.random.get_rng_state
_torch_set_rng_state = torch.random.set_rng_state
_INITIAL: List[Tensor] = []


def _initial_state() -> Tensor:
    """A valid CPU generator state, the placeholder body of an initial-state tag."""
    if not _INITIAL:
        _INITIAL.append(torch.Generator().manual_seed(0).get_state())
    return _INITIAL[0]


def _call_activation() -> Optional[_Activation]:
    stack = _local.stack
    top = stack[-1] if stack else None
    return top if top is not None and isinstance(top.stream, CallRng) else None


def _get_rng_state() -> Tensor:
    activation = _call_activation()
    if activation is None:
        return _torch_get_rng_state()
    return activation.get_state(_CPU)


def _set_rng_state(new_state: Tensor) -> None:
    tag = getattr(new_state, _STATE_TAG, None)
    activation = _call_activation()
    if activation is not None and activation.override and tag is None:
        activation.__exit__(None, None, None)
        return
    if activation is None:
        if tag is None:
            _torch_set_rng_state(new_state)
            return
        activation = _Activation(tag[1], override=True)
        activation.__enter__()
    activation.set_state(_CPU, new_state)


_torch_manual_seed = torch.random.manual_seed


def _manual_seed(seed: int) -> Any:
    activation = _call_activation()
    if activation is None or activation.override:
        return _torch_manual_seed(seed)
    activation.manual_seed(seed)  # this call's stream only (issue 46)
    return torch.random.default_generator


_get_rng_state.__doc__ = _torch_get_rng_state.__doc__
_set_rng_state.__doc__ = _torch_set_rng_state.__doc__
_manual_seed.__doc__ = _torch_manual_seed.__doc__
torch.get_rng_state = torch.random.get_rng_state = _get_rng_state
torch.set_rng_state = torch.random.set_rng_state = _set_rng_state
torch.manual_seed = torch.random.manual_seed = _manual_seed


# -- the router -----------------------------------------------------------------------

def _no_stream(op: Any) -> "_Activation":
    raise RuntimeError(
        f"{op} ran with moe_autograd's random-number routing switched on in PyTorch's dispatch "
        "state, but no stream is active on this Python thread: the thread inherited the "
        "dispatch state (an autograd engine device thread running a backward started inside "
        "CallRng.activate(), or a torch.jit.fork task). Start the backward outside the "
        "activation, or draw on the activating thread.")


_get_mode = torch._C._get_dispatch_mode
_PROXY = torch._C._TorchDispatchModeKey.PROXY


def _tracing() -> bool:
    """Whether ops are being recorded into a graph (make_fx, AOTAutograd under
    torch.compile): the graph must keep ``generator=None``, so that it is routed
    when it runs, rather than hold on to the generator of one activation."""
    return _get_mode(_PROXY) is not None


def _stream_generator(op: Any, device: torch.device) -> torch.Generator:
    """The generator of the innermost activation on this thread for ``device``."""
    stack = _local.stack
    activation = stack[-1] if stack else _no_stream(op)
    gen = activation.generators.get(device)
    if gen is None:
        return activation.generator(device)
    activation.drew = True
    return gen


def _identity(gen: torch.Generator) -> int:
    """A generator's identity: the address of its C++ object (the dispatcher
    hands kernels a new Python wrapper of it each time)."""
    return int(gen._cdata)  # type: ignore[attr-defined]


def _explicit_generator(gen: torch.Generator) -> torch.Generator:
    """What a random op given ``gen`` draws from (see :meth:`_Activation.explicit`)."""
    stack = _local.stack
    return stack[-1].explicit(gen) if stack else gen


def _device_of(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> torch.device:
    device = kwargs.get("device")
    if device is not None:
        return device if isinstance(device, torch.device) else torch.device(device)
    for value in args:
        if isinstance(value, Tensor):
            return value.device
    for value in kwargs.values():
        if isinstance(value, Tensor):
            return value.device
    return _CPU


def _excluded(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Calls ``fn`` with the key off: for ops given an explicit generator
    (they draw from it), so that they skip the pass-through hop."""
    _set_excluded(_KEY, True)
    try:
        return fn(*args, **kwargs)
    finally:
        _set_excluded(_KEY, False)


Kernel = Callable[..., Any]


def _route(op: Any) -> Kernel:
    """Ops with a ``generator`` argument: fill it in when left at None."""
    redispatch = op._handle.redispatch_boxed
    arguments = op._schema.arguments
    names = [a.name for a in arguments]
    gen_at = names.index("generator")
    if arguments[gen_at].kwarg_only:
        def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
            given = kwargs.get("generator")
            if given is None:
                device = _device_of(args, kwargs)
                if device.type != "meta" and not _tracing():
                    kwargs["generator"] = _stream_generator(op, device)
            elif not _tracing():
                kwargs["generator"] = _explicit_generator(given)
            return redispatch(keyset.remove(_KEY), *args, **kwargs)
        return kernel

    # `generator` is positional (poisson, binomial, rrelu_with_noise, ...); the
    # dispatcher leaves trailing defaults out, so fill them back in.
    defaults = tuple(a.default_value if a.has_default_value() else None for a in arguments[:gen_at])

    def positional(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        if len(args) <= gen_at or args[gen_at] is None:
            device = _device_of(args, kwargs)
            if device.type != "meta" and not _tracing():
                gen = _stream_generator(op, device)
                head = args[:gen_at] + defaults[len(args):]
                args = head + (gen,) + args[gen_at + 1:]
        elif not _tracing():
            args = args[:gen_at] + (_explicit_generator(args[gen_at]),) + args[gen_at + 1:]
        return redispatch(keyset.remove(_KEY), *args, **kwargs)
    return positional


def _sibling(op: Any, sibling: Any) -> Kernel:
    """Seeded ops without a generator: call the overload that takes one."""
    redispatch = op._handle.redispatch_boxed

    def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        device = _device_of(args, kwargs)
        if device.type == "meta" or _tracing():
            return redispatch(keyset.remove(_KEY), *args, **kwargs)
        kwargs["generator"] = _stream_generator(op, device)
        return _excluded(sibling, *args, **kwargs)
    return kernel


def _native_dropout(input: Tensor, p: float, gen: torch.Generator) -> Tuple[Tensor, Tensor]:
    keep = 1.0 - p
    if input.is_cuda and 0.0 < p < 1.0 and input.numel() > 0:
        # the fused kernel native_dropout uses, with a generator argument
        out, mask = torch.ops.aten._fused_dropout.default(input, keep, gen)
        return out, mask.to(torch.bool)
    scale = 0.0 if keep == 0 else 1.0 / keep
    mask = torch.empty_like(input, memory_format=torch.contiguous_format).bernoulli_(keep, generator=gen)
    return input.mul(mask).mul_(scale), mask.to(torch.bool)


def _dropout(op: Any) -> Kernel:
    """``native_dropout(input, p, train)`` (and its ``out`` form) rewritten to
    draw its mask from the stream."""
    redispatch = op._handle.redispatch_boxed

    def kernel(keyset: Any, input: Tensor, p: float, train: Optional[bool], **kwargs: Any) -> Any:
        if train is False or input.device.type == "meta" or _tracing():
            return redispatch(keyset.remove(_KEY), input, p, train, **kwargs)
        out, mask = _excluded(_native_dropout, input, p, _stream_generator(op, input.device))
        if "out0" not in kwargs:
            return out, mask
        out0, out1 = kwargs["out0"], kwargs["out1"]
        out0.resize_(out.shape).copy_(out)
        out1.resize_(mask.shape).copy_(mask)
        return out0, out1
    return kernel


def _bind(op: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Dict[str, Any]:
    values = {a.name: a.default_value for a in op._schema.arguments if a.has_default_value()}
    values.update((a.name, v) for a, v in zip(op._schema.arguments, args))
    values.update(kwargs)
    return values


def _draws_nothing(values: Dict[str, Any]) -> bool:
    if values.get("train", True) is False:
        return True
    probabilities = [values[k] for k in ("dropout_p", "dropout") if k in values]
    if probabilities and all(p == 0 for p in probabilities):
        return True
    tensors = [v for v in values.values() if isinstance(v, Tensor)]
    return bool(tensors) and all(t.device.type == "meta" for t in tensors)


def _guard(op: Any) -> Kernel:
    """Seeded ops that cannot be routed: pass through only if they draw nothing."""
    redispatch = op._handle.redispatch_boxed

    def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        if _draws_nothing(_bind(op, args, kwargs)):
            return redispatch(keyset.remove(_KEY), *args, **kwargs)
        raise RuntimeError(
            f"{op} draws from the global random generator and cannot be routed to the "
            "call's random stream (moe_autograd.rng); its result could not be "
            "recomputed exactly. Use a dropout-free variant inside the call or apply the "
            "dropout separately (e.g. F.dropout or the math attention backend).")
    return kernel


# Seeded ops that draw nothing: they replay a seed passed in (or saved by their
# forward), or only choose a kernel, or are tagged although they never draw.
_DRAW_NOTHING = {
    "_fused_sdp_choice", "_fill_mem_eff_dropout_mask_", "_cudnn_init_dropout_state",
    "_flash_attention_forward_no_dropout_inplace", "_nested_tensor_softmax_with_shape",
}
_NATIVE_DROPOUT = "native_dropout"


def _tags(name: str, overload: str) -> List[Any]:
    try:  # fast: no OpOverload object for each of the ~3000 aten ops
        return list(torch._C._get_operation_overload(f"aten::{name}", overload)[2])
    except Exception:
        try:
            return list(getattr(getattr(torch.ops.aten, name), overload or "default").tags)
        except Exception:  # pragma: no cover - not an operator Python can call
            return []


def _seeded_aten_ops() -> List[Tuple[str, Any]]:
    """``(qualified name, OpOverload)`` of every aten op tagged seeded."""
    found = []
    for qualified in torch._C._dispatch_get_all_op_names():
        if not qualified.startswith("aten::"):
            continue
        name, _, overload = qualified[len("aten::"):].partition(".")
        if torch.Tag.nondeterministic_seeded in _tags(name, overload):
            found.append((qualified, getattr(getattr(torch.ops.aten, name), overload or "default")))
    names = {qualified for qualified, _ in found}
    expected = {"aten::bernoulli_.float", "aten::uniform_", "aten::normal_", "aten::rand"}
    if not expected <= names:  # never route nothing silently
        raise ImportError(f"moe_autograd.rng: cannot find PyTorch's random ops "
                          f"({sorted(expected - names)} not tagged nondeterministic_seeded)")
    return found


def _plan(qualified: str, op: Any) -> Tuple[str, Optional[Kernel]]:
    """``(kind, kernel)``; no kernel: the op is not intercepted."""
    name = op.overloadpacket.__name__
    if torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "CompositeImplicitAutograd"):
        return "composite", None  # decomposes into ops that are intercepted
    if name in _DRAW_NOTHING or name.endswith("_backward"):
        return "draws nothing", None
    arguments = op._schema.arguments
    names = [a.name for a in arguments]
    if "generator" in names:
        return "route", _route(op)
    if name == _NATIVE_DROPOUT:
        return "dropout", _dropout(op)
    # The sibling takes the same arguments (names and types, the positional
    # ones in the same order) plus a keyword-only generator.
    positional = [(a.name, str(a.type)) for a in arguments if not a.kwarg_only]
    wanted = {(a.name, str(a.type)) for a in arguments} | {("generator", "Optional[Generator]")}
    for overload in op.overloadpacket.overloads():
        sibling = getattr(op.overloadpacket, overload)
        args = sibling._schema.arguments
        if ({(a.name, str(a.type)) for a in args} == wanted
                and [(a.name, str(a.type)) for a in args if not a.kwarg_only] == positional):
            return f"sibling {overload}", _sibling(op, sibling)
    return "guard", _guard(op)


def _register() -> Tuple[Library, Library, Dict[str, str]]:
    fallback = Library("_", "IMPL")
    fallback.fallback(fallthrough_kernel, DISPATCH_KEY)
    lib = Library("aten", "IMPL")
    plans: Dict[str, str] = {}
    for qualified, op in _seeded_aten_ops():
        kind, kernel = _plan(qualified, op)
        plans[qualified] = kind
        if kernel is not None:
            lib.impl(op, kernel, DISPATCH_KEY, with_keyset=True)
    return fallback, lib, plans


_FALLBACK_LIB, _LIB, _PLANS = _register()


def routed_ops() -> Dict[str, str]:
    """What the router does with each seeded aten op: ``route``, ``sibling
    <overload>``, ``dropout``, ``guard`` (raises if it would draw), ``composite``
    or ``draws nothing`` (not intercepted)."""
    return dict(_PLANS)

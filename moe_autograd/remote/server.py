"""``ExpertServer``: makes modules callable by name from any worker of the world.

Why: experts that do not fit on (or are owned by) the training process live in
other processes or machines. A server registers its experts in this process's
registry; clients (:class:`~moe_autograd.remote.RemoteExpert`) reach them with
the ``serve_*`` functions below, run here by the transport's threads.

Backward strategies (chosen per server):

* ``stateless`` (default): nothing is kept between forward and backward; the
  client sends the inputs back with the output gradients and the server
  recomputes the forward under the same seed (dropout masks replayed).
* ``stateful``: the forward's graph is kept under the client's call id in a
  :class:`~moe_autograd.remote.state.StateStore` (see its lifecycle table),
  freed at backward, on release by the client, past ``state_ttl``, or when
  more than ``max_states`` are held.

Invariants:

* A ``serve_*`` function never raises: every error (unknown expert, malformed
  request, wrong shapes or dtypes, an expert that raises) becomes an
  ``("error", text)`` reply, so one bad request never harms the server.
* Requests overlap freely (one transport thread each); only an expert with an
  optimizer in ``auto_step`` mode serialises its backward+step.
* After :meth:`ExpertServer.close` returns, its experts are unknown here and
  its states are freed.
"""
import threading
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from . import execution as ex
from .state import CallState, StateStore
from .transport import Transport, get_transport

__all__ = ["ExpertServer", "serve_forward", "serve_backward", "serve_release", "serve_control",
           "OPS"]

Reply = Tuple[str, Any]  # ("ok", value) or ("error", text)
OptimizerFactory = Callable[[Iterator[nn.Parameter]], torch.optim.Optimizer]
BACKWARDS = ("stateless", "stateful")


@dataclass
class _Hosted:
    name: str
    module: nn.Module
    server: "ExpertServer"
    optimizer: Optional[torch.optim.Optimizer]
    lock: threading.Lock = field(default_factory=threading.Lock)


_experts: Dict[str, _Hosted] = {}
_registry_lock = threading.Lock()


class ExpertServer:
    """Serves ``experts`` (name -> module) to the RPC world until :meth:`close`.

    Construct it before or after ``rpc.init_rpc(...)`` (before: the experts
    are there from the first request a peer can send). ``optimizer`` is a factory
    ``params -> Optimizer`` (one optimizer per expert); with ``auto_step`` the
    server steps and zeroes the gradients after every backward (hivemind
    style, asynchronous SGD); without it clients call
    :meth:`RemoteExpert.step` / :meth:`RemoteExpert.zero_grad`. Without an
    optimizer, parameter gradients accumulate into ``.grad`` as local autograd
    would, before the client's backward returns.
    """

    def __init__(self, experts: Mapping[str, nn.Module], *, backward: str = "stateless",
                 optimizer: Optional[OptimizerFactory] = None, auto_step: bool = True,
                 state_ttl: float = 60.0, max_states: int = 1024,
                 transport: Optional[Transport] = None) -> None:
        if backward not in BACKWARDS:
            raise ValueError(f"backward must be one of {BACKWARDS}, got {backward!r}")
        for name, module in experts.items():
            if not isinstance(name, str) or not isinstance(module, nn.Module):
                raise TypeError(f"experts must map str to nn.Module, got {name!r}: {type(module)}")
        self._transport = transport or get_transport()
        ex.warm_up()
        self.backward, self.auto_step = backward, auto_step and optimizer is not None
        self.store = StateStore(state_ttl, max_states) if backward == "stateful" else None
        self._closed = threading.Event()
        self._busy = 0
        self._idle = threading.Condition()
        hosted = {name: _Hosted(name, module, self,
                                optimizer(module.parameters()) if optimizer else None)
                  for name, module in experts.items()}
        with _registry_lock:
            taken = sorted(set(hosted) & set(_experts))
            if taken:
                raise ValueError(f"experts {taken} are already served in this process")
            _experts.update(hosted)
        self.names: List[str] = list(hosted)
        if self.store is not None:
            interval = min(max(state_ttl / 4, 0.05), 1.0)
            threading.Thread(target=self._sweep, args=(interval,), daemon=True,
                             name="moe_autograd-state-sweeper").start()

    @property
    def worker(self) -> str:
        """This process's worker name (``"?"`` before ``init_rpc``)."""
        try:
            return self._transport.local_name()
        except Exception:  # noqa: BLE001
            return "?"

    def _sweep(self, interval: float) -> None:
        while not self._closed.wait(interval):
            assert self.store is not None
            self.store.sweep()

    def _enter(self) -> None:
        with self._idle:
            if self._closed.is_set():
                raise RuntimeError("the expert server is closed")
            self._busy += 1

    def _exit(self) -> None:
        with self._idle:
            self._busy -= 1
            self._idle.notify_all()

    def stats(self) -> Dict[str, Any]:
        """Live states and counters (``live`` is 0 for a stateless server)."""
        base: Dict[str, Any] = {"worker": self.worker, "backward": self.backward,
                                "in_flight": self._busy, "experts": list(self.names)}
        base.update(self.store.stats() if self.store is not None else {"live": 0})
        return base

    def close(self, timeout: float = 10.0) -> None:
        """Stops serving: new requests fail at once, requests in flight get up
        to ``timeout`` seconds to finish, states are freed. Idempotent."""
        with _registry_lock:
            for name in self.names:
                if _experts.get(name) is not None and _experts[name].server is self:
                    del _experts[name]
        with self._idle:
            self._closed.set()
            self._idle.wait_for(lambda: self._busy == 0, timeout)
        if self.store is not None:
            self.store.clear()

    def __enter__(self) -> "ExpertServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _lookup(name: Any) -> _Hosted:
    if not isinstance(name, str):
        raise TypeError(f"expert name must be a str, got {type(name).__name__}")
    with _registry_lock:
        hosted = _experts.get(name)
        if hosted is None:
            raise LookupError(f"unknown expert {name!r}; this worker serves "
                           f"{sorted(_experts) or 'no experts'}")
    return hosted


def _guarded(name: Any, fn: Callable[[_Hosted], Any]) -> Reply:
    try:
        hosted = _lookup(name)
        server = hosted.server
        server._enter()
        try:
            return "ok", fn(hosted)
        finally:
            server._exit()
    except Exception as error:  # noqa: BLE001 - a request must never harm the server
        where = "".join(traceback.format_exception(error)[-6:])
        return "error", f"{type(error).__name__}: {error}\n-- server traceback (tail) --\n{where}"


def _forward(hosted: _Hosted, call_id: str, seed: int, grad: bool, flags: Sequence[bool],
             args: Sequence[Any]) -> Tuple[List[Any], bool, List[bool], str]:
    store = hosted.server.store
    keep = bool(grad) and store is not None
    leaves, outputs, single, diff = ex.run_forward(hosted.module, args, flags, int(seed),
                                                   grad=bool(grad), keep_graph=keep)
    mode = "none" if not any(diff) else "stateful" if keep else "stateless"
    if mode == "stateful":
        assert store is not None
        store.put(str(call_id), CallState(hosted.name, leaves, outputs))
    return [ex.to_wire(o) for o in outputs], single, diff, mode


def _backward(hosted: _Hosted, call_id: str, seed: int, args: Optional[Sequence[Any]],
              flags: Sequence[bool], grads: Sequence[Any]) -> List[Any]:
    store = hosted.server.store
    if args is None:  # stateful
        if store is None:
            raise RuntimeError("a stateful backward reached a stateless server")
        state = store.pop(str(call_id))
        if state.expert != hosted.name:
            raise RuntimeError(f"call {call_id!r} belongs to expert {state.expert!r}")
        leaves, outputs = state.leaves, state.outputs
    else:
        leaves, outputs = ex.recompute(hosted.module, args, flags, int(seed))
    if not hosted.server.auto_step:
        return ex.run_backward(leaves, outputs, grads)
    assert hosted.optimizer is not None
    with hosted.lock:
        result = ex.run_backward(leaves, outputs, grads)
        hosted.optimizer.step()
        hosted.optimizer.zero_grad()
    return result


def _control(hosted: _Hosted, op: str, payload: Any) -> Any:
    module = hosted.module
    if op == "step":
        if hosted.optimizer is None:
            raise RuntimeError("this expert has no optimizer: pass optimizer=... to ExpertServer")
        with hosted.lock:
            hosted.optimizer.step()
        return None
    if op == "zero_grad":
        with hosted.lock:
            module.zero_grad(set_to_none=bool(payload))
        return None
    if op == "grads":
        return {n: ex.to_wire(p.grad.clone()) if p.grad is not None else None
                for n, p in module.named_parameters()}
    if op == "state_dict":
        return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
    if op == "load_state_dict":
        with hosted.lock, torch.no_grad():
            module.load_state_dict(payload)
        return None
    if op == "stats":
        return dict(hosted.server.stats(), expert=hosted.name,
                    optimizer=hosted.optimizer is not None, auto_step=hosted.server.auto_step)
    raise ValueError(f"unknown control operation {op!r}")


# -- the functions the transport runs on this worker ---------------------------
def serve_forward(name: str, call_id: str, seed: int, grad: bool, flags: Sequence[bool],
                  args: Sequence[Any]) -> Reply:
    return _guarded(name, lambda h: _forward(h, call_id, seed, grad, flags, args))


def serve_backward(name: str, call_id: str, seed: int, args: Optional[Sequence[Any]],
                   flags: Sequence[bool], grads: Sequence[Any]) -> Reply:
    return _guarded(name, lambda h: _backward(h, call_id, seed, args, flags, grads))


def serve_control(name: str, op: str, payload: Any = None) -> Reply:
    return _guarded(name, lambda h: _control(h, op, payload))


def serve_release(call_ids: Sequence[str]) -> Reply:
    """Frees the states of ``call_ids`` in every stateful server of this process."""
    try:
        with _registry_lock:
            stores = {id(h.server): h.server.store for h in _experts.values()}
        ids = [str(c) for c in call_ids]
        return "ok", sum(s.release(ids) for s in stores.values() if s is not None)
    except Exception as error:  # noqa: BLE001
        return "error", f"{type(error).__name__}: {error}"


OPS: Dict[str, Callable[..., Reply]] = {
    "forward": serve_forward, "backward": serve_backward, "control": serve_control}


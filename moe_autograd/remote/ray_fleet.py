"""The elastic fleet on Ray's own membership: :class:`RayFleet`.

Why: the RPC fleet (:mod:`.fleet`) builds membership itself (a store, beats,
a reaper, RPC's private dynamic-membership internals). A Ray cluster already
has it: nodes join (``ray start --address=...``) and leave or die (heartbeats),
and expert servers are named actors (:class:`~.ray_backend.RayExpertServer`)
that Ray ends when their node or owner dies. A :class:`RayFleet` only reads
that: the named actors of its namespace, and what each serves. The same
:class:`~.fleet.FleetExpert` calls experts by name over it (forward retried on
another replica, backward to the replica that ran the forward, a name with
no replica masked at once), so a ``MixtureOfExperts`` of fleet experts runs on
either engine.

Lifecycle of a server as a RayFleet sees it::

    state     entered when                               chosen for new calls?
    --------  -----------------------------------------  ----------------------------------
    unseen    the actor starts (its name is registered)  no
    serving   a poll finds it and its info() answers     yes (oldest first, then the
                                                         replica that served last)
    draining  RayExpertServer.leave() / SIGTERM of a     no; calls in flight and held states
              'serve --engine ray' process               are still served (up to its drain
                                                         timeout)
    gone      the actor ended, crashed or its node died  no; calls to it fail at once
              (Ray removes its name); or info() fails    (ActorDiedError) and are retried
                                                         or masked; forgotten at the next
                                                         poll
    suspect   a call to it failed on the transport       no, for ``suspect_for`` seconds

Invariants:

* Only public Ray API: ``ray.util.list_named_actors``, ``ray.get_actor``,
  ``ray.wait``; no store, no beats, no reaper here.
* A poll costs one name listing and one ``info()`` per server (answered
  concurrently, bounded by ``info_timeout``); a server that does not answer
  is left out of that poll's roster.
* :meth:`replicas` never blocks; the watch thread is a daemon stopped by
  :meth:`shutdown` (every wait bounded).
"""
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .fleet import FleetExpert
from .ray_backend import NAMESPACE, RayTransport, _ray
from .transport import Transport, check_timeout

__all__ = ["RayFleet"]


class RayFleet:
    """The expert servers (named actors) of ``namespace`` in the Ray cluster
    this process is connected to, refreshed every ``poll`` seconds.

    ``fleet.expert("ffn0", forward_timeout=..., backward_timeout=...)`` is a
    :class:`~.fleet.FleetExpert` over it. ``transport``: the
    :class:`~.ray_backend.RayTransport` its calls use (default: one of this
    namespace).
    """

    def __init__(self, namespace: str = NAMESPACE, *, poll: float = 0.5,
                 suspect_for: float = 2.0, info_timeout: float = 5.0,
                 transport: Optional[Transport] = None) -> None:
        ray = _ray()
        if not ray.is_initialized():
            raise RuntimeError("Ray is not initialised in this process: call "
                               "ray.init(address=...) before creating a RayFleet")
        self.namespace = namespace
        self.poll = check_timeout("poll of RayFleet", poll) or 0.5
        self.suspect_for = check_timeout("suspect_for of RayFleet", suspect_for) or 0.0
        self.info_timeout = check_timeout("info_timeout of RayFleet", info_timeout) or 5.0
        self.transport: Transport = transport or RayTransport(namespace)
        self._lock = threading.Lock()
        self._handles: Dict[str, Any] = {}
        # name -> (first seen, experts -> strategy, state)
        self._records: Dict[str, Tuple[float, Dict[str, str], str]] = {}
        self._suspects: Dict[str, float] = {}
        self._first_served: Dict[str, float] = {}
        self._last_miss_refresh = 0.0
        self._stop = threading.Event()
        self._poll_once()
        self._thread = threading.Thread(target=self._watch, daemon=True,
                                        name="moe_autograd-ray-fleet")
        self._thread.start()

    # -- the roster ---------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._stop.wait(self.poll):
            try:
                self._poll_once()
            except Exception:  # noqa: BLE001 - the cluster is busy or gone: the cache stands
                pass

    def _poll_once(self) -> None:
        ray = _ray()
        names = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                       if a.get("namespace") == self.namespace)
        refs: Dict[str, Any] = {}
        for name in names:
            handle = self._handles.get(name)
            try:
                if handle is None:
                    handle = ray.get_actor(name, namespace=self.namespace)
                refs[name] = handle.info.remote()
            except Exception:  # noqa: BLE001 - gone meanwhile, or not an expert server
                self._handles.pop(name, None)
                continue
            self._handles[name] = handle
        ready: List[Any] = []
        if refs:
            ready, _ = ray.wait(list(refs.values()), num_returns=len(refs),
                                timeout=self.info_timeout)
        now = time.monotonic()
        records: Dict[str, Tuple[float, Dict[str, str], str]] = {}
        done = set(ready)
        for name, ref in refs.items():
            if ref not in done:
                continue
            try:
                info = ray.get(ref)
            except Exception:  # noqa: BLE001 - died: Ray fails its calls
                self._handles.pop(name, None)
                continue
            known = self._records.get(name)
            first = known[0] if known is not None else now
            records[name] = (first, dict(info.get("experts", {})), str(info.get("state", "serving")))
        for name in set(self._handles) - set(names):
            del self._handles[name]
        with self._lock:
            self._records = records

    def refresh(self) -> None:
        """Reads the cluster now (the watch thread does so every ``poll``)."""
        self._poll_once()

    def refresh_on_miss(self) -> None:
        """:meth:`refresh`, at most every ``poll / 4`` seconds (a name with no
        replica cached may have one that started since the last poll)."""
        now = time.monotonic()
        if now - self._last_miss_refresh < self.poll / 4:
            return
        self._last_miss_refresh = now
        try:
            self._poll_once()
        except Exception:  # noqa: BLE001
            pass

    def replicas(self, expert: str) -> List[str]:
        """Serving servers hosting ``expert`` now, oldest first."""
        now = time.monotonic()
        with self._lock:
            found = [(first, name) for name, (first, experts, state) in self._records.items()
                     if expert in experts and state == "serving"
                     and self._suspects.get(name, 0.0) <= now]
        return [name for _, name in sorted(found)]

    def servers(self) -> Dict[str, Tuple[str, ...]]:
        """Serving servers and the experts each hosts."""
        with self._lock:
            return {name: tuple(experts) for name, (_, experts, state) in
                    sorted(self._records.items(), key=lambda item: item[1][0])
                    if state == "serving"}

    def suspect(self, worker: str, why: str = "") -> None:
        """Skips ``worker`` for ``suspect_for`` seconds (a call failed on the transport)."""
        with self._lock:
            self._suspects[worker] = time.monotonic() + self.suspect_for

    def _served(self, worker: str) -> None:
        if worker not in self._first_served:
            self._first_served[worker] = time.monotonic()

    def first_served(self, worker: str) -> Optional[float]:
        """When (``time.monotonic()``) ``worker`` first served a call of this fleet."""
        return self._first_served.get(worker)

    # -- experts --------------------------------------------------------------------------
    def expert(self, name: str, *, forward_timeout: Optional[float] = None,
               backward_timeout: Optional[float] = None,
               attempt_timeout: Optional[float] = None) -> FleetExpert:
        """A module that calls the expert ``name`` on a serving replica."""
        return FleetExpert(self, name, forward_timeout=forward_timeout,
                           backward_timeout=backward_timeout, attempt_timeout=attempt_timeout)

    def experts(self, names: Sequence[str], **timeouts: Optional[float]) -> List[FleetExpert]:
        return [self.expert(name, **timeouts) for name in names]

    def wait_for(self, experts: Sequence[str], timeout: float = 30.0,
                 replicas: int = 1) -> None:
        """Blocks until every name in ``experts`` has ``replicas`` serving replicas."""
        deadline = time.monotonic() + timeout
        while True:
            missing = [e for e in experts if len(self.replicas(e)) < replicas]
            if not missing:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"fewer than {replicas} serving server(s) host {missing} "
                                   f"after {timeout:g} s; serving: {self.servers()}")
            time.sleep(min(self.poll / 2, 0.1))

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stops the watch thread. Idempotent."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def __enter__(self) -> "RayFleet":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

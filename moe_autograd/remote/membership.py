"""Dynamic membership of a ``torch.distributed.rpc`` world: join, leave, reap.

Why this module exists: ``rpc.init_rpc(name, rank, world_size=None)``
(TensorPipe) lets processes join and leave a running world, but torch's own
protocol (checked on torch 2.13, see the tests) breaks on the first crash:

* a killed member stays in every member's name map and in the rendezvous
  store's worker list (``rpc_prefix_0/names/_ALL_WORKER_INFOS``);
* the next join ``rpc_sync``\\ s every listed member, fails on the dead one
  and never releases the group-membership token
  (``RpcGroupManagementToken``): from then on every join *and* every graceful
  leave waits for the store timeout and fails;
* a graceful leave (``rpc.shutdown(graceful=True)``) likewise fails on a dead
  member and keeps the token;
* ranks are worker ids that members key their pipes by, so a rank must never
  be reused; nothing in torch hands them out;
* the store lists members as ``name-rank,`` and a joining agent splits each
  entry at every ``-``: a member whose name contains ``-`` makes every later
  join fail (``ValueError: stoi``), so names here may not contain ``-``
  (:func:`check_name`).

What this module adds, all under torch's own token (so it serialises with
torch's joins and leaves):

* :func:`allocate_rank`: ranks from a counter in the store (rank 0 is the
  world's founder, the process hosting the store);
* :func:`join_world`: waits until no listed member looks dead (its heartbeat,
  see :mod:`.registry`, stands still), then joins; if torch's join still
  fails, releases the token it left held and raises :class:`MembershipError`;
* :func:`leave_world`: torch's graceful leave, except that a member that does
  not answer within a short timeout is skipped (the reaper drops it);
* :func:`reap`: removes dead members from the store's list and from every
  live member's maps, so the world accepts joins again and their names can
  be reused (never their ranks).

Invariants:

* A process joins one world once in its life (``rpc_prefix_0``): torch
  re-initialised in the same process uses another store namespace
  (``rpc_prefix_1``) and would not see the world; :func:`join_world` refuses.
* The membership token is taken by polling ``compare_set`` (never a blocking
  ``wait`` on a store connection that torch's agent also uses) and released
  on every path out of the critical section.
* Never connect to a member's TensorPipe port by hand: on torch 2.13 a bare
  TCP connect-and-close makes the member's listener stop accepting (seen
  here; an :class:`~.elastic.ElasticServer` notices and starts again), so
  liveness comes from heartbeats in the store, never from probes.

Uses private torch RPC internals (the agent's ``store``, ``join``,
``_update_group_membership``); :func:`check_support` says clearly when the
installed torch lacks them.
"""
import re
import secrets
import time
from datetime import timedelta
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from . import rpc_bind

__all__ = ["MembershipError", "check_support", "check_name", "connect_store", "allocate_rank", "found_world",
           "join_world", "leave_world", "reap", "members", "release_stuck_token", "token_holder",
           "store_address",
           "RPC_PREFIX", "TOKEN_KEY", "RANK_KEY", "MAX_RANK"]

RPC_PREFIX = "rpc_prefix_0"       # torch's store namespace of a process's first init_rpc
TOKEN_KEY = "RpcGroupManagementToken"  # torch's group-membership token (rpc/_utils.py)
WORKERS_KEY = "names/_ALL_WORKER_INFOS"  # "name-rank," per member (agent_utils.cpp)
RANK_KEY = "moe_autograd/fleet/ranks"   # the rank counter (outside torch's namespace)
MAX_RANK = (1 << 15) - 1          # worker ids are int16 in the agent
_POLL_S = 0.02                    # token polling period
# torch's tokens: Token_for_<name>_join / _leave; ours: Token_for_<name>_<leave|reap>_<hex>
_TOKEN = re.compile(r"^Token_for_(?P<name>.+)_(?:join|leave|reap)(?:_[0-9a-f]+)?$")


class MembershipError(RuntimeError):
    """Joining, leaving or reaping a dynamic RPC world failed (the message says
    what to do)."""


def check_support() -> None:
    """Raises :class:`MembershipError` if this torch lacks what dynamic
    membership here relies on (TensorPipe's dynamic groups, torch >= 2.0)."""
    try:
        from torch.distributed import rpc
        from torch.distributed.rpc import _utils, api
        from torch._C._distributed_rpc import TensorPipeAgent, WorkerInfo  # noqa: F401
    except ImportError as error:
        raise MembershipError(f"this torch has no torch.distributed.rpc ({error})") from error
    missing = [n for n, ok in (("rpc._utils._update_group_membership",
                                hasattr(_utils, "_update_group_membership")),
                               ("rpc.api._get_current_rpc_agent",
                                hasattr(api, "_get_current_rpc_agent")),
                               ("TensorPipeAgent.store", hasattr(TensorPipeAgent, "store")),
                               ("rpc._init_counter", hasattr(rpc, "_init_counter")))
               if not ok]
    if missing:
        import torch
        raise MembershipError(f"torch {torch.__version__} lacks {missing}: elastic membership "
                              "needs TensorPipe dynamic groups as in torch 2.x "
                              "(rpc.init_rpc(name, rank, world_size=None))")


_NAME = re.compile(r"^[A-Za-z0-9_:]{1,127}$")


def check_name(name: str) -> str:
    """Returns ``name`` if a member of a dynamic world may have it: letters,
    digits, ``_`` and ``:`` (torch also allows ``-``, but its dynamic join
    breaks on it, see the module docstring)."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise MembershipError(f"worker name {name!r} is not usable in a dynamic world: use 1 to "
                              "127 letters, digits, '_' or ':' (no '-': torch 2.13's dynamic "
                              "join splits 'name-rank' at every '-' and fails)")
    return name


def connect_store(host: str, port: int, timeout: float = 30.0) -> Any:
    """A client connection to the world's rendezvous store (the TCPStore that
    rank 0 hosts). Waits up to ``timeout`` seconds for it to come up."""
    import torch.distributed as dist

    try:
        return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout))
    except Exception as error:  # noqa: BLE001 - every connect failure means the same
        raise MembershipError(f"cannot reach the world's store at {host}:{port} within "
                              f"{timeout:g} s (is its founder, rank 0, running?): {error}"
                              ) from error


def _ns(raw: Any) -> Any:
    import torch.distributed as dist

    return dist.PrefixStore(RPC_PREFIX, raw)


def allocate_rank(raw: Any) -> int:
    """A rank no member of this world ever had (1, 2, ...; 0 is the founder's)."""
    rank = int(raw.add(RANK_KEY, 1))
    if rank > MAX_RANK:
        raise MembershipError(f"this world has handed out {rank - 1} ranks, more than the "
                              f"agent's worker ids allow ({MAX_RANK}); start a new world")
    return rank


def members(raw: Any) -> Dict[str, int]:
    """``name -> rank`` of the world's members as the store lists them."""
    ns = _ns(raw)
    if not ns.check([WORKERS_KEY]):
        return {}
    return _parse_workers(ns.get(WORKERS_KEY).decode())


def _parse_workers(text: str) -> Dict[str, int]:
    out: Dict[str, int] = {}
    for entry in text.split(","):
        name, sep, rank = entry.rpartition("-")
        if sep and name and rank.lstrip("-").isdigit():
            out[name] = int(rank)
    return out


def _format_workers(workers: Dict[str, int]) -> str:
    return "".join(f"{name}-{rank}," for name, rank in workers.items())


def token_holder(raw: Any) -> Tuple[str, Optional[str]]:
    """``(token, worker name)`` holding the membership token now (``""`` if free)."""
    ns = _ns(raw)
    if not ns.check([TOKEN_KEY]):
        return "", None
    held = ns.get(TOKEN_KEY).decode()
    match = _TOKEN.match(held)
    return held, (match.group("name") if match else None)


def release_stuck_token(raw: Any, held: str) -> bool:
    """Releases the token if ``held`` still holds it (its holder died inside a
    join or leave); wakes the workers waiting for it. True if released."""
    ns = _ns(raw)
    if not held or ns.compare_set(TOKEN_KEY, held, "").decode() != "":
        return False
    ns.set(held, "Done")  # torch's waiters wait for the holder's key to appear
    return True


class _Token:
    """The membership token, held for one critical section (polls, never
    blocks in a store wait)."""

    def __init__(self, raw: Any, me: str, purpose: str, timeout: float) -> None:
        self.ns, self.timeout = _ns(raw), timeout
        self.token = f"Token_for_{me}_{purpose}_{secrets.token_hex(4)}"

    def __enter__(self) -> "_Token":
        deadline = time.monotonic() + self.timeout
        while True:
            held = self.ns.compare_set(TOKEN_KEY, "", self.token).decode()
            if held == self.token:
                return self
            if time.monotonic() > deadline:
                raise MembershipError(f"the world's membership token is held by {held!r} for "
                                      f"more than {self.timeout:g} s (a member that died inside "
                                      "a join or leave: the fleet's reaper releases it)")
            time.sleep(_POLL_S)

    def __exit__(self, *exc: Any) -> None:
        self.ns.compare_set(TOKEN_KEY, self.token, "")
        self.ns.set(self.token, "Done")


def _agent() -> Any:
    from torch.distributed.rpc import api

    try:
        return api._get_current_rpc_agent()
    except Exception as error:  # noqa: BLE001
        raise MembershipError("torch.distributed.rpc is not initialised in this process"
                              ) from error


def _check_fresh_process() -> None:
    from torch.distributed import rpc

    if getattr(rpc, "_init_counter", 0) != 0:
        raise MembershipError("this process already initialised RPC once: a process can join "
                              "one world once (torch would use another store namespace); "
                              "start a new process")


def found_world(name: str, options: Any) -> None:
    """Starts a dynamic world as its rank 0: this process hosts the store at
    ``options.init_method`` (``tcp://host:port``) and must outlive the world."""
    check_support()
    check_name(name)
    _check_fresh_process()
    rpc_bind.start_rpc(name, 0, None, options)


def join_world(name: str, options: Any, raw: Any, rank: int, *,
               alive: Callable[[Dict[str, int]], List[str]], timeout: float = 30.0) -> None:
    """Joins the running world of ``raw`` (the store) as ``name`` with ``rank``.

    ``alive(names)`` returns those of ``names`` that look alive (heartbeats:
    see :class:`moe_autograd.remote.registry.BeatWatch`); the join waits up to
    ``timeout`` seconds until every listed member does (a dead one must be
    reaped first, or torch's join fails and wedges the world). Raises
    :class:`MembershipError` if the name is taken by a live member, if dead
    members stay listed, or if torch's join fails (the token is released).
    """
    check_support()
    check_name(name)
    _check_fresh_process()
    deadline = time.monotonic() + timeout
    while True:
        listed = members(raw)
        live = set(alive(listed))
        if name in listed and name in live:
            raise MembershipError(f"the name {name!r} is taken by a live member of the world")
        dead = sorted(set(listed) - live)
        if not dead:
            break
        if time.monotonic() > deadline:
            raise MembershipError(f"members {dead} look dead (no heartbeat) and were not reaped "
                                  f"within {timeout:g} s; a Fleet coordinator reaps dead "
                                  "members (is one running?)")
        time.sleep(0.1)
    try:
        rpc_bind.start_rpc(name, rank, None, options)
    except Exception as error:  # noqa: BLE001 - a member died meanwhile, or the name is taken
        released = release_stuck_token(raw, f"Token_for_{name}_join")
        raise MembershipError(f"joining the world as {name!r} (rank {rank}) failed"
                              f"{' (its token released)' if released else ''}: "
                              f"{type(error).__name__}: {error}; a member probably died during "
                              "the join: start this process again") from error


def _update_all(agent: Any, info: Any, is_join: bool, names: Iterable[str],
                timeout: float) -> List[str]:
    """Runs torch's ``_update_group_membership(info, is_join)`` on ``names``
    (locally for this worker) at once; returns the names that failed."""
    from torch.distributed import rpc
    from torch.distributed.rpc._utils import _update_group_membership

    me = agent.get_worker_info().name
    futures = {}
    failed: List[str] = []
    for name in names:
        if name == me:
            _update_group_membership(info, [], {}, is_join)
            continue
        try:
            futures[name] = rpc.rpc_async(name, _update_group_membership,
                                          args=(info, [], {}, is_join), timeout=timeout)
        except Exception:  # noqa: BLE001 - not in this agent's map (already gone)
            failed.append(name)
    for name, future in futures.items():
        try:
            future.wait()
        except Exception:  # noqa: BLE001 - dead or stopped: the reaper's business
            failed.append(name)
    return failed


def leave_world(timeout: float = 10.0, member_timeout: float = 2.0) -> List[str]:
    """Leaves the dynamic world gracefully, like ``rpc.shutdown(graceful=True)``
    but skipping members that do not answer within ``member_timeout`` (they
    are dead and will be reaped). Always shuts RPC down locally in the end.
    Returns the members that could not be told."""
    from torch.distributed import rpc

    agent = _agent()
    me = agent.get_worker_info()
    skipped: List[str] = []
    try:
        raw = connect_store(*_store_address(agent), timeout=member_timeout + 1.0)
        with _Token(raw, me.name, "leave", timeout):
            others = [w.name for w in agent.get_worker_infos() if w.name != me.name]
            # A member that does not answer stays listed until the reaper drops it.
            skipped = _update_all(agent, me, False, others, member_timeout)
            agent.join(shutdown=True, timeout=timeout)  # waits for our calls; drops our names
    finally:
        rpc.shutdown(graceful=False)
    return skipped


def store_address(init_method: str) -> Tuple[str, int]:
    """Host and port of the world's store from a ``tcp://host:port`` init method."""
    try:
        return rpc_bind.store_address(init_method)
    except ValueError as error:
        raise MembershipError(f"dynamic membership needs a tcp://host:port init_method, got "
                              f"{init_method!r}") from error


def _store_address(agent: Any) -> Tuple[str, int]:
    return store_address(agent._get_backend_options().init_method)


def reap(raw: Any, dead: Sequence[str], *, timeout: float = 10.0,
         member_timeout: float = 2.0) -> Dict[str, int]:
    """Removes the ``dead`` members from the world (store list and every live
    member's maps), under the membership token; returns ``name -> rank`` of
    those actually removed. Call it only for members known to be dead: a live
    member removed here can no longer be reached by anyone."""
    from torch._C._distributed_rpc import WorkerInfo

    agent = _agent()
    me = agent.get_worker_info().name
    if me in dead:
        raise MembershipError(f"worker {me!r} cannot reap itself")
    removed: Dict[str, int] = {}
    ns = _ns(raw)
    with _Token(raw, me, "reap", timeout):
        listed = members(raw)
        known = {w.name: int(w.id) for w in agent.get_worker_infos()}
        for name in dead:
            rank = listed.get(name, known.get(name))
            if rank is not None:
                removed[name] = rank
        if not removed:
            return removed
        keep = {n: r for n, r in listed.items() if n not in removed}
        ns.set(WORKERS_KEY, _format_workers(keep))
        for name, rank in removed.items():
            key = f"names/{rank}"
            if ns.check([key]):
                ns.delete_key(key)
        alive = sorted((set(keep) | set(known)) - set(removed))
        for name, rank in removed.items():
            _update_all(agent, WorkerInfo(name, rank), False, alive, member_timeout)
    return removed

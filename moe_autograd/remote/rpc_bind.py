"""Where a torch RPC world listens: the address it was given, not every interface.

Why: torch RPC's own layer trusts every member of its world (TensorPipe
unpickles every call before any check of ours can run), and its rendezvous
store accepts anyone who reaches its port. So on this engine the world must
stay closed, and the first defence is not to listen where strangers are:

* torch's ``tcp://`` rendezvous makes rank 0's ``TCPStore`` listen on all
  interfaces (``*:PORT``) whatever host it was given. :func:`host_store`
  starts that store first, on a socket bound to the given host only, with
  ``multi_tenant=True``: torch's rendezvous then reuses it (a multi-tenant
  store of that port already runs in this process) instead of starting one.
* TensorPipe listens on the address of the interface ``TP_SOCKET_IFNAME``
  names, else on the address its host name resolves to (often the LAN
  address). :func:`bind_interface` sets ``TP_SOCKET_IFNAME`` (unless the user
  set it) to the interface that faces the world's store: ``lo`` for
  ``127.0.0.1``, the one routing to ``MASTER_ADDR`` otherwise.

:func:`start_rpc` does both and calls ``rpc.init_rpc``: the README's
recipes use it, so a world started as written listens on loopback unless an
address is named.

A static world (``world_size`` given) forms only once every rank has come:
torch's ``init_rpc`` then waits in silence for its process group's timeout
(30 minutes), so a trainer started before its servers printed nothing
(issue 43). :func:`start_rpc` first has every rank sign in at the store
(:func:`await_members`): it logs a WARNING naming the ranks still missing
after :data:`ARRIVAL_NOTICE_S` seconds (and every 30 s), and raises
``TimeoutError`` naming them after ``arrival_timeout`` seconds (default: the
options' ``rpc_timeout``, at least :data:`ARRIVAL_TIMEOUT_S`: a member's start
is an interpreter importing torch, which takes tens of seconds on a loaded
machine). Every member of a static world must therefore start with
:func:`start_rpc` (``serve`` does).

Invariants:

* A store started by :func:`host_store` listens on ``host`` only (tested by
  reading the process's listening sockets).
* :func:`listening` reads which TCP sockets a process listens on from
  ``/proc`` (never by connecting: a bare connect-and-close makes a
  TensorPipe listener stop accepting, :mod:`.elastic` watches for that).
* :func:`bind_interface` never overrides a ``TP_SOCKET_IFNAME`` the user set,
  and leaves it unset when no interface can be found (TensorPipe's default).

Noise: torch's own ``init_rpc`` exchanges device maps with
``all_gather_object`` on a Gloo backend of its own, and torch then warns
"You are using a Backend ... as a ProcessGroup. This usage is deprecated"
(once per ``init_rpc``, in every member): torch's usage, nothing the user
did or can change. Importing this module ignores that one warning (by its
text); every other warning is left as it is.
"""
import datetime
import fcntl
import ipaddress
import logging
import os
import re
import socket
import struct
import time
import warnings
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

__all__ = ["host_store", "bind_interface", "interface_for", "start_rpc", "backend_options",
           "is_loopback", "store_address", "await_members", "listening", "IFNAME_ENV",
           "ARRIVAL_NOTICE_S", "ARRIVAL_TIMEOUT_S"]

IFNAME_ENV = "TP_SOCKET_IFNAME"
ARRIVAL_NOTICE_S = 5.0  # a rank still waiting for the others says so after this long
ARRIVAL_TIMEOUT_S = 120.0  # the least time start_rpc gives the other ranks to come
_ARRIVED = "moe_autograd_arrived/"  # + rank: a member of a static world signed in
_log = logging.getLogger(__name__)
warnings.filterwarnings("ignore", message=r"You are using a Backend .* as a ProcessGroup",
                        category=UserWarning)  # torch's own init_rpc (see the docstring)
_SIOCGIFADDR = 0x8915
_stores: Dict[int, Any] = {}  # port -> the store this process hosts (kept alive)


def _socket_inodes(pid: int) -> Set[str]:
    found: Set[str] = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return found
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            found.add(link[8:-1])
    return found


def _proc_address(hex_address: str) -> str:
    host, _, port = hex_address.partition(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        text = socket.inet_ntop(socket.AF_INET, raw[::-1])
    else:  # /proc keeps IPv6 as four little-endian 32-bit words
        text = socket.inet_ntop(socket.AF_INET6, b"".join(raw[k:k + 4][::-1]
                                                          for k in range(0, 16, 4)))
    return f"{text}:{int(port, 16)}"


def listening(pid: Optional[int] = None) -> List[str]:
    """The TCP sockets process ``pid`` (default: this one) listens on, as
    ``address:port``, read from ``/proc`` (empty where there is none)."""
    inodes = _socket_inodes(os.getpid() if pid is None else pid)
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                out.append(_proc_address(fields[1]))
    return out


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def _interface_addresses() -> Dict[str, str]:
    """IPv4 address of each interface (Linux ``SIOCGIFADDR``)."""
    found: Dict[str, str] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)
            except OSError:
                continue
            found[name] = socket.inet_ntoa(reply[20:24])
    return found


def interface_for(host: str) -> Optional[str]:
    """The name of the local interface that has ``host``'s address, or that
    this machine would use to reach it; ``None`` if none can be told."""
    try:
        address = socket.gethostbyname(host)
        if ipaddress.ip_address(address).is_loopback:
            address = "127.0.0.1"
        else:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
                sock.connect((address, 9))  # no packet is sent: the kernel picks a route
                address = sock.getsockname()[0]
        for name, mine in _interface_addresses().items():
            if mine == address:
                return name
    except OSError:
        return None
    return None


def bind_interface(host: str) -> Optional[str]:
    """Makes TensorPipe listen on the interface facing ``host`` (see the
    module docstring); returns the interface it will use (``None``:
    TensorPipe's default)."""
    chosen = os.environ.get(IFNAME_ENV)
    if chosen:
        return chosen
    name = interface_for(host)
    if name is not None:
        os.environ[IFNAME_ENV] = name
    return name


def host_store(host: str, port: int, timeout: float = 300.0) -> Any:
    """Starts this process's rendezvous store for ``tcp://host:port``,
    listening on ``host`` only (see the module docstring)."""
    import torch.distributed as dist

    known = _stores.get(port)
    if known is not None:
        return known
    address = socket.gethostbyname(host)
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, port))
        sock.listen(128)
    except OSError as error:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port} for the world's store: {error}") from error
    store = dist.TCPStore(host, port, None, True, datetime.timedelta(seconds=timeout),
                          wait_for_workers=False, multi_tenant=True,
                          master_listen_fd=sock.detach())
    _stores[port] = store
    return store


def backend_options(master_addr: str, master_port: int, *, rpc_timeout: float = 60.0,
                    num_worker_threads: int = 16, transports: Optional[Sequence[str]] = None,
                    channels: Optional[Sequence[str]] = None) -> Any:
    """TensorPipe options for a member of the world whose store is at
    ``master_addr:master_port`` (``transports=["uv"]`` when processes
    outnumber cores: TensorPipe's same-host ``shm`` transport busy-polls)."""
    from torch.distributed import rpc

    extra: Dict[str, Any] = {}
    if transports:
        extra["_transports"] = list(transports)
    if channels:
        extra["_channels"] = list(channels)
    return rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://{master_addr}:{master_port}",
                                           num_worker_threads=num_worker_threads,
                                           rpc_timeout=rpc_timeout, **extra)


def store_address(init_method: str) -> Tuple[str, int]:
    """Host and port of the world's store from a ``tcp://host:port`` init method."""
    match = re.match(r"^tcp://\[?(?P<host>[^\]]+?)\]?:(?P<port>\d+)/?$", init_method)
    if not match:
        raise ValueError("a world's store is named by a tcp://host:port init_method, got "
                         f"{init_method!r}")
    return match.group("host"), int(match.group("port"))


def await_members(name: str, rank: int, world_size: int, host: str, port: int,
                  timeout: float, *, clock: Any = time.monotonic, pause: Any = time.sleep,
                  notice: float = ARRIVAL_NOTICE_S) -> None:
    """Signs ``rank`` in at the world's store and waits until every rank of
    ``world_size`` has (see the module docstring); raises ``TimeoutError``
    naming the missing ranks after ``timeout`` seconds."""
    import torch.distributed as dist

    where = f"tcp://{host}:{port}"
    started = clock()
    store = _stores.get(port) if rank == 0 else None
    if store is None:
        try:
            store = dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=timeout))
        except Exception as error:  # noqa: BLE001 - torch's DistStoreError, RuntimeError...
            raise TimeoutError(f"start_rpc({name!r}, rank {rank}): cannot reach the world's "
                               f"store at {where} within {timeout:g} s: is rank 0 started, "
                               f"with this address and port? ({type(error).__name__}: "
                               f"{error})") from error
    store.set(f"{_ARRIVED}{rank}", name)
    keys = [f"{_ARRIVED}{r}" for r in range(world_size)]
    next_notice = started + notice
    while True:
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        if not missing:
            return
        now = clock()
        if now - started >= timeout:
            raise TimeoutError(
                f"start_rpc({name!r}, rank {rank}): rank(s) {missing} of the world of "
                f"{world_size} at {where} did not come within {timeout:g} s: start them "
                f"(python -m moe_autograd serve ... --rank R --world-size {world_size}, or "
                f"start_rpc), with the same address and port")
        if now >= next_notice:
            _log.warning("start_rpc(%r, rank %d): waiting for rank(s) %s of the world of %d "
                         "at %s (%.0f s so far; giving up after %g s)", name, rank, missing,
                         world_size, where, now - started, timeout)
            next_notice = now + 30.0
        pause(0.05)


def start_rpc(name: str, rank: int, world_size: Optional[int], options: Any, *,
              arrival_timeout: Optional[float] = None) -> None:
    """``rpc.init_rpc(name, rank, world_size, options)``, listening only where
    the world is (see the module docstring): rank 0 hosts the store on the
    store's host; every rank's TensorPipe binds the interface facing it. In a
    static world, every rank first waits for the others at the store, at
    most ``arrival_timeout`` seconds (:func:`await_members`; default: the
    options' ``rpc_timeout``, at least :data:`ARRIVAL_TIMEOUT_S`)."""
    from torch.distributed import rpc

    host, port = store_address(options.init_method)
    bind_interface(host)
    if rank == 0:
        host_store(host, port)
    if world_size is not None and world_size > 1:
        if arrival_timeout is None:
            arrival_timeout = max(float(options.rpc_timeout), ARRIVAL_TIMEOUT_S)
        await_members(name, rank, world_size, host, port, arrival_timeout)
    rpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=options)

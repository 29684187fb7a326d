"""A private network namespace whose loopback is rate-limited: a slow link on one machine.

Why: every remote row measured on loopback moves bytes for free, so wire
compression cannot show there. Inside a namespace of our own (``ip netns
add``), the loopback device is the namespace's alone; a token bucket on it
(``tc qdisc ... tbf rate R``) makes every byte between the processes inside
cost ``1 / R`` seconds, while nothing outside (other tenants, the host's
loopback) is touched and no traffic leaves the namespace's 127.0.0.1.

What it is not: a full-duplex link. Both directions of a connection leave
through the same ``lo`` and share its one bucket, so the limit of a step is
*all* its bytes, both ways, over the rate (the bench's limit rows count them
so). Latency is not emulated here (the experts sleep, as in the loopback rows).

Lifecycle (:class:`RateLimitedNetns`)::

    event                         what happens
    ----------------------------  -------------------------------------------------------
    __enter__                     ``ip netns add moeab-<pid>-<random>``; its deletion is
                                  registered at exit; ``lo`` up; the tbf qdisc set. Any
                                  failure deletes what was made and raises NetnsUnavailable
    command(argv)                 ``ip netns exec NAME argv...``: a process started with it
                                  (and its children) live in the namespace
    set_rate (inside)             ``tc qdisc replace`` on the namespace's ``lo`` (a process
                                  inside it, as root, changes the rate between rows)
    __exit__ / interpreter exit   ``ip netns del NAME`` (processes still inside keep it
                                  alive, nameless, until they end: run them to completion)
    a run killed outright         the name stays; the next :func:`sweep_stale` deletes
                                  ``moeab-<pid>-*`` names whose pid is gone

Invariants: only names with our prefix are ever deleted; :func:`unavailable`
says why not (not Linux, not root, no ``ip``/``tc``) without changing anything.
"""
import atexit
import os
import secrets
import shutil
import subprocess
import sys
from typing import Any, List, Optional, Sequence

__all__ = ["RateLimitedNetns", "NetnsUnavailable", "unavailable", "set_rate", "namespaces",
           "sweep_stale", "PREFIX"]

PREFIX = "moeab-"
_TIMEOUT_S = 10.0


class NetnsUnavailable(RuntimeError):
    """A namespace could not be made here (the message says why)."""


def unavailable() -> Optional[str]:
    """Why rate-limited namespaces cannot be made here, or ``None``."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return "needs root (ip netns add, tc qdisc): run the bench as root to get these rows"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"no {tool!r} command (install iproute2)"
    return None


def _run(argv: Sequence[str]) -> None:
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=_TIMEOUT_S)
    if done.returncode != 0:
        raise NetnsUnavailable(f"{' '.join(argv)} failed ({done.returncode}): "
                               f"{done.stderr.strip() or done.stdout.strip()}")


def _tbf(rate_mbit: float) -> List[str]:
    """The token bucket of ``rate_mbit``: a burst of at least 256 KiB (a
    loopback packet is up to 64 KiB) or 2 ms of the rate, and a queue of 2 s
    (deep enough that TCP's windows never overflow it: no drops)."""
    burst = max(256 << 10, int(rate_mbit * 1e6 / 8 * 0.002))
    return ["tbf", "rate", f"{rate_mbit:g}mbit", "burst", str(burst), "latency", "2s"]


def set_rate(rate_mbit: float, netns: Optional[str] = None) -> None:
    """Sets the rate of ``lo`` in ``netns`` (``None``: the namespace this
    process is in; it must be one of ours: never the host's loopback)."""
    prefix = ["ip", "netns", "exec", netns] if netns else []
    if netns is None and not _inside_ours():
        raise NetnsUnavailable("set_rate(netns=None) outside a namespace of ours: refusing to "
                               "limit the host's loopback")
    _run([*prefix, "tc", "qdisc", "replace", "dev", "lo", "root", *_tbf(rate_mbit)])


def _inside_ours() -> bool:
    """Whether this process runs in a namespace made by :class:`RateLimitedNetns`."""
    return os.environ.get("MOE_AUTOGRAD_NETNS", "").startswith(PREFIX)


def namespaces() -> List[str]:
    """The names of this machine's network namespaces (``ip netns list``)."""
    done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                          timeout=_TIMEOUT_S)
    return [line.split()[0] for line in done.stdout.splitlines() if line.strip()]


def _delete(name: str) -> None:
    if name.startswith(PREFIX):
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=_TIMEOUT_S)


def sweep_stale() -> List[str]:
    """Deletes our namespaces whose creating process is gone (a run killed
    outright); returns their names."""
    gone = []
    for name in namespaces():
        pid = name[len(PREFIX):].split("-")[0]
        if name.startswith(PREFIX) and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            _delete(name)
            gone.append(name)
    return gone


class RateLimitedNetns:
    """``with RateLimitedNetns(100) as ns: subprocess.run(ns.command([...]))``:
    the command runs in a namespace of its own whose loopback carries
    ``rate_mbit`` megabits per second (see the module's table)."""

    def __init__(self, rate_mbit: float) -> None:
        why = unavailable()
        if why is not None:
            raise NetnsUnavailable(why)
        self.rate_mbit = rate_mbit
        self.name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(3)}"

    def __enter__(self) -> "RateLimitedNetns":
        sweep_stale()
        _run(["ip", "netns", "add", self.name])
        atexit.register(self.close)
        try:
            _run(["ip", "-n", self.name, "link", "set", "lo", "up"])
            set_rate(self.rate_mbit, self.name)
        except BaseException:
            self.close()
            raise
        return self

    def command(self, argv: Sequence[str]) -> List[str]:
        """``argv`` run inside the namespace (``ip netns exec``); its
        environment names the namespace (``MOE_AUTOGRAD_NETNS``)."""
        return ["ip", "netns", "exec", self.name, "env", f"MOE_AUTOGRAD_NETNS={self.name}",
                *argv]

    def close(self) -> None:
        """Deletes the namespace (idempotent)."""
        _delete(self.name)
        atexit.unregister(self.close)  # (bound methods compare by instance)

    def __exit__(self, *exc: Any) -> None:
        self.close()

"""Where a torch RPC world listens (moe_autograd/remote/rpc_bind.py): on the
address it was given (loopback here), never on every interface, for the
store and for TensorPipe, in the founder and in every server."""
import multiprocessing
import os
import socket
from typing import List, Set, Tuple

import pytest

from moe_autograd.remote import rpc_bind

pytestmark = pytest.mark.timeout(60)


def _inodes(pid: int) -> Set[str]:
    found = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            found.add(link[8:-1])
    return found


def _address(hex_address: str) -> str:
    host, _, port = hex_address.partition(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        text = socket.inet_ntop(socket.AF_INET, raw[::-1])
    else:  # /proc keeps IPv6 as four little-endian 32-bit words
        text = socket.inet_ntop(socket.AF_INET6, b"".join(raw[k:k + 4][::-1]
                                                          for k in range(0, 16, 4)))
    return f"{text}:{int(port, 16)}"


def listening(pid: int) -> List[Tuple[str, bool]]:
    """The TCP sockets ``pid`` listens on: ``(address:port, loopback?)``."""
    inodes = _inodes(pid)
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                    address = _address(fields[1])
                    host = address.rpartition(":")[0]
                    loopback = host in ("127.0.0.1", "::1") or host.startswith("::ffff:127.")
                    out.append((address, loopback))
    return out


def test_the_world_listens_on_loopback_only(world) -> None:
    """The shared world: this process founded it (rank 0: the store and
    TensorPipe), its children serve (TensorPipe)."""
    pids = [os.getpid()] + [p.pid for p in multiprocessing.active_children()]
    seen = {pid: listening(pid) for pid in pids}
    assert seen[os.getpid()], "the founder listens (store, TensorPipe)"
    everywhere = {pid: [a for a, loopback in found if not loopback] for pid, found in seen.items()}
    assert all(not found for found in everywhere.values()), everywhere


def test_interfaces_and_addresses() -> None:
    assert rpc_bind.interface_for("127.0.0.1") == "lo"
    assert rpc_bind.interface_for("localhost") == "lo"
    assert rpc_bind.is_loopback("127.0.0.1") and not rpc_bind.is_loopback("192.0.2.55")
    assert rpc_bind.store_address("tcp://10.0.0.1:29500") == ("10.0.0.1", 29500)
    with pytest.raises(ValueError, match="tcp://host:port"):
        rpc_bind.store_address("env://")


def test_a_users_interface_choice_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(rpc_bind.IFNAME_ENV, "eth7")
    assert rpc_bind.bind_interface("127.0.0.1") == "eth7"
    assert os.environ[rpc_bind.IFNAME_ENV] == "eth7"
    monkeypatch.delenv(rpc_bind.IFNAME_ENV)
    assert rpc_bind.bind_interface("127.0.0.1") == "lo"
    assert os.environ[rpc_bind.IFNAME_ENV] == "lo"


def test_a_hosted_store_listens_on_its_host_only() -> None:
    from moe_autograd.remote.loopback import free_port

    port = free_port()
    store = rpc_bind.host_store("127.0.0.1", port, timeout=5.0)
    assert rpc_bind.host_store("127.0.0.1", port) is store  # one per port and process
    mine = [a for a, _ in listening(os.getpid()) if a.endswith(f":{port}")]
    assert mine == [f"127.0.0.1:{port}"], mine
    store.set("k", "v")
    assert store.get("k") == b"v"

"""Where a torch RPC world listens (moe_autograd/remote/rpc_bind.py): on the
address it was given (loopback here), never on every interface, for the
store and for TensorPipe, in the founder and in every server."""
import multiprocessing
import os
from typing import List, Tuple

import pytest

from moe_autograd.remote import rpc_bind

pytestmark = pytest.mark.timeout(60)


def listening(pid: int) -> List[Tuple[str, bool]]:
    """The TCP sockets ``pid`` listens on: ``(address:port, loopback?)``."""
    out = []
    for address in rpc_bind.listening(pid):
        host = address.rpartition(":")[0]
        out.append((address, host in ("127.0.0.1", "::1") or host.startswith("::ffff:127.")))
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


# -- a static world's members wait for each other, and say so (issue 43) ----------------

class _Clock:
    """A fake clock: each pause moves it on."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def pause(self, seconds: float) -> None:
        self.now += seconds


def test_a_rank_whose_peers_never_come_says_so_then_names_them(caplog) -> None:
    """The trainer of the two-machine recipe started with no server: a
    WARNING naming the missing rank after ARRIVAL_NOTICE_S, then a
    TimeoutError naming it at its timeout (was: silent until torch's
    30-minute process-group timeout)."""
    from moe_autograd.remote.loopback import free_port

    port = free_port()
    rpc_bind.host_store("127.0.0.1", port)
    clock = _Clock()
    with caplog.at_level("WARNING", logger="moe_autograd.remote.rpc_bind"), \
            pytest.raises(TimeoutError) as info:
        rpc_bind.await_members("trainer", 0, 3, "127.0.0.1", port, 60.0, clock=clock,
                               pause=clock.pause)
    assert str(info.value) == (
        f"start_rpc('trainer', rank 0): rank(s) [1, 2] of the world of 3 at "
        f"tcp://127.0.0.1:{port} did not come within 60 s: start them (python -m "
        f"moe_autograd serve ... --rank R --world-size 3, or start_rpc), with the same "
        f"address and port")
    assert 60.0 <= clock.now < 60.2
    notices = [r.getMessage() for r in caplog.records]
    assert len(notices) == 2 and all("waiting for rank(s) [1, 2] of the world of 3" in n
                                     for n in notices), notices  # at 5 s and at 35 s


def test_ranks_that_all_come_go_on() -> None:
    import threading

    from moe_autograd.remote.loopback import free_port

    port = free_port()
    rpc_bind.host_store("127.0.0.1", port)
    errors: List[BaseException] = []

    def member(rank: int) -> None:
        try:
            rpc_bind.await_members(f"m{rank}", rank, 3, "127.0.0.1", port, 30.0)
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)
    threads = [threading.Thread(target=member, args=(r,)) for r in (2, 1, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == [] and not any(t.is_alive() for t in threads)


def test_a_rank_that_finds_no_store_names_it() -> None:
    from moe_autograd.remote.loopback import free_port

    port = free_port()
    with pytest.raises(TimeoutError, match=rf"^start_rpc\('server', rank 1\): cannot reach the "
                       rf"world's store at tcp://127.0.0.1:{port} within 1 s: is rank 0 "
                       rf"started"):
        rpc_bind.await_members("server", 1, 2, "127.0.0.1", port, 1.0)

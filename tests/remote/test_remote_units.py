"""Pieces of the remote package that need no RPC world: the state store, the
CLI's argument handling, and the transport seam (an in-process transport)."""
import time
from typing import Any, Callable, Optional, Tuple

import pytest
import torch
from torch import nn

from moe_autograd.remote import ExpertServer, RemoteExpert, RemoteExpertError, RemoteTimeoutError
from moe_autograd.remote.cli import build_parser, load_object, main
from moe_autograd.remote.state import CallState, StateStore
from moe_autograd.remote.transport import TransportTimeout

pytestmark = pytest.mark.timeout(30)


def _state() -> CallState:
    return CallState("e", [], [])


def test_state_store_cap_ttl_and_reasons() -> None:
    store = StateStore(ttl=0.2, max_states=2)
    for k in range(3):
        assert store.put(f"c{k}", _state())
    assert len(store) == 2
    with pytest.raises(LookupError, match="evicted"):
        store.pop("c0")
    store.pop("c1")
    with pytest.raises(LookupError, match="used by an earlier backward"):
        store.pop("c1")
    assert store.release(["c9"]) == 0 and not store.put("c9", _state())  # release overtook forward
    time.sleep(0.25)
    assert store.sweep() == 1 and len(store) == 0
    with pytest.raises(LookupError, match="expired"):
        store.pop("c2")
    with pytest.raises(LookupError, match="unknown call id"):
        store.pop("never")
    assert store.stats()["live"] == 0


class _Ready:
    def __init__(self, value: Any) -> None:
        self.value = value

    def done(self) -> bool:
        return True

    def result(self, timeout: Optional[float]) -> Any:
        if isinstance(self.value, BaseException):
            raise self.value
        return self.value


class InProcess:
    """A transport that runs the server function at once, in this process."""

    name = "in-process"

    def __init__(self, hook: Optional[Callable[[Any], Any]] = None) -> None:
        self.hook = hook

    def call(self, worker: str, fn: Callable[..., Any], args: Tuple[Any, ...],
             timeout: Optional[float]) -> _Ready:
        if self.hook is not None:
            return _Ready(self.hook(fn))
        return _Ready(fn(*args))

    def local_name(self) -> str:
        return "here"


@pytest.mark.parametrize("backward", ["stateless", "stateful"])
def test_in_process_transport_seam(backward: str) -> None:
    transport = InProcess()
    module = nn.Linear(3, 3)
    with ExpertServer({f"unit_{backward}": module}, backward=backward, transport=transport) as server:
        assert server.worker == "here"
        expert = RemoteExpert("here", f"unit_{backward}", transport=transport)
        x = torch.randn(2, 3, requires_grad=True)
        expert(x).sum().backward()
        lx = x.detach().clone().requires_grad_()
        module.zero_grad()
        module(lx).sum().backward()
        torch.testing.assert_close(x.grad, lx.grad)
        assert server.stats()["live"] == 0
    with pytest.raises(RemoteExpertError, match="unknown expert"):
        expert(x)  # closed: the expert is gone


def test_transport_timeout_becomes_remote_timeout_error() -> None:
    expert = RemoteExpert("w", "e", forward_timeout=0.1,
                          transport=InProcess(lambda fn: TransportTimeout("too slow")))
    with pytest.raises(RemoteTimeoutError, match="'e' on worker 'w' missed its 0.1 s deadline"):
        expert(torch.randn(1))


def test_duplicate_expert_names_are_refused() -> None:
    transport = InProcess()
    with ExpertServer({"unit_dup": nn.Linear(1, 1)}, transport=transport):
        with pytest.raises(ValueError, match="already served"):
            ExpertServer({"unit_dup": nn.Linear(1, 1)}, transport=transport)
    with pytest.raises(ValueError, match="backward must be"):
        ExpertServer({}, backward="sometimes")


def test_cli_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MASTER_PORT", "1234")
    monkeypatch.setenv("RANK", "3")
    args = build_parser().parse_args(["--experts", "m:f"])
    assert (args.master_port, args.rank, args.world_size) == (1234, 3, None)
    assert load_object("moe_autograd.remote.cli:main") is main
    with pytest.raises(ValueError, match="package.module:function"):
        load_object("no_colon")
    with pytest.raises(SystemExit) as info:
        main(["serve"])  # --experts is required
    assert info.value.code == 2

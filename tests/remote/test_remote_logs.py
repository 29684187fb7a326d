"""What the remote side tells a person: a server's served calls (counted, and
reported by ``serve`` periodically), a fleet's events (INFO, WARNING for a
server lost or refused) and a fleet expert's retries and switches of replica
(INFO). No RPC world: an in-process transport and a fake fleet."""
import logging
import time
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch
from torch import Tensor, nn

from moe_autograd.remote import ExpertServer, FleetEvent, RemoteExpert, RemoteExpertError
from moe_autograd.remote.cli import _report_served
from moe_autograd.remote.replicas import FleetExpert, _limit, log_event
from wiring import InProcess

pytestmark = pytest.mark.timeout(30)


class Raises(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        raise ValueError("nope")


def test_a_server_counts_what_it_served() -> None:
    transport = InProcess("here")
    with ExpertServer({"logs_ok": nn.Linear(3, 3), "logs_bad": Raises()},
                      transport=transport) as server:
        good = RemoteExpert("here", "logs_ok", transport=transport)
        x = torch.randn(2, 3, requires_grad=True)
        good(x).sum().backward()
        good(x).sum().backward()
        with pytest.raises(RemoteExpertError, match="nope"):
            RemoteExpert("here", "logs_bad", transport=transport)(x)
        assert server.served() == {"forward": 2, "backward": 2, "failed": 1}
        assert server.stats()["served"] == server.served()


def test_serve_reports_served_calls_periodically(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="moe_autograd.remote.cli")
    counts = {"forward": 0, "backward": 0, "failed": 0}
    reads: List[int] = []

    def read() -> Dict[str, int]:
        reads.append(1)
        counts["forward"] += 3
        counts["backward"] += 2
        return dict(counts)

    halt = _report_served(read, 0.01)
    deadline = time.monotonic() + 20
    while len(reads) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    halt()
    lines = [r.getMessage() for r in caplog.records if r.name == "moe_autograd.remote.cli"]
    assert lines and lines[0] == ("served 3 forward and 2 backward calls in the last 0.01 s "
                                  "(0 failed); 3, 2 and 0 in all"), lines


def test_a_silent_server_reports_nothing(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="moe_autograd.remote.cli")
    reads: List[int] = []

    def read() -> Dict[str, int]:
        reads.append(1)
        return {}

    halt = _report_served(read, 0.01)
    deadline = time.monotonic() + 20
    while len(reads) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    halt()
    assert not [r for r in caplog.records if r.name == "moe_autograd.remote.cli"]


def test_fleet_events_are_logged_at_their_level(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="moe_autograd.test")
    log = logging.getLogger("moe_autograd.test")
    log_event(log, "fleet 'trainer'", FleetEvent("joined", "server_b", ("ffn0", "ffn1"), 0.0,
                                                 "rank 2"))
    log_event(log, "fleet 'trainer'", FleetEvent("lost", "server_b", ("ffn0",), 0.0,
                                                 "no heartbeat for 1 s"))
    log_event(log, "fleet 'trainer'", FleetEvent("reaped", "server_b", (), 0.0, ""))
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.INFO, "fleet 'trainer': server 'server_b' joined (ffn0, ffn1): rank 2"),
        (logging.WARNING, "fleet 'trainer': server 'server_b' lost (ffn0): no heartbeat for 1 s"),
        (logging.INFO, "fleet 'trainer': server 'server_b' reaped")]


class _Fleet:
    """What FleetExpert needs of a fleet: replicas a, then b."""

    transport: Any = None
    secret: Any = None

    def __init__(self) -> None:
        self.live = ["a", "b"]

    def replicas(self, expert: str) -> List[str]:
        return list(self.live)

    def refresh_on_miss(self) -> None:
        pass

    def servers(self) -> Dict[str, Tuple[str, ...]]:
        return {w: ("e",) for w in self.live}

    def suspect(self, worker: str, why: str = "") -> None:
        pass

    def _served(self, worker: str) -> None:
        pass


@pytest.mark.parametrize("balance", ["order", "latency"])
def test_a_fleet_expert_logs_its_retries_and_switches(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, balance: str) -> None:
    """A retry, and a switch away from a replica that failed, are logged;
    with ``balance="latency"``, spreading calls over healthy replicas is not."""
    caplog.set_level(logging.INFO, logger="moe_autograd.remote.replicas")
    monkeypatch.setattr(_limit, "every", 0.0)
    fleet = _Fleet()
    expert = FleetExpert(fleet, "logs_e", balance=balance)  # type: ignore[arg-type]
    down: List[str] = []

    def attempt(worker: str, limit: Optional[float], args: Any) -> Any:
        ok = worker not in down  # what _attempt tells the balancer: a is the faster
        expert.balancer.end("logs_e", worker, "forward", 0.001 if worker == "a" else 0.002, ok)
        if not ok:
            return None, (worker, f"{worker} is down", False, True)
        return torch.zeros(1), None

    monkeypatch.setattr(expert, "_attempt", attempt)
    expert(torch.zeros(1))  # a: the oldest, or the first unmeasured one
    assert expert.last_worker == "a" and not caplog.records
    if balance == "latency":
        expert(torch.zeros(1))  # b is explored (unmeasured): no switch logged
        assert expert.last_worker == "b" and not caplog.records
        expert(torch.zeros(1))  # back to the faster a: not logged either
        assert expert.last_worker == "a" and not caplog.records
    down.append("a")
    expert(torch.zeros(1))  # a fails: retried on b, which now serves the name
    assert expert.last_worker == "b" and expert.retries == 1
    assert [r.getMessage() for r in caplog.records] == [
        "fleet expert 'logs_e': retrying on 'b': the attempt on 'a' failed: a is down",
        "fleet expert 'logs_e': now served by 'b' (was 'a')"]
    assert all(r.levelno == logging.INFO for r in caplog.records)

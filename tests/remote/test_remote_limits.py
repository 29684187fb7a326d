"""Server byte limits bound whole requests and see every tensor (issue 18,
items 3 and 4).

* ``max_request_bytes`` bounds a coalesced request, not each call in it: the
  calls to one server are admitted in order while their tensors fit together,
  the others are refused before they run.
* Every tensor reachable in a call's arguments is counted, however nested
  (pytrees, ``SimpleNamespace``, dataclasses, ``__slots__``, deques, lists in
  dicts), against ``max_request_bytes`` and, for a stateful call, against
  ``max_state_bytes``.

The servers live in this process and the ``serve_*`` functions are called
directly (what the transport would run on a server's thread): no RPC world.
"""
import threading
from collections import deque
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Iterator, List, Tuple

import pytest
import torch
from torch import Tensor, nn

from moe_autograd.remote import ExpertServer
from moe_autograd.remote.batch_server import serve_batch, serve_collect
from moe_autograd.remote.server import serve_forward
from moe_autograd.remote import sizes
from moe_autograd.remote.sizes import Tally, materialised_bytes

pytestmark = pytest.mark.timeout(60)
WIDTH = 8
MiB = 1 << 20


class CountingLinear(nn.Module):
    """A linear map that counts its calls and takes an optional extra argument."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.calls = 0
        self._lock = threading.Lock()

    def forward(self, x: Tensor, extra: Any = None) -> Tensor:
        with self._lock:
            self.calls += 1
        return self.lin(x[:4])


def stride0(nbytes: int) -> Tensor:
    """A float32 tensor of ``nbytes`` once materialised, 32 bytes on the wire."""
    return torch.zeros(1, WIDTH).expand(nbytes // (4 * WIDTH), WIDTH)


@pytest.fixture
def limited() -> Iterator[Tuple[CountingLinear, CountingLinear]]:
    a, b = CountingLinear(), CountingLinear()
    servers = [ExpertServer({"lim_a": a}, max_request_bytes=1 * MiB),
               ExpertServer({"lim_b": b}, max_request_bytes=None)]
    try:
        yield a, b
    finally:
        for server in servers:
            server.close()


def _job(name: str, k: int, x: Tensor, owner: str = "me") -> Tuple[str, Any, None]:
    return ("forward", (name, owner, f"call-{name}-{k}", 0, True, [False], (x,)), None)


def _batch(batch_id: str, jobs: List[Any]) -> List[Any]:
    """Every answer of a coalesced request (collecting the rest as a client would)."""
    status, (answers, more) = serve_batch("me", batch_id, jobs)
    assert status == "ok", answers
    while more:
        status, (rest, more) = serve_collect("me", batch_id)
        assert status == "ok", rest
        answers = [a if a is not None else r for a, r in zip(answers, rest)]
    return answers


def test_request_limit_bounds_the_whole_coalesced_request(limited: Any) -> None:
    a, b = limited
    # Four calls of 0.75 MiB each (each under the 1 MiB limit; 3 MiB together).
    jobs = [_job("lim_a", k, stride0(3 * MiB // 4)) for k in range(4)]
    answers = _batch("batch-limit-1", jobs)
    assert answers[0][0] == "ok", answers[0]
    for answer in answers[1:]:
        assert answer[0] == "error", answer
        assert "max_request_bytes=1048576" in answer[1] and "whole request" in answer[1], answer
        assert "'lim_a'" in answer[1]
    assert a.calls == 1  # the refused calls never ran

    # Calls to another server of the same request have their own budget; a
    # shared tensor counts once; a later, smaller call that fits is admitted.
    a.calls = 0
    shared = stride0(MiB // 2)
    jobs = [_job("lim_a", 10, shared), _job("lim_a", 11, shared), _job("lim_a", 12, stride0(MiB)),
            _job("lim_b", 13, stride0(8 * MiB)), _job("lim_a", 14, torch.randn(4, WIDTH))]
    answers = _batch("batch-limit-2", jobs)
    assert [answer[0] for answer in answers] == ["ok", "ok", "error", "ok", "ok"], answers
    assert a.calls == 3 and b.calls == 1


@dataclass
class Holder:
    payload: Any


class Slotted:
    __slots__ = ("inner",)

    def __init__(self, inner: Any) -> None:
        self.inner = inner


def _nestings(t: Tensor) -> List[Any]:
    return [
        [[[[[t]]]]],                                   # five levels of lists
        {"a": {"b": {"c": {"d": {"e": (t,)}}}}},       # dicts in dicts, a tuple at the end
        SimpleNamespace(x=SimpleNamespace(y=[t])),     # namespaces
        Holder(payload={"k": [Holder(payload=t)]}),    # dataclasses, lists in dicts
        Slotted(Slotted(deque([t]))),                  # __slots__ and a deque
        {("key", 1): [{"deep": [[{"t": t}]]}]},        # lists in dicts in lists
    ]


NESTINGS = ["lists", "dicts", "namespace", "dataclass", "slots-deque", "mixed"]


@pytest.mark.parametrize("k", range(len(NESTINGS)), ids=NESTINGS)
def test_nested_tensors_count_against_the_request_limit(limited: Any, k: int) -> None:
    a, _ = limited
    extra = _nestings(stride0(4 * MiB))[k]
    status, text = serve_forward("lim_a", "me", f"nested-{k}", 0, True, [False, False],
                                 (torch.randn(4, WIDTH), extra))
    assert status == "error" and "max_request_bytes=1048576" in text, text
    assert str(4 * MiB + 4 * WIDTH * 4) in text, text  # counted in full, with x
    assert a.calls == 0


@pytest.mark.parametrize("k", range(len(NESTINGS)), ids=NESTINGS)
def test_nested_tensors_count_against_the_state_limit(k: int) -> None:
    module = CountingLinear()
    server = ExpertServer({f"lim_state_{k}": module}, backward="stateful",
                          max_request_bytes=None, max_state_bytes=2 * MiB)
    try:
        big = torch.zeros(4 * MiB // 4)  # a real 4 MiB tensor, held by the state
        x = torch.randn(4, WIDTH, requires_grad=True)
        status, text = serve_forward(f"lim_state_{k}", "me", f"state-{k}", 0, True, [True, False],
                                     (x, _nestings(big)[k]))
        assert status == "error" and "max_state_bytes=2097152" in text, text
        assert server.stats()["live"] == 0 and server.stats()["bytes"] == 0
        small = _nestings(torch.zeros(16))[k]
        status, value = serve_forward(f"lim_state_{k}", "me", f"state-ok-{k}", 0, True,
                                      [True, False], (x, small))
        assert status == "ok", value
        stats = server.stats()
        assert stats["live"] == 1
        assert stats["bytes"] == 4 * WIDTH * 4 + 16 * 4 + 4 * WIDTH * 4  # x, nested, output
    finally:
        server.close()


def test_tally_counts_each_tensor_once_and_bounds_its_walk(monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    t = torch.zeros(10)
    assert materialised_bytes([t, {"again": t}, (t, t.view(2, 5))]) == 80
    loop: List[Any] = [t]
    loop.append(loop)  # a cycle ends the walk, it does not hang it
    assert materialised_bytes(loop) == 40
    tally = Tally()
    assert tally.add([t]) == 40 and tally.add({"t": t}) == 0 and tally.total == 40
    assert tally.add(torch.zeros(100), limit=100) is None and tally.total == 40  # refused: as was
    assert tally.add(torch.zeros(10), limit=100) == 40 and tally.total == 80
    monkeypatch.setattr(sizes, "MAX_OBJECTS", 1000)  # (1 << 20 by default)
    wide = [[] for _ in range(1001)]
    with pytest.raises(ValueError, match="more than 1000 objects"):
        materialised_bytes(wide)
    assert materialised_bytes([[] for _ in range(999)]) == 0

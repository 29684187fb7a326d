"""How a frame travels over Ray (:mod:`moe_autograd.remote.ray_engine`), without
a Ray instance: an actor's ``handle(head, blob)`` gets the frame's head and its
buffers back to back (``bytes`` up to ``INLINE_MAX_BYTES``, else one NumPy
array) and answers the same way; what arrives equals what was sent, a blob
that disagrees with its header is refused as malformed before anything runs,
and a call (``_RayPending``) settles exactly once."""
import threading
import time
from concurrent.futures import Future
from typing import Any, Dict, Iterator, List, Tuple

import pytest
import torch
from torch import nn

from moe_autograd.remote import ExpertServer, register_operation, security_stats, \
    unregister_operation
from moe_autograd.remote import wire
from moe_autograd.remote.auth import Refused, session_for
from moe_autograd.remote.frame import REFUSAL, Frame, buffer_view, parse
from moe_autograd.remote.transport import TransportError, TransportTimeout
from wiring import SECRET

pytest.importorskip("numpy")
from moe_autograd.remote.ray_engine import (INLINE_MAX_BYTES, RayTransport,  # noqa: E402
                                            _blob, _RayPending, _split, serve_frame)

pytestmark = pytest.mark.timeout(30)
ME = "ray-engine-unit"
_ran: List[int] = []


def _echo(*args: Any) -> List[Any]:
    _ran.append(len(args))
    return list(args)


@pytest.fixture(scope="module")
def served() -> Iterator[None]:
    """This process serves the test job (its gate admits SECRET) and an
    ``echo`` operation."""
    server = ExpertServer({"ray_engine_unit_lin": nn.Linear(2, 2)}, secret=SECRET)
    register_operation("ray_engine_echo", _echo)
    try:
        yield
    finally:
        unregister_operation("ray_engine_echo")
        server.close()


def _request(args: List[Any]) -> Tuple[Frame, int]:
    body, buffers = wire.encode({"op": "call", "name": "ray_engine_echo", "args": args})
    return session_for(SECRET).seal(ME, body, buffers, "call")


def _open(frame: Frame, seq: int) -> Any:
    body, buffers = session_for(SECRET).open_reply(ME, seq, frame)
    return wire.decode(body, buffers)["reply"]


SIZES = {"none": [], "small": [3, 0, 1000], "large": [200_000, 100_000]}  # float32 elements


@pytest.mark.parametrize("sizes", list(SIZES.values()), ids=list(SIZES))
def test_blob_and_split_round_trip(sizes: List[int]) -> None:
    torch.manual_seed(0)
    tensors = [torch.randn(n) for n in sizes]
    frame, _ = _request(tensors)
    assert len(frame.buffers) == len(tensors)
    blob = _blob(frame.buffers)
    total = sum(4 * n for n in sizes)
    if total <= INLINE_MAX_BYTES:
        assert type(blob) is bytes and len(blob) == total
    else:  # one array, which Ray moves out of band
        import numpy as np

        assert isinstance(blob, np.ndarray) and blob.dtype == np.uint8 and blob.nbytes == total
    parts = _split(frame.head, blob)
    assert [bytes(p) for p in parts] == [bytes(buffer_view(b)) for b in frame.buffers]


@pytest.mark.parametrize("sizes", list(SIZES.values()), ids=list(SIZES))
def test_serve_frame_round_trip(served: None, sizes: List[int]) -> None:
    torch.manual_seed(1)
    tensors = [torch.randn(n) for n in sizes]
    frame, seq = _request([*tensors, "text", 7])
    head, blob = serve_frame(frame.head, _blob(frame.buffers), ME)
    assert type(head) is bytes
    big = sum(4 * n for n in sizes) > INLINE_MAX_BYTES
    assert (type(blob) is not bytes) == big, type(blob)  # the reply's tensors: the same way
    status, value = _open(Frame(head, _split(head, blob)), seq)
    assert status == "ok" and value[-2:] == ["text", 7], (status, value)
    for got, sent in zip(value, tensors):
        assert got.dtype == sent.dtype and torch.equal(got, sent)


def test_a_blob_that_disagrees_with_its_header_is_refused(served: None) -> None:
    frame, seq = _request([torch.randn(10), torch.randn(5)])
    good = _blob(frame.buffers)
    ran = len(_ran)
    for bad in (good[:-1], good + b"\0", b"", None, "not bytes"):
        assert _split(frame.head, bad) == []
        before = security_stats()["refused"].get("malformed", 0)
        head, blob = serve_frame(frame.head, bad, ME)
        reply = Frame(head, _split(head, blob))
        assert parse(reply).kind == REFUSAL
        with pytest.raises(Refused, match="malformed"):
            _open(reply, seq)
        assert security_stats()["refused"].get("malformed", 0) == before + 1
    for head in (b"", b"garbage", None, frame.head[:20]):  # not a frame's head at all
        refused_head, _ = serve_frame(head, good, ME)
        assert parse(Frame(refused_head, [])).kind == REFUSAL
    assert len(_ran) == ran  # nothing ran
    # the very same frame, whole: served (it was never accepted, so it is no replay)
    head, blob = serve_frame(frame.head, good, ME)
    status, value = _open(Frame(head, _split(head, blob)), seq)
    assert status == "ok" and len(value) == 2 and len(_ran) == ran + 1


# -- _RayPending: one call, settled once ------------------------------------------------------
class _Ref:
    """An ObjectRef whose future the test completes."""

    def __init__(self) -> None:
        self.fut: Future = Future()

    def future(self) -> Future:
        return self.fut


def _pending() -> Tuple[_RayPending, _Ref, Dict[str, int]]:
    ref = _Ref()
    pending = _RayPending(RayTransport(), "srv", ref)
    calls = {"n": 0}

    def count() -> None:
        calls["n"] += 1
    pending.add_done_callback(count)
    pending._watch_reply()
    return pending, ref, calls


def _reply_frame() -> Tuple[bytes, Any]:
    frame, _ = _request([torch.randn(4)])
    return frame.head, _blob(frame.buffers)


def test_a_reply_settles_once_and_a_late_timeout_is_ignored() -> None:
    pending, ref, calls = _pending()
    assert not pending.done()
    head, blob = _reply_frame()
    ref.fut.set_result((head, blob))
    assert pending.done() and calls["n"] == 1
    pending.expire(1.0)  # the watcher, late: ignored
    frame = pending.result(0)
    assert frame.head == head and [bytes(b) for b in frame.buffers] == [bytes(blob)]
    assert pending.result(1.0) is frame and calls["n"] == 1
    late: List[int] = []
    pending.add_done_callback(lambda: late.append(1))  # done already: called at once
    assert late == [1] and calls["n"] == 1


def test_a_timeout_settles_once_and_a_late_reply_is_dropped() -> None:
    pending, ref, calls = _pending()
    started = time.monotonic()
    with pytest.raises(TransportTimeout, match="no reply from Ray actor 'srv' within 0.15"):
        pending.result(0.15)  # the waiter's own limit: not settled by it
    assert 0.1 < time.monotonic() - started < 1.0 and not pending.done()
    pending.expire(2.0)  # the watcher
    assert pending.done() and calls["n"] == 1
    ref.fut.set_result(_reply_frame())  # late: dropped
    with pytest.raises(TransportTimeout, match="within 2 s"):
        pending.result(1.0)
    assert calls["n"] == 1


@pytest.mark.parametrize("outcome, error, match", [
    (("not", "a frame", "at all"), TransportError, "not a frame"),
    (RuntimeError("the cluster hiccuped"), TransportError, "RuntimeError: the cluster hiccuped"),
])
def test_failures_settle_once(outcome: Any, error: type, match: str) -> None:
    if isinstance(outcome, BaseException):
        pytest.importorskip("ray")  # a failure is classified by Ray's exception types
    pending, ref, calls = _pending()
    if isinstance(outcome, BaseException):
        ref.fut.set_exception(outcome)
    else:
        ref.fut.set_result(outcome)
    with pytest.raises(error, match=match):
        pending.result(1.0)
    pending.expire(1.0)
    with pytest.raises(error, match=match):  # still the first outcome
        pending.result(1.0)
    assert calls["n"] == 1


def test_a_dead_actor_fails_the_call_and_its_handle_is_looked_up_again() -> None:
    pytest.importorskip("ray")
    from ray.exceptions import RayActorError

    transport = RayTransport()
    transport.use_handle("srv", object())
    ref = _Ref()
    pending = _RayPending(transport, "srv", ref)
    pending._watch_reply()
    ref.fut.set_exception(RayActorError())
    with pytest.raises(TransportError, match="Ray actor 'srv' is dead or unreachable"):
        pending.result(1.0)
    assert "srv" not in transport._handles


def test_concurrent_outcomes_settle_once() -> None:
    """The reply and the watcher race: exactly one wins, callbacks run once."""
    for _ in range(50):
        pending, ref, calls = _pending()
        go = threading.Barrier(2)
        reply = _reply_frame()

        def answer() -> None:
            go.wait()
            ref.fut.set_result(reply)

        def expire() -> None:
            go.wait()
            pending.expire(1.0)
        threads = [threading.Thread(target=answer), threading.Thread(target=expire)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert calls["n"] == 1
        try:
            first = pending.result(0)
        except TransportTimeout:
            first = None
        again = None
        try:
            again = pending.result(0)
        except TransportTimeout:
            pass
        assert first is again

"""The server's call-state store (:mod:`moe_autograd.remote.state`): the
eviction policy at a tie, and expiry swept by a ``put`` (no timer).

Time is a fake clock (``state.time.monotonic`` patched), so nothing here
sleeps or depends on timing (issue 34: survivors of a mutation run)."""
from typing import List, Tuple

import pytest

from moe_autograd.remote import state as state_module
from moe_autograd.remote.state import CallState, StateError, StateStore

pytestmark = pytest.mark.timeout(30)


def _state(owner: str, nbytes: int = 0, expert: str = "e") -> CallState:
    return CallState(expert, owner, [], [], nbytes)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(state_module.time, "monotonic", c)
    return c


def _ids(store: StateStore, owner: str) -> List[str]:
    return list(store._owned.get(owner, ()))


# -- eviction at a tie ---------------------------------------------------------------
@pytest.mark.parametrize("newcomer, other", [("a", "b"), ("b", "a")])
def test_a_tie_in_states_evicts_the_newcomers_own_oldest_state(newcomer: str, other: str) -> None:
    store = StateStore(ttl=30.0, max_states=4)
    for k in range(2):
        store.put(f"a{k}", _state("a"))
        store.put(f"b{k}", _state("b"))
    store.put(f"{newcomer}2", _state(newcomer))  # full, 2 each: the newcomer pays
    assert _ids(store, other) == [f"{other}0", f"{other}1"]
    assert _ids(store, newcomer) == [f"{newcomer}1", f"{newcomer}2"]
    with pytest.raises(StateError, match="evicted: the server holds at most max_states=4"):
        store.take(newcomer, f"{newcomer}0", "e")
    assert store.stats()["evicted"] == 1 and len(store) == 4


@pytest.mark.parametrize("newcomer, other", [("a", "b"), ("b", "a")])
def test_a_tie_in_bytes_evicts_the_newcomers_own_oldest_state(newcomer: str, other: str) -> None:
    store = StateStore(ttl=30.0, max_states=100, max_bytes=400)
    for k in range(2):
        store.put(f"a{k}", _state("a", 100))
        store.put(f"b{k}", _state("b", 100))
    store.put(f"{newcomer}2", _state(newcomer, 100))
    assert _ids(store, other) == [f"{other}0", f"{other}1"]
    assert _ids(store, newcomer) == [f"{newcomer}1", f"{newcomer}2"]
    assert store.nbytes == 400 and store._owner_bytes == {"a": 200, "b": 200}
    with pytest.raises(StateError, match=r"evicted: the server's states hold at most "
                                         r"max_state_bytes=400 bytes \(the client holding the "
                                         r"most gives way\)$"):
        store.take(newcomer, f"{newcomer}0", "e")


def test_a_client_holding_more_gives_way_to_one_holding_less() -> None:
    store = StateStore(ttl=30.0, max_states=3)
    store.put("a0", _state("a"))
    store.put("b0", _state("b"))
    store.put("b1", _state("b"))
    store.put("a1", _state("a"))  # a holds 1 < b's 2: b's oldest goes
    assert _ids(store, "a") == ["a0", "a1"] and _ids(store, "b") == ["b1"]
    store.put("c0", _state("c"))  # a new client: the one holding the most (a) gives way
    assert _ids(store, "a") == ["a1"] and _ids(store, "b") == ["b1"] and _ids(store, "c") == ["c0"]


def test_the_per_client_quota_evicts_only_that_clients_oldest() -> None:
    store = StateStore(ttl=30.0, max_states=10, max_states_per_client=2)
    store.put("b0", _state("b"))
    for k in range(3):
        store.put(f"a{k}", _state("a"))
    assert _ids(store, "a") == ["a1", "a2"] and _ids(store, "b") == ["b0"]
    with pytest.raises(StateError, match="max_states_per_client=2"):
        store.take("a", "a0", "e")
    assert store.stats() == dict(store.counts, live=3, bytes=0, clients=2)


def test_freed_states_give_their_bytes_back() -> None:
    store = StateStore(ttl=30.0, max_states=10, max_bytes=1000)
    store.put("a0", _state("a", 300))
    store.put("a1", _state("a", 200))
    store.put("b0", _state("b", 100))
    assert store.nbytes == 600 and store._owner_bytes == {"a": 500, "b": 100}
    store.take("a", "a0", "e")
    assert store.nbytes == 300 and store._owner_bytes == {"a": 200, "b": 100}
    assert store.release("a", ["a1"]) == 1
    assert store.nbytes == 100 and store._owner_bytes == {"b": 100}
    assert store.stats()["clients"] == 1
    store.put("a2", _state("a", 900))  # fits exactly: 100 + 900 == max_bytes
    assert store.nbytes == 1000 and len(store) == 2 and store.counts["evicted"] == 0
    store.put("a3", _state("a", 1))  # one byte over: a (900) holds the most
    assert _ids(store, "a") == ["a3"] and _ids(store, "b") == ["b0"]


# -- expiry swept by put (not by the timer) -----------------------------------------------
def test_expired_states_are_swept_by_a_put(clock: Clock) -> None:
    store = StateStore(ttl=10.0, max_states=100)
    store.put("c0", _state("a"))
    clock.now += 5
    store.put("c1", _state("a"))
    clock.now += 5  # c0 is exactly state_ttl old: no backward within it
    store.put("c2", _state("b"))
    assert list(store._states) == ["c1", "c2"] and store.counts["expired"] == 1
    with pytest.raises(StateError, match=r"expired after state_ttl=10 s without a backward"):
        store.take("a", "c0", "e")
    clock.now += 4.5  # c1 not yet expired
    store.put("c3", _state("a"))
    assert list(store._states) == ["c1", "c2", "c3"]
    assert store.take("a", "c1", "e").owner == "a"
    clock.now += 100
    store.put("c4", _state("a"))  # sweeps every expired state, across clients
    assert list(store._states) == ["c4"] and store.counts["expired"] == 3
    assert store.stats()["clients"] == 1 and store.nbytes == 0


def test_an_expired_state_frees_the_quota_before_evicting(clock: Clock) -> None:
    store = StateStore(ttl=10.0, max_states=2)
    store.put("b0", _state("b"))
    store.put("a0", _state("a"))
    clock.now += 10
    store.put("a1", _state("a"))  # the expired ones go; nothing is evicted
    assert store.counts == dict(store.counts, expired=2, evicted=0)
    with pytest.raises(StateError, match="expired"):
        store.take("b", "b0", "e")


def test_sweep_frees_expired_states_and_counts_them(clock: Clock) -> None:
    store = StateStore(ttl=4.0, max_states=10)
    store.put("c0", _state("a", 7))
    clock.now += 3.5
    assert store.sweep() == 0 and len(store) == 1
    clock.now += 0.5
    assert store.sweep() == 1 and len(store) == 0 and store.nbytes == 0
    assert store.stats()["expired"] == 1


# -- limits, messages and counters ---------------------------------------------------------
@pytest.mark.parametrize("options, message", [
    (dict(ttl=0.0, max_states=1), "state_ttl must be a positive number of seconds, got 0.0"),
    (dict(ttl=-1.0, max_states=1), "state_ttl must be a positive number of seconds, got -1.0"),
    (dict(ttl=float("nan"), max_states=1), "state_ttl must be a positive number"),
    (dict(ttl="10", max_states=1), "state_ttl must be a positive number of seconds, got '10'"),
    (dict(ttl=1.0, max_states=0), "max_states must be at least 1, got 0"),
    (dict(ttl=1.0, max_states=4, max_states_per_client=0),
     "max_states_per_client must be at least 1, got 0"),
    (dict(ttl=1.0, max_states=4, max_bytes=0), "max_state_bytes must be positive or None, got 0"),
])
def test_the_store_refuses_limits_that_cannot_hold_a_state(options, message: str) -> None:
    with pytest.raises(ValueError) as info:
        StateStore(**options)
    assert message in str(info.value)


def test_the_smallest_limits_hold_one_state() -> None:
    store = StateStore(ttl=1e-9, max_states=1, max_states_per_client=1, max_bytes=1)
    assert store.stats() == {"stored": 0, "used": 0, "released": 0, "expired": 0,
                             "evicted": 0, "refused": 0, "live": 0, "bytes": 0, "clients": 0}
    store = StateStore(ttl=float("inf"), max_states=1, max_states_per_client=1, max_bytes=1)
    store.put("c0", _state("a", 1))  # exactly max_bytes: fits
    assert store.nbytes == 1 and store._states["c0"].expires == float("inf")
    store.put("c1", _state("a", 1))
    assert list(store._states) == ["c1"] and store.counts["evicted"] == 1


def test_counters_count_every_event() -> None:
    store = StateStore(ttl=30.0, max_states=2)
    for k in range(4):
        store.put(f"c{k}", _state("a"))
    assert store.counts["stored"] == 4 and store.counts["evicted"] == 2
    store.take("a", "c2", "e")
    store.take("a", "c3", "e")
    assert store.counts["used"] == 2
    store.put("c4", _state("a"))
    store.put("c5", _state("a"))
    assert store.release("a", ["c4", "c5", "unknown"]) == 2
    store.put("c6", _state("a"))
    assert store.release("a", ["c6"]) == 1
    assert store.counts["released"] == 3
    store.put("c7", _state("a"))
    for _ in range(2):
        with pytest.raises(StateError):
            store.take("b", "c7", "e")
    with pytest.raises(StateError):
        store.take("a", "c7", "f")
    assert store.counts["refused"] == 3
    assert store.stats() == {"stored": 8, "used": 2, "released": 3, "expired": 0,
                             "evicted": 2, "refused": 3, "live": 1, "bytes": 0, "clients": 1}


def test_errors_say_why_an_id_cannot_be_used() -> None:
    store = StateStore(ttl=30.0, max_states=2)
    store.put("x", _state("a"))
    with pytest.raises(StateError, match=r"^forward of expert 'e': call id 'x' is already held "
                                         r"by a pending call: call ids must be unique \(a forward "
                                         r"never reuses one\)$"):
        store.put("x", _state("a"))
    with pytest.raises(StateError, match=r"^backward of expert 'e': call 'x' belongs to another "
                                         r"session, not this client's: only its owner may run its "
                                         r"backward$"):
        store.take("b", "x", "e")
    store.take("a", "x", "e")
    with pytest.raises(StateError, match=r"^backward of expert 'e': no state for call 'x': used "
                                         r"by an earlier backward \(stateful state is used once\)$"):
        store.take("a", "x", "e")
    with pytest.raises(StateError, match=r"^backward of expert 'e': no state for call 'y': unknown "
                                         r"call id \(never stored on this server for this "
                                         r"client\)$"):
        store.take("a", "y", "e")
    with pytest.raises(StateError, match=r"^backward of expert 'e': no state for call 'x': unknown "
                                         r"call id"):
        store.take("b", "x", "e")  # another session learns nothing of a's call
    store.put("y", _state("a"))
    store.put("z", _state("b"))
    store.put("v", _state("a"))  # a tie: a's own oldest goes
    with pytest.raises(StateError, match=r"evicted: the server holds at most max_states=2 \(the "
                                         r"client holding the most gives way\)$"):
        store.take("a", "y", "e")
    store.release("a", ["w"])
    with pytest.raises(StateError, match=r"^forward of expert 'e': call id 'w' was released by "
                                         r"the client before its forward arrived \(the client "
                                         r"gave up on it\)$"):
        store.put("w", _state("a"))


def test_check_new_refuses_what_put_would_refuse() -> None:
    store = StateStore(ttl=30.0, max_states=4)
    store.check_new("a", "x", "e")  # free: no error
    store.put("x", _state("a"))
    with pytest.raises(StateError, match=r"^forward of expert 'lin': call id 'x' is already held"):
        store.check_new("a", "x", "lin")
    store.release("a", ["gone"])
    with pytest.raises(StateError, match="'gone' was released by the client before its forward"):
        store.check_new("a", "gone", "lin")
    with pytest.raises(StateError, match="'gone' was used before"):
        store.check_new("b", "gone", "lin")  # another session's tombstone
    assert len(store) == 1


def test_a_release_skips_another_sessions_ids_and_frees_the_rest(
        monkeypatch: pytest.MonkeyPatch) -> None:
    refusals: List[Tuple[str, str]] = []
    monkeypatch.setattr(state_module, "refuse", lambda reason, detail: refusals.append(
        (reason, detail)))
    store = StateStore(ttl=30.0, max_states=8)
    store.put("b" * 32, _state("b"))
    store.put("a0", _state("a"))
    store.put("a1", _state("a"))
    assert store.release("a", ["b" * 32, "a0", "a1"]) == 2  # b's is skipped, not the end
    assert list(store._states) == ["b" * 32] and store.counts["refused"] == 1
    assert refusals == [("not the owner", "a release of call bbbbbbbb... by another session")]
    with pytest.raises(StateError, match="no state for call 'a0': released by the client$"):
        store.take("a", "a0", "e")
    with pytest.raises(StateError, match="belongs to another session"):
        store.take("a", "b" * 32, "e")
    assert refusals[1] == ("not the owner",
                           "a backward of call bbbbbbbb... of expert 'e' by another session")


def test_remembered_ids_are_bounded_oldest_forgotten_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(state_module, "_REMEMBERED", 3)
    store = StateStore(ttl=30.0, max_states=8)
    for k in range(3):
        store.put(f"c{k}", _state("a"))
        store.take("a", f"c{k}", "e")
    assert list(store._gone) == ["c0", "c1", "c2"]  # exactly the bound: all remembered
    store.release("a", ["c3"])
    assert list(store._gone) == ["c1", "c2", "c3"]
    store.put("c0", _state("a"))  # forgotten: may be stored again


def test_a_new_client_at_a_tie_of_single_states_evicts_the_first_holder() -> None:
    store = StateStore(ttl=30.0, max_states=2)
    store.put("a0", _state("a"))
    store.put("b0", _state("b"))
    store.put("c0", _state("c"))
    assert list(store._states) == ["b0", "c0"]
    store = StateStore(ttl=30.0, max_states=100, max_bytes=2)
    store.put("a0", _state("a", 1))
    store.put("b0", _state("b", 1))
    store.put("c0", _state("c", 1))
    assert list(store._states) == ["b0", "c0"]


def test_clear_frees_everything() -> None:
    store = StateStore(ttl=30.0, max_states=8, max_bytes=100)
    store.put("a0", _state("a", 10))
    store.put("b0", _state("b", 20))
    store.clear()
    assert store.stats()["live"] == 0 and store.nbytes == 0 and store.stats()["clients"] == 0
    store.put("a1", _state("a", 100))  # the whole budget is free again
    assert store.nbytes == 100

"""The server's call-state store (:mod:`moe_autograd.remote.state`): the
eviction policy at a tie, and expiry swept by a ``put`` (no timer).

Time is a fake clock (``state.time.monotonic`` patched), so nothing here
sleeps or depends on timing (issue 34: survivors of a mutation run)."""
from typing import List

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
    with pytest.raises(StateError, match="evicted: the server's states hold at most "
                                         "max_state_bytes=400"):
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

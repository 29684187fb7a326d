"""What a request costs a server (:mod:`moe_autograd.remote.sizes`): every
tensor reachable through lists, tuples and dict *values* counts, once per
tally (issue 34: a mutation that walked a dict's keys instead survived)."""
from typing import Any

import pytest
import torch

from moe_autograd.remote.sizes import Tally, materialised_bytes

pytestmark = pytest.mark.timeout(30)


def test_a_tensor_reachable_only_as_a_dict_value_counts() -> None:
    t = torch.zeros(10)  # 40 bytes
    assert materialised_bytes({"t": t}) == 40
    assert materialised_bytes([{"a": {"b": (t,)}}]) == 40
    assert materialised_bytes({"x": t, "y": torch.zeros(5, dtype=torch.float64)}) == 80
    assert Tally().add({"t": t}, limit=39) is None


def test_a_tensor_used_as_a_mapping_key_is_not_a_value_of_the_request() -> None:
    # The wire carries str keys only (check_value refuses others); what a
    # server materialises is what the values hold, not the keys.
    t, u = torch.zeros(10), torch.zeros(3)
    key_only: Any = {t: "x"}
    assert materialised_bytes(key_only) == 0
    both: Any = {t: u}
    assert materialised_bytes(both) == 12


def test_each_tensor_counts_once_per_tally_at_full_size() -> None:
    t = torch.zeros(2, 5)
    assert materialised_bytes(t, [t], {"t": t}) == 40
    assert materialised_bytes(t, t.clone()) == 80  # another object: counted again
    assert materialised_bytes(torch.zeros(1, dtype=torch.int8).expand(6, 7)) == 42
    tally = Tally()
    assert tally.add(t) == 40 and tally.add({"again": t}) == 0 and tally.total == 40
    # (the tally knows tensors by id: the request keeps them alive while it counts)
    fifteen, one = torch.zeros(15), torch.zeros(1)
    assert tally.add(fifteen, limit=100) == 60 and tally.total == 100  # exactly at it
    assert tally.add(one, limit=100) is None and tally.total == 100


def test_a_walk_past_max_objects_is_refused_saying_why(monkeypatch: pytest.MonkeyPatch) -> None:
    from moe_autograd.remote import sizes
    monkeypatch.setattr(sizes, "MAX_OBJECTS", 10)
    with pytest.raises(ValueError, match=r"^the arguments hold more than 10 objects: too many to "
                                         r"account for their tensors$"):
        materialised_bytes([[] for _ in range(10)])

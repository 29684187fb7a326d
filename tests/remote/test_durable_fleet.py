"""A replica that joins an elastic fleet takes a live replica's state before
it is published (weights, optimizer state, steps: bit for bit), and after
the first replica is killed with kill -9 training goes on with no step lost
(issue 44). Runs tests/remote/peer_recovery.py (a trainer and two server
processes of their own world on a free loopback port)."""
import sys
from pathlib import Path

import pytest

from helpers import script_result

HERE = Path(__file__).resolve().parent

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="loopback world")


@pytest.mark.timeout(300)
def test_a_new_replica_takes_the_live_state_and_no_step_is_lost_when_the_first_dies() -> None:
    result = script_result(HERE / "peer_recovery.py")
    assert result["joined"] and result["steps_a"] == result["steps_b"] == 5, result
    assert result["b_equals_a"] and result["b_equals_reference_5"], result
    assert result["steps_b_after"] == 8 and result["b_equals_reference_8"], result
    assert any("expert 'dur' resumed from peer server_a (step 5)" in line
               for line in result["log_b"]), result["log_b"]

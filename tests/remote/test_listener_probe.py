"""An outsider's bare connects to a member's TensorPipe listener do not stop
the fleet from growing (issue 45, finding 6): torch's agent stops accepting
after them, the member notices (from /proc, moe_autograd/remote/elastic.py),
leaves cleanly and starts again from its snapshot, a new server joins, and
the steps after are exact on both replicas. Runs
tests/remote/listener_probe.py (a trainer and two server processes of their
own world on a free loopback port)."""
import sys
from pathlib import Path

import pytest

from helpers import script_result

HERE = Path(__file__).resolve().parent

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc, loopback")


@pytest.mark.timeout(450)
def test_bare_connects_to_a_members_listener_do_not_stop_joins() -> None:
    result = script_result(HERE / "listener_probe.py", timeout=430)
    assert result["probed"] > 0, result
    assert result["a_left"] and result["a_back"], result
    assert result["b_joined"], result
    assert result["server_a_equals_reference_5"] and result["server_b_equals_reference_5"], result
    log = result["log_a"]
    assert any("ERROR" in line and "TensorPipe listener" in line for line in log), log
    assert any("resumed from snapshot" in line and "(step 3)" in line for line in log), log

"""Replicas of a training expert stay one expert (moe_autograd/remote/mirrored.py,
lineage.py, issue 44): a server applies a fenced backward only at the version
its client expects and refuses any other, changing nothing; versions follow
the state through snapshots, restores and loads; and three replicas under
``balance="latency"`` stay bit-equal to a local run over 100 steps with one
killed at a random instant and a fresh one joined (tests/remote/mirror_fleet.py,
its own world on a free loopback port)."""
import sys
from pathlib import Path
from typing import Any, List

import pytest
import torch

from helpers import script_result
from moe_autograd.remote import ExpertServer, RemoteExpert, RemoteExpertError
from moe_autograd.remote.lineage import DIGEST_CHARS, after, check_fence, root
from test_durable import adam, batch, make_expert
from wiring import InProcess

HERE = "here"
HERE_DIR = Path(__file__).resolve().parent


def _version(expert: RemoteExpert) -> List[Any]:
    return list(expert._control("version"))


def _backward(expert: RemoteExpert, fence: Any, step: int = 0) -> Any:
    """One stateless call of ``expert`` whose backward carries ``fence``;
    returns the call's id."""
    x = batch(step).requires_grad_()
    call = expert._new_call(seed=step)
    outputs, _ = expert._forward(call, [x], grad=True)
    job = expert._backward_job(call, [x.detach()], [torch.ones_like(outputs[0])])
    job.message["fence"] = fence
    from moe_autograd.remote.batching import run_sync
    run_sync(job)
    return call.call_id


@pytest.mark.timeout(60)
def test_a_backward_is_applied_only_at_the_version_its_client_expects() -> None:
    with ExpertServer({"dur": make_expert()}, optimizer=adam, transport=InProcess(HERE)):
        expert = RemoteExpert(HERE, "dur", transport=InProcess(HERE))
        training, count, digest = _version(expert)
        assert training and count == 0
        assert digest == root(make_expert().state_dict(), adam(make_expert().parameters())
                              .state_dict())
        call_id = _backward(expert, [0, digest])
        assert _version(expert) == [True, 1, after(digest, call_id)]
        before = expert.remote_state_dict()
        for stale in ([0, digest], [1, "0" * DIGEST_CHARS]):  # behind, another history
            with pytest.raises(RemoteExpertError, match="stale replica.*nothing was changed"):
                _backward(expert, stale, step=1)
        after_state = expert.remote_state_dict()
        assert all(torch.equal(before[k], after_state[k]) for k in before)
        assert _version(expert)[1] == 1


@pytest.mark.timeout(60)
def test_a_fenced_call_ahead_of_the_expert_waits_then_is_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from moe_autograd.remote import server as server_module
    monkeypatch.setattr(server_module, "FENCE_WAIT_S", 0.2)
    with ExpertServer({"dur": make_expert()}, optimizer=adam, transport=InProcess(HERE)):
        expert = RemoteExpert(HERE, "dur", transport=InProcess(HERE))
        _, _, digest = _version(expert)
        with pytest.raises(RemoteExpertError, match="is at version 0.*expects 3"):
            _backward(expert, [3, digest])
        with pytest.raises(RemoteExpertError, match="field 'fence' must be"):
            _backward(expert, [0, "not hex"])


@pytest.mark.timeout(60)
def test_versions_follow_the_state_through_snapshots_restores_and_loads() -> None:
    with ExpertServer({"dur": make_expert()}, optimizer=adam, transport=InProcess(HERE)):
        expert = RemoteExpert(HERE, "dur", transport=InProcess(HERE))
        _, _, digest = _version(expert)
        _backward(expert, [0, digest])
        state = expert.remote_snapshot()
        assert state.lineage == _version(expert)[2]
        _backward(expert, [1, state.lineage], step=1)
        assert expert.restore_remote(state) == 1
        assert _version(expert) == [True, 1, state.lineage]
        expert.load_remote_state_dict(make_expert(seed=5).state_dict())
        assert _version(expert)[2] == root(make_expert(seed=5).state_dict(),
                                           expert.remote_snapshot().optimizer)
    with ExpertServer({"plain": make_expert()}, transport=InProcess(HERE)):  # does not train
        assert _version(RemoteExpert(HERE, "plain", transport=InProcess(HERE))) == [False, 0, ""]


def test_a_fence_is_checked_before_it_is_compared() -> None:
    assert check_fence(None, "w") is None
    assert check_fence([2, "a" * DIGEST_CHARS], "w") == (2, "a" * DIGEST_CHARS)
    for bad in ([True, "a" * DIGEST_CHARS], [-1, "a" * DIGEST_CHARS], [0, "A" * DIGEST_CHARS],
                [0, "a"], (0, "a" * DIGEST_CHARS), "x"):
        with pytest.raises(ValueError, match="w: field 'fence'"):
            check_fence(bad, "w")


@pytest.mark.timeout(300)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="loopback world")
def test_three_replicas_stay_one_expert_through_a_kill_and_a_fresh_join() -> None:
    result = script_result(HERE_DIR / "mirror_fleet.py", "11")
    live = [w for w in ("server_a", "server_b", "server_c", "server_d") if w != result["victim"]]
    for worker in live:  # no step lost, bit-equal to the uninterrupted local run
        assert result[worker] == {"steps": 100, "equal": True}, (worker, result)
    assert len([w for w, n in result["served"].items() if n]) >= 2, result  # spread
    assert result["resyncs"] >= 1, result  # server_d joined fresh and was brought into sync


@pytest.mark.timeout(300)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="loopback world")
def test_with_only_its_snapshots_the_trainer_goes_on_from_the_replacement(
        tmp_path: Path) -> None:
    """The only server of a training expert killed mid-pass, a replacement
    on its state directory: at most the save interval (3) is lost, the
    resumed weights equal a run without the crash at that step, and the
    same FleetExpert goes on training it (tests/remote/snapshot_recovery.py)."""
    result = script_result(HERE_DIR / "snapshot_recovery.py", str(tmp_path), "3")
    assert result["resumed_at"] == 6 and result["equal_at_resume"], result  # 7 or 8 done
    assert result["steps_after"] == 9 and result["equal_after"], result
    assert result["adopted"] == 1, result


def test_the_first_answer_takes_the_most_advanced_live_replica_as_the_truth() -> None:
    """A trainer that restarted meets a replica that resumed from an older
    snapshot first: the view asks the other live replicas before it takes a
    truth, so the behind one is out of sync (its answer unused) rather than
    the truth the others are brought back to."""
    from moe_autograd.remote.mirrored import OutOfSync, View

    class Says:
        def __init__(self, version: List[Any]) -> None:
            self.version = version

        def _control(self, what: str, payload: Any = None) -> Any:
            assert what == "version"
            return self.version
    ahead = [True, 5, "b" * DIGEST_CHARS]
    view = View("dur")
    with pytest.raises(OutOfSync, match="version 3, this client's 5"):
        view.learn("behind", [True, 3, "a" * DIGEST_CHARS], ["behind", "ahead"],
                   lambda worker: Says(ahead))  # type: ignore[arg-type,return-value]
    assert view.truth == (5, "b" * DIGEST_CHARS) and view.training
    # alone, it is what there is: taken as it is
    alone = View("dur")
    alone.learn("only", [True, 3, "a" * DIGEST_CHARS], ["only"], lambda w: Says(ahead))  # type: ignore[arg-type,return-value]
    assert alone.truth == (3, "a" * DIGEST_CHARS)

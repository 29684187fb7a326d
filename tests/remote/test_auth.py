"""Job secrets and sealed messages (moe_autograd/remote/auth.py): each rule of
the gate's table refuses what it must, counts and logs it, and reads nothing
of a refused request; replies are bound to their request and their server.
No engine: frames are sealed and opened in this process."""
import logging
import os
import stat
import time
from pathlib import Path
from typing import Any, List, Tuple

import pytest
import torch

from moe_autograd.remote import JobSecret, MissingSecretError, security_stats
from moe_autograd.remote import auth, endpoint, wire
from moe_autograd.remote.auth import Gate, Refused, ReplyRejected, Session
from moe_autograd.remote.frame import REFUSAL, Frame, FrameError, parse

pytestmark = pytest.mark.timeout(60)


def sealed(session: Session, worker: str = "srv", value: Any = None) -> Tuple[Frame, int]:
    body, buffers = wire.encode(value if value is not None else {"op": "info",
                                                                  "t": torch.arange(4.0)})
    return session.seal(worker, body, buffers)


@pytest.fixture
def secret() -> JobSecret:
    return JobSecret.generate()


@pytest.fixture
def gate(secret: JobSecret) -> Gate:
    g = Gate(max_clock_skew=5.0, started=0.0)  # (tests with a clock of their own)
    g.admit([secret])
    return g


# -- the secret ----------------------------------------------------------------------------
def test_a_secret_file_is_private_and_never_overwritten(tmp_path: Path) -> None:
    s = JobSecret.generate()
    path = s.save(tmp_path / "job.secret")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert JobSecret.from_file(path) == s and JobSecret.from_file(path).key_id == s.key_id
    with pytest.raises(FileExistsError):
        JobSecret.generate().save(path)
    os.chmod(path, 0o644)
    with pytest.raises(PermissionError, match="chmod 600"):
        JobSecret.from_file(path)
    assert s.hex() not in repr(s) and s.key_id.hex() in repr(s)


def test_the_secret_comes_from_the_environment_or_a_clear_error(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(auth, "_default", None)
    monkeypatch.delenv(auth.ENV_SECRET, raising=False)
    monkeypatch.delenv(auth.ENV_SECRET_FILE, raising=False)
    with pytest.raises(MissingSecretError, match="python -m moe_autograd secret"):
        auth.job_secret()
    s = JobSecret.generate()
    monkeypatch.setenv(auth.ENV_SECRET, s.hex())
    assert auth.job_secret() == s
    path = JobSecret.generate().save(tmp_path / "f")
    monkeypatch.setenv(auth.ENV_SECRET_FILE, str(path))  # the file wins
    assert auth.job_secret() == JobSecret.from_file(path)
    monkeypatch.setenv(auth.ENV_SECRET, "not hex")
    monkeypatch.delenv(auth.ENV_SECRET_FILE)
    with pytest.raises(ValueError, match="hex digits"):
        auth.job_secret()
    with pytest.raises(ValueError, match="at least 32 bytes"):
        JobSecret(b"short")


def test_the_mac_is_hmac_sha256() -> None:
    import hashlib
    import hmac

    for n in (32, 64, 65, 100):  # a key longer than SHA-256's block is hashed first
        key = bytes(range(n))
        parts = [b"header", memoryview(b"body" * 100), b"", bytes(5000)]
        assert JobSecret(key).mac(parts) == hmac.new(key, b"".join(parts), hashlib.sha256).digest()


# -- the gate's table ------------------------------------------------------------------------
def test_an_authentic_request_opens_once(secret: JobSecret, gate: Gate) -> None:
    session = Session(secret)
    frame, seq = sealed(session)
    caller, body, buffers, used = gate.open(frame, "srv")
    assert used == secret and caller.session == session.id and caller.seq == seq == 1
    assert caller.owner == session.owner
    assert torch.equal(wire.decode(body, buffers)["t"], torch.arange(4.0))
    with pytest.raises(Refused, match="replay"):
        gate.open(frame, "srv")


def _flip(frame: Frame, where: str) -> Frame:
    header = parse(frame)
    head = bytearray(frame.head)
    buffers = [bytearray(bytes(b.numpy())) for b in frame.buffers]
    if where == "header":
        head[20] ^= 1  # a byte of the session
    elif where == "body":
        head[header.body_start + 3] ^= 1
    elif where == "mac":
        head[header.mac_start] ^= 1
    else:
        buffers[0][0] ^= 1
    return Frame(bytes(head), buffers)


@pytest.mark.parametrize("where", ["header", "body", "mac", "buffer"])
def test_the_mac_covers_every_part(secret: JobSecret, gate: Gate, where: str) -> None:
    frame, _ = sealed(Session(secret))
    with pytest.raises(Refused, match="bad MAC"):
        gate.open(_flip(frame, where), "srv")


def test_refusals_of_the_table(secret: JobSecret, gate: Gate, monkeypatch: pytest.MonkeyPatch,
                               caplog: pytest.LogCaptureFixture) -> None:
    before = dict(security_stats()["refused"])
    session = Session(secret)
    frame, _ = sealed(session)
    with pytest.raises(Refused, match="bad MAC"):
        gate.open(frame, "another-server")  # sealed for "srv": refused everywhere else
    with pytest.raises(Refused, match="unknown job"):
        gate.open(sealed(Session(JobSecret.generate()))[0], "srv")
    with pytest.raises(Refused, match="malformed"):
        gate.open(Frame(b"\x80\x04not a frame", []), "srv")
    with pytest.raises(Refused, match="malformed"):
        gate.open(Frame(frame.head, []), "srv")  # its buffer missing
    old, _ = sealed(session)
    late = time.time() + 60  # sent a minute ago, seen now: past the 5 s skew
    monkeypatch.setattr(auth.time, "time", lambda: late)
    with pytest.raises(Refused, match="stale"):
        gate.open(old, "srv")
    monkeypatch.undo()
    after = security_stats()["refused"]
    for reason in ("bad MAC", "unknown job", "malformed", "stale"):
        assert after.get(reason, 0) > before.get(reason, 0), reason
    assert any("refused" in r.getMessage() and r.levelno == logging.WARNING
               for r in caplog.records if r.name == "moe_autograd.remote.auth")


def test_the_replay_window_takes_reordering_and_refuses_repeats(secret: JobSecret,
                                                                gate: Gate) -> None:
    session = Session(secret)
    frames = [sealed(session)[0] for _ in range(auth.WINDOW + 10)]
    for frame in reversed(frames[-50:]):  # arriving out of order: all taken
        gate.open(frame, "srv")
    with pytest.raises(Refused, match="replay"):
        gate.open(frames[-1], "srv")
    with pytest.raises(Refused, match="replay"):
        gate.open(frames[0], "srv")  # behind the window: refused, never taken twice
    gate.open(frames[-60], "srv")  # within the window, not seen: taken
    other = Session(secret)  # another session has its own numbers
    gate.open(sealed(other)[0], "srv")


def test_the_replay_window_boundary_is_exact() -> None:
    """A number exactly WINDOW behind the newest is outside the window
    (issue 46: a mutant taking ``>`` for ``>=`` survived the suite)."""
    window = auth._Window()
    assert window.accept(auth.WINDOW, 0.0)
    assert window.accept(1, 0.0)       # WINDOW - 1 behind: inside, not seen: taken
    assert not window.accept(1, 0.0)   # seen: a replay
    assert not window.accept(0, 0.0)   # exactly WINDOW behind: outside, refused


def test_a_request_dated_in_the_future_is_stale_too(secret: JobSecret, gate: Gate,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Freshness is a distance: a request sent an hour ahead of this clock is
    refused as one sent an hour ago is (issue 46: a mutant dropping ``abs``
    survived the suite)."""
    frame, _ = sealed(Session(secret))
    early = time.time() - 3600  # this server's clock an hour behind the sender's
    monkeypatch.setattr(auth.time, "time", lambda: early)
    with pytest.raises(Refused, match="stale"):
        gate.open(frame, "srv")


def test_a_logged_refusal_is_rate_limited(secret: JobSecret, gate: Gate,
                                          caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="moe_autograd.remote.auth")
    outsider = Session(JobSecret.generate())
    for _ in range(50):
        with pytest.raises(Refused):
            gate.open(sealed(outsider, value={"op": "x"})[0], "srv-rate")
    lines = [r for r in caplog.records if "unknown job" in r.getMessage()]
    assert len(lines) <= 1  # at most one line per reason every LOG_EVERY_S


# -- replies ---------------------------------------------------------------------------------
def test_a_reply_opens_only_for_its_request_and_server(secret: JobSecret, gate: Gate) -> None:
    session = Session(secret)
    frame, seq = sealed(session)
    caller, _, _, used = gate.open(frame, "srv")
    body, buffers = wire.encode({"reply": ["ok", torch.ones(2)], "refused": 0})
    reply = Gate.seal_reply(used, caller, "srv", body, buffers)
    got_body, got_buffers = session.open_reply("srv", seq, reply)
    assert torch.equal(wire.decode(got_body, got_buffers)["reply"][1], torch.ones(2))
    with pytest.raises(ReplyRejected, match="answers no request"):
        session.open_reply("srv", seq + 1, reply)  # an old reply for a new request
    with pytest.raises(ReplyRejected, match="MAC does not verify"):
        session.open_reply("impostor", seq, reply)  # from another server
    forged = Gate.seal_reply(JobSecret.generate(), caller, "srv", body, buffers)
    with pytest.raises(ReplyRejected):
        session.open_reply("srv", seq, forged)
    with pytest.raises(ReplyRejected, match="malformed"):
        session.open_reply("srv", seq, Frame(b"\x80\x04pickle", []))
    assert security_stats()["rejected_replies"].get("srv", 0) >= 2


def test_a_refusal_carries_its_reason_only() -> None:
    frame = auth.refusal_frame("replay")
    header = parse(frame)
    assert header.kind == REFUSAL and auth.REASONS[header.code] == "replay"
    assert frame.buffers == [] and header.body_len == 0
    with pytest.raises(Refused, match="replay"):
        Session(JobSecret.generate()).open_reply("srv", 1, frame)


def test_frames_with_lying_lengths_are_malformed() -> None:
    s = Session(JobSecret.generate())
    frame, _ = sealed(s)
    with pytest.raises(FrameError, match="buffer 0 has"):
        parse(Frame(frame.head, [b"\x00"]))
    with pytest.raises(FrameError, match="head is"):
        parse(Frame(frame.head + b"x", frame.buffers))
    with pytest.raises(FrameError, match="magic"):
        parse(Frame(b"X" * 100, []))


# -- the endpoint reads nothing of a refused request -------------------------------------------
def test_the_endpoint_refuses_before_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    decoded: List[Any] = []
    real = wire.decode
    monkeypatch.setattr(wire, "decode", lambda *a: decoded.append(a) or real(*a))
    outsider = Session(JobSecret.generate())
    frame, _ = sealed(outsider)
    reply = endpoint.serve(frame, "srv")
    assert parse(reply).kind == REFUSAL and decoded == []
    assert parse(endpoint.serve(Frame(b"garbage", []), "srv")).kind == REFUSAL


# -- what the mutation run of remote/auth.py found untested (issue 34) ------------------------
def test_set_job_secret_takes_a_secret_or_none_and_names_what_it_got() -> None:
    previous = auth.set_job_secret(None)  # None: back to the environment's
    try:
        with pytest.raises(TypeError, match="set_job_secret expects a JobSecret, got str"):
            auth.set_job_secret("00" * 32)  # type: ignore[arg-type]
        mine = JobSecret.generate()
        assert auth.set_job_secret(mine) is None
        assert auth.set_job_secret(None) is mine
    finally:
        auth.set_job_secret(previous)


def test_secrets_hash_as_their_key_ids() -> None:
    a, b = JobSecret.generate(), JobSecret.generate()
    assert hash(a) == hash(JobSecret.from_hex(a.hex())) == hash(a.key_id)
    assert hash(a) != hash(b)  # 8 random bytes apart: a dict of jobs does not collide


def test_a_bad_secret_in_the_environment_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(auth.ENV_SECRET, "not hex")
    with pytest.raises(ValueError, match=r"^\$MOE_AUTOGRAD_SECRET must be 64 or more hex"):
        JobSecret.from_env()


def test_a_record_signature_is_framed_and_verified_as_such() -> None:
    """Fleet records (rosters, marks) are signed texts: each text framed by
    its length after the domain "record", so that no two lists of texts,
    and no request MAC, share a signature."""
    s = JobSecret.generate()
    assert s.sign("a", "bc") == s.mac([b"6:record", b"1:a", b"2:bc"]).hex()
    assert s.sign("ab", "c") != s.sign("a", "bc") != s.sign("abc")
    assert s.verify(s.sign("a", "bc"), "a", "bc")
    assert not s.verify(s.sign("a", "bc"), "ab", "c")
    assert not s.verify(JobSecret.generate().sign("a", "bc"), "a", "bc")
    assert not s.verify(s.sign("a").encode(), "a")  # not a str: refused, not compared
    assert not s.verify(None, "a")


def test_a_rejected_reply_is_counted_and_logged_with_its_reason(
        secret: JobSecret, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="moe_autograd.remote.auth")
    worker = f"srv-reject-{time.monotonic_ns()}"  # a log key of its own: not rate-limited
    error = Session(secret).reject(worker, "a body that does not decode")
    assert isinstance(error, ReplyRejected)
    assert str(error) == f"server {worker!r} sent a body that does not decode"
    assert security_stats()["rejected_replies"][worker] == 1
    assert [r.getMessage() for r in caplog.records if worker in r.getMessage()] == [
        f"rejected a body that does not decode from server {worker!r}"]
    other = worker + "-b"  # rate-limited per server: another server's is logged too
    Session(secret).reject(other, "a body that does not decode")
    assert any(other in r.getMessage() for r in caplog.records)


def test_idle_sessions_are_forgotten_past_the_clock_skew(
        secret: JobSecret, gate: Gate, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sessions idle longer than max_clock_skew (5 s here) are forgotten
    first: their requests are stale by then, so forgetting their replay
    windows lets no replay in."""
    clock = [1_000_000.0]
    monkeypatch.setattr(auth.time, "time", lambda: clock[0])
    monkeypatch.setattr(auth, "MAX_SESSIONS", 2)
    first = sealed(Session(secret))[0]
    gate.open(first, "srv")
    gate.open(sealed(Session(secret))[0], "srv")
    clock[0] += 5.5
    gate.open(sealed(Session(secret))[0], "srv")  # the two idle ones forgotten
    with pytest.raises(Refused, match="stale"):
        gate.open(first, "srv")  # a forgotten session's request: stale, not replayable


def test_a_restarted_server_takes_no_request_sent_before_it_started(
        secret: JobSecret) -> None:
    """(issue 45) A request captured before a server restarted, replayed to
    the new process within max_clock_skew, is refused (the floor starts at
    the gate's start); one sent after the start is served."""
    captured = sealed(Session(secret))[0]
    time.sleep(0.01)
    restarted = Gate(max_clock_skew=300.0)
    restarted.admit([secret])
    stale = security_stats()["refused"].get("stale", 0)
    with pytest.raises(Refused, match="stale"):
        restarted.open(captured, "srv")
    assert security_stats()["refused"]["stale"] == stale + 1
    time.sleep(0.01)
    restarted.open(sealed(Session(secret))[0], "srv")


def test_a_bound_request_is_refused_by_a_restarted_process_whatever_the_clocks(
        secret: JobSecret) -> None:
    """(issue 45) A request bound to a server process's boot id (a client
    that read it from a signed record) is refused by the process that
    replaced it, even where the clocks cannot tell (the floor is not what
    refuses it: here it is made 0); an unbound one is refused only by the
    floor, and its flag cannot be cleared without breaking the MAC."""
    gate = Gate(max_clock_skew=300.0, started=0.0)
    gate.admit([secret])
    auth.bind_boot("srv-boot", gate.boot)
    try:
        session = Session(secret)
        frame = sealed(session, "srv-boot")[0]
        assert auth.parse(frame).bound
        gate.open(frame, "srv-boot")
        captured = sealed(session, "srv-boot")[0]
        gate.restart()
        gate._floor_ms = 0  # clocks apart: the floor cannot tell
        bad = security_stats()["refused"].get("bad MAC", 0)
        with pytest.raises(Refused, match="bad MAC"):
            gate.open(captured, "srv-boot")
        assert security_stats()["refused"]["bad MAC"] == bad + 1
        stripped = Frame(captured.head[:7] + b"\0" + captured.head[8:], captured.buffers)
        with pytest.raises(Refused, match="bad MAC"):  # unbinding it breaks its MAC
            gate.open(stripped, "srv-boot")
        auth.bind_boot("srv-boot", gate.boot)  # the new process's, from its new record
        gate.open(sealed(session, "srv-boot")[0], "srv-boot")
        with pytest.raises(ValueError, match="8 bytes"):
            auth.bind_boot("srv-boot", b"short")
    finally:
        auth.unbind_boot("srv-boot")


def test_a_client_that_fills_the_session_table_locks_nobody_out(
        secret: JobSecret, gate: Gate, monkeypatch: pytest.MonkeyPatch) -> None:
    """(issue 45) One member opens sessions without end: the least recently
    used go, a busy client keeps being served at once, and no request of an
    evicted session opens a window again (the floor)."""
    clock = [2_000_000.0]
    monkeypatch.setattr(auth.time, "time", lambda: clock[0])
    monkeypatch.setattr(auth, "MAX_SESSIONS", 64)
    busy = Session(secret)
    gate.open(sealed(busy)[0], "srv")
    flood = []
    for k in range(1000):  # a flood of one-request sessions, the busy client now and then
        clock[0] += 0.001
        frame = sealed(Session(secret))[0]
        gate.open(frame, "srv")
        flood.append(frame)
        if k % 16 == 0:
            gate.open(sealed(busy)[0], "srv")  # served at once, every time
    clock[0] += 0.001
    gate.open(sealed(Session(secret))[0], "srv")  # a second client, new: served at once
    stale = security_stats()["refused"].get("stale", 0)
    for frame in flood[:10]:  # evicted sessions: their requests stay refused
        with pytest.raises(Refused, match="stale"):
            gate.open(frame, "srv")
    assert security_stats()["refused"]["stale"] == stale + 10
    assert len(gate._windows) <= 64


def test_a_refusal_has_its_code_and_says_its_detail_or_else_its_help() -> None:
    for code, reason in auth.REASONS.items():
        assert Refused(reason).code == code
        assert str(Refused(reason)) == f"{reason}: {auth._HELP[reason]}"
        assert str(Refused(reason, "this request")) == f"{reason}: this request"


def test_a_key_id_is_the_documented_digest_of_the_key() -> None:
    """Servers and trainers of different installs must agree on it: it names
    the job in every header."""
    import hashlib

    key = bytes(range(32))
    assert JobSecret(key).key_id == hashlib.sha256(b"moe_autograd key id\0" + key).digest()[:8]


def test_secrets_that_are_no_secrets_are_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^the secret must be 64 or more hex digits, got 4$"):
        JobSecret.from_hex("abcd")
    with pytest.raises(ValueError, match=r"^the secret must be 64 or more hex digits$"):
        JobSecret.from_hex("not hex")
    missing = tmp_path / "missing.secret"
    with pytest.raises(MissingSecretError,
                       match=rf"^cannot read the job secret file '{missing}': \[Errno 2\]"):
        JobSecret.from_file(missing)
    for content in (b"abcd\n", "\u00e9".encode() * 40):  # too short; not ASCII at all
        path = tmp_path / f"bad-{len(content)}.secret"
        path.write_bytes(content)
        path.chmod(0o600)
        with pytest.raises(ValueError, match=rf"^the job secret file '{path}' must be 64 or "
                                             "more hex digits"):
            JobSecret.from_file(path)

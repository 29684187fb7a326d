"""The wire's MAC (GMAC under per-session keys) and its opt-in encryption
(AES-256-GCM), issue 47: the keys of each direction, server and message are
their own; a changed byte anywhere is refused; an encrypted frame carries no
plaintext; a message whose encryption is not its job's is refused; remote
calls equal local ones with encryption on (in process, and on torch RPC)."""
import time
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch

import remote_experts as rx
from moe_autograd.remote import ExpertServer, RemoteAuthError, RemoteExpert, security_stats, wire
from moe_autograd.remote.auth import (Gate, JobSecret, Refused, ReplyRejected, Session,
                                      _nonce)
from moe_autograd.remote.frame import MAC_BYTES, REPLY, REQUEST, Frame, parse
from wiring import SECRET, InProcess

pytestmark = pytest.mark.timeout(90)
PATTERN = b"issue-47 plaintext pattern \x01\x02\x03\x04" * 4


def _refused() -> Dict[str, int]:
    return dict(security_stats()["refused"])


def _message(tag: bytes = PATTERN) -> Tuple[bytes, List[Any], torch.Tensor]:
    """A request whose body and tensor hold ``tag``'s bytes."""
    tensor = torch.frombuffer(bytearray(tag * 8), dtype=torch.uint8).clone()
    body, buffers = wire.encode({"op": "x", "note": tag.decode("latin-1"), "args": [tensor]})
    return body, buffers, tensor


def _wire_bytes(frame: Frame) -> bytes:
    return bytes(frame.head) + b"".join(bytes(memoryview(b.numpy() if hasattr(b, "numpy") else b))
                                        for b in frame.buffers)


def _gate() -> Gate:
    return Gate(started=time.time() - 1.0)  # (a request of its first ms is newer)


def _pair(encrypt: bool) -> Tuple[JobSecret, Session, Gate]:
    secret = JobSecret.generate(encrypt=encrypt)
    gate = _gate()
    gate.admit([secret])
    return secret, Session(secret), gate


# -- the MAC and its keys ----------------------------------------------------------------
def test_the_mac_is_gmac_nist_test_case_13() -> None:
    """GCM's spec (McGrew and Viega), test case 13: AES-256, a zero key and
    nonce, nothing to authenticate or encrypt: the tag both paths give."""
    from moe_autograd.remote.auth import _WireKeys, _mac_tag

    keys = _WireKeys(bytes(64))
    expected = bytes.fromhex("530f8afbc74536b9a963b4f1c4cb738b")
    assert _mac_tag(keys, bytes(12), []) == expected
    assert _mac_tag(keys, bytes(12), [], total=1 << 20) == expected  # (the part-by-part path)


@pytest.mark.parametrize("sizes", [[0], [5, 11], [16], [32752, 16], [32768, 1], [32769],
                                   [1 << 20, 3, 7]])
def test_a_tag_is_gmac_whether_joined_or_streamed(sizes: List[int]) -> None:
    """The plain MAC is GMAC (AES-256-GCM with the message as associated
    data and nothing to encrypt): joined and tagged in one call for small
    messages, fed part by part for large ones; both give the library's
    AES-GCM tag, on each side of the threshold."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    from moe_autograd.remote.auth import _WireKeys, _mac_tag

    raw = bytes(range(64))
    keys, nonce = _WireKeys(raw), bytes(range(12))
    parts = [bytes((k * 7 + n) % 256 for n in range(size)) for k, size in enumerate(sizes)]
    expected = AESGCM(raw[:32]).encrypt(nonce, b"", b"".join(parts))
    assert _mac_tag(keys, nonce, parts) == expected
    assert _mac_tag(keys, nonce, [memoryview(p) for p in parts]) == expected


def test_keys_differ_per_destination_direction_process_and_number() -> None:
    secret = JobSecret.generate()
    session = bytes(range(16))
    keys = {secret.wire_keys(session, "srv-a", REQUEST), secret.wire_keys(session, "srv-b", REQUEST),
            secret.wire_keys(session, "srv-a", REPLY, b"b" * 8),
            secret.wire_keys(session, "srv-a", REPLY, b"c" * 8),
            secret.wire_keys(bytes(16), "srv-a", REQUEST),
            JobSecret.generate().wire_keys(session, "srv-a", REQUEST)}
    assert len(keys) == 6 and all(len(k) == 64 and k[:32] != k[32:] for k in keys)
    nonces = {_nonce(kind, seq) for kind in (REQUEST, REPLY) for seq in range(1, 50)}
    assert len(nonces) == 98 and all(len(n) == 12 for n in nonces)


@pytest.mark.parametrize("encrypt", [False, True])
def test_a_request_for_one_server_is_refused_by_another(encrypt: bool) -> None:
    _, session, gate = _pair(encrypt)
    body, buffers, _ = _message()
    frame, _ = session.seal("srv-a", body, buffers)
    before = _refused().get("bad MAC", 0)
    with pytest.raises(Refused, match="^bad MAC"):
        gate.open(frame, "srv-b")
    assert _refused().get("bad MAC", 0) == before + 1
    gate.open(frame, "srv-a")  # (refused above before its window: still taken here once)


@pytest.mark.parametrize("encrypt", [False, True])
def test_a_reply_cannot_be_replayed_as_a_request(encrypt: bool) -> None:
    _, session, gate = _pair(encrypt)
    body, buffers, _ = _message()
    frame, seq = session.seal("srv", body, buffers)
    caller, _, _, used = gate.open(frame, "srv")
    reply = Gate.seal_reply(used, caller, "srv", body, buffers)
    with pytest.raises(Refused, match="^malformed"):
        gate.open(reply, "srv")  # as it is: not a request
    head = bytearray(reply.head)
    head[5] = REQUEST          # its kind made a request's,
    head[48:56] = bytes(8)     # and its boot id a request's (zero)
    with pytest.raises(Refused, match="^bad MAC"):
        gate.open(Frame(bytes(head), reply.buffers), "srv")
    # and a request cannot pass for its reply
    forged = bytearray(frame.head)
    forged[5] = REPLY
    forged[48:56] = reply.head[48:56]
    with pytest.raises(ReplyRejected, match="MAC does not verify"):
        session.open_reply("srv", seq, Frame(bytes(forged), frame.buffers))
    got, got_buffers = session.open_reply("srv", seq, reply)
    assert wire.decode(got, got_buffers)["note"] == PATTERN.decode("latin-1")


@pytest.mark.parametrize("encrypt", [False, True])
@pytest.mark.parametrize("where", ["session", "seq", "sent", "boot", "mac", "body", "buffer"])
def test_a_changed_byte_anywhere_is_a_bad_mac(encrypt: bool, where: str) -> None:
    _, session, gate = _pair(encrypt)
    body, buffers, tensor = _message()
    frame, seq = session.seal("srv", body, buffers)
    header = parse(frame)
    head, sealed = bytearray(frame.head), [b.clone() if isinstance(b, torch.Tensor)
                                           else bytearray(b) for b in frame.buffers]
    at = {"session": 20, "seq": 33, "sent": 41, "boot": 50, "mac": header.mac_start + 3,
          "body": header.body_start + 2}.get(where)
    if at is not None:
        head[at] ^= 0x10
    else:
        sealed[0][7] ^= 0x10
    expected = "malformed" if where == "boot" else "bad MAC"  # a request's boot is zero
    with pytest.raises(Refused, match=f"^{expected}"):
        gate.open(Frame(bytes(head), sealed), "srv")
    caller, got, got_buffers, used = gate.open(frame, "srv")  # the original: still taken
    assert torch.equal(wire.decode(got, got_buffers)["args"][0], tensor)
    # the reply likewise
    reply = Gate.seal_reply(used, caller, "srv", body, buffers)
    header = parse(reply)
    head, sealed = bytearray(reply.head), [b.clone() for b in reply.buffers]
    if at is not None:
        head[at if where != "mac" else header.mac_start + 3] ^= 0x10
    else:
        sealed[0][7] ^= 0x10
    with pytest.raises(ReplyRejected):
        session.open_reply("srv", seq, Frame(bytes(head), sealed))
    session.open_reply("srv", seq, reply)


# -- encryption --------------------------------------------------------------------------
def test_an_encrypted_frame_carries_no_plaintext() -> None:
    body, buffers, _ = _message()
    plain, _ = Session(JobSecret.generate()).seal("srv", body, buffers)
    assert PATTERN in _wire_bytes(plain)  # (the pattern is there to be found)
    for kind in ("request", "reply"):
        secret, session, gate = _pair(True)
        frame, seq = session.seal("srv", body, buffers)
        if kind == "reply":
            caller, _, _, used = gate.open(frame, "srv")
            frame = Gate.seal_reply(used, caller, "srv", body, buffers)
        assert parse(frame).encrypted and len(parse(frame).views[0]) == buffers[0].numel()
        sent = _wire_bytes(frame)
        for k in range(0, len(PATTERN) - 16, 8):
            assert PATTERN[k:k + 16] not in sent, kind
        assert body not in sent


def _big_message() -> Tuple[bytes, List[Any], torch.Tensor]:
    """A request whose tensor is past the in-place and huge-page thresholds."""
    tensor = torch.randn(1 << 20)  # 4 MiB
    body, buffers = wire.encode({"op": "x", "args": [tensor, torch.ones(3)]})
    return body, buffers, tensor


def _received(frame: Frame, owned: bool = True) -> Frame:
    """``frame`` as an engine that copies what it receives hands it over."""
    return Frame(frame.head, [b.clone() for b in frame.buffers], frame.label, owned=owned)


@pytest.mark.parametrize("kind", ["request", "reply"])
def test_an_owned_frame_is_decrypted_in_place_and_others_are_not(kind: str) -> None:
    """A frame whose buffers are the receiver's own (torch RPC's) is decrypted
    into them; a frame that is not (the in-process transport's, a captured
    one) keeps its ciphertext, and every copy of it opens the same."""
    _, session, gate = _pair(True)
    body, buffers, tensor = _big_message()
    frame, seq = session.seal("srv", body, buffers)
    if kind == "reply":
        caller, _, _, used = gate.open(frame, "srv")
        frame = Gate.seal_reply(used, caller, "srv", body, buffers)

    def open_(received: Frame) -> Tuple[bytes, Any]:
        if kind == "request":
            _, got, got_buffers, _ = _gate_with(session).open(received, "srv")
            return got, got_buffers
        return session.open_reply("srv", seq, received)

    ciphertext = [b.clone() for b in frame.buffers]
    shared = _received(frame, owned=False)
    got, got_buffers = open_(shared)
    assert torch.equal(wire.decode(got, got_buffers)["args"][0], tensor)
    assert all(torch.equal(a, b) for a, b in zip(shared.buffers, ciphertext))  # untouched
    owned = _received(frame)
    got, got_buffers = open_(owned)
    assert got_buffers[0] is owned.buffers[0]  # decrypted into the buffer that arrived
    assert got_buffers[1] is not owned.buffers[1]  # (a small one: into a new buffer)
    value = wire.decode(got, got_buffers)
    assert torch.equal(value["args"][0], tensor) and torch.equal(value["args"][1], torch.ones(3))
    assert value["args"][0].data_ptr() == owned.buffers[0].data_ptr()


def _gate_with(session: Session) -> Gate:
    gate = _gate()
    gate.admit([session.secret])
    return gate


@pytest.mark.parametrize("where", ["big", "small", "body"])
def test_an_owned_frame_changed_anywhere_is_refused(where: str) -> None:
    secret, session, gate = _pair(True)
    body, buffers, _ = _big_message()
    frame, _ = session.seal("srv", body, buffers)
    received = _received(frame)
    head = bytearray(received.head)
    if where == "body":
        head[parse(frame).body_start + 1] ^= 1
    else:
        received.buffers[0 if where == "big" else 1][5] ^= 1
    before = _refused().get("bad MAC", 0)
    with pytest.raises(Refused, match="^bad MAC"):
        gate.open(Frame(bytes(head), received.buffers, owned=True), "srv")
    assert _refused()["bad MAC"] == before + 1
    gate.open(_received(frame), "srv")  # the original, received again: taken


def test_large_cipher_buffers_are_writable_and_of_their_size() -> None:
    from moe_autograd.remote.auth import _cipher_buffer
    for n in (0, 100, (4 << 20) - 15, 4 << 20, (8 << 20) + 3):
        buffer = _cipher_buffer(n)
        assert buffer.dtype == torch.uint8 and buffer.dim() == 1 and buffer.numel() == n + 15
        buffer.fill_(7)
        assert int(buffer[-1]) == 7 and buffer.numpy().flags.writeable


def test_a_message_in_clear_to_an_encrypting_job_is_refused_and_counted() -> None:
    key = JobSecret.generate()
    encrypting, plain = key.encrypting(True), key.encrypting(False)
    assert encrypting.key_id == plain.key_id and encrypting != plain
    body, buffers, _ = _message()
    for gate_secret, client_secret in ((encrypting, plain), (plain, encrypting)):
        gate = _gate()
        gate.admit([gate_secret])
        before = _refused().get("encryption mismatch", 0)
        with pytest.raises(Refused, match="^encryption mismatch"):
            gate.open(Session(client_secret).seal("srv", body, buffers)[0], "srv")
        assert _refused().get("encryption mismatch", 0) == before + 1
    # a reply whose encryption is not the job's: rejected by the client, counted
    session = Session(encrypting)
    gate = _gate()
    gate.admit([encrypting])
    frame, seq = session.seal("srv", body, buffers)
    caller, _, _, _ = gate.open(frame, "srv")
    clear = Gate.seal_reply(plain, caller, "srv", body, buffers)
    rejected = sum(security_stats()["rejected_replies"].values())
    with pytest.raises(ReplyRejected, match="in clear to a job that encrypts"):
        session.open_reply("srv", seq, clear)
    assert sum(security_stats()["rejected_replies"].values()) == rejected + 1


def test_the_encrypt_setting_comes_from_its_constructors(tmp_path: Any,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    path = JobSecret.generate().save(str(tmp_path / "job.secret"))
    assert not JobSecret.from_file(path).encrypt and JobSecret.from_file(path, True).encrypt
    assert JobSecret.generate(encrypt=True).encrypt
    assert "encrypt=True" in repr(JobSecret.generate(encrypt=True))
    monkeypatch.setenv("MOE_AUTOGRAD_SECRET_FILE", path)
    monkeypatch.setenv("MOE_AUTOGRAD_ENCRYPT", "1")
    assert JobSecret.from_env() == JobSecret.from_file(path, encrypt=True)
    monkeypatch.setenv("MOE_AUTOGRAD_ENCRYPT", "0")
    assert JobSecret.from_env() == JobSecret.from_file(path)


def test_serve_takes_encrypt() -> None:
    from moe_autograd.remote.cli import build_parser

    args = build_parser().parse_args(["--experts", "m:f", "--encrypt"])
    assert args.encrypt
    assert not build_parser().parse_args(["--experts", "m:f"]).encrypt


# -- end to end --------------------------------------------------------------------------
class _Recording:
    """InProcess, keeping every frame it carries (both ways)."""

    name = "recording"

    def __init__(self) -> None:
        self.inner = InProcess()
        self.frames: List[Frame] = []

    def call(self, worker: str, frame: Frame, timeout: Optional[float]) -> Any:
        self.frames.append(frame)
        pending = self.inner.call(worker, frame, timeout)
        self.frames.append(pending.result(timeout))
        return pending

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _local_and_remote(expert: RemoteExpert) -> None:
    local = rx.enc_lin()
    x = torch.randn(5, rx.WIDTH, requires_grad=True)
    y = local(x)
    y.backward(torch.ones_like(y))
    xr = x.detach().clone().requires_grad_(True)
    yr = expert(xr)
    yr.backward(torch.ones_like(yr))
    assert torch.equal(yr, y) and torch.equal(xr.grad, x.grad)


def test_an_encrypting_job_in_process_equals_local() -> None:
    secret = rx.encrypted_job(SECRET)
    server = ExpertServer({"enc_lin": rx.enc_lin()}, secret=secret)
    try:
        transport = _Recording()
        _local_and_remote(RemoteExpert("in-process", "enc_lin", transport=transport,
                                       secret=secret))
        assert len(transport.frames) >= 4
        for frame in transport.frames:
            assert parse(frame).encrypted and MAC_BYTES == 16
        with pytest.raises(RemoteAuthError, match="encryption mismatch"):
            RemoteExpert("in-process", "enc_lin", transport=InProcess(),
                          secret=secret.encrypting(False))(torch.randn(2, rx.WIDTH))
    finally:
        server.close()


def test_an_encrypting_job_on_torch_rpc_equals_local(world: Any) -> None:
    from moe_autograd.remote import RpcTransport

    secret = rx.encrypted_job(SECRET)
    for worker in world:
        _local_and_remote(RemoteExpert(worker, "enc_lin", transport=RpcTransport(),
                                       secret=secret))
    with pytest.raises(RemoteAuthError, match="encryption mismatch"):
        RemoteExpert(world[0], "enc_lin", transport=RpcTransport(),
                     secret=secret.encrypting(False))(torch.randn(2, rx.WIDTH))


def test_an_encrypting_job_on_ray_equals_local(ray_world: Dict[str, Any]) -> None:
    secret = rx.encrypted_job(SECRET)
    for server in ray_world["servers"]:
        _local_and_remote(RemoteExpert(server.name, "enc_lin", transport=ray_world["transport"],
                                       secret=secret))

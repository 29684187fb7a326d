"""Benchmarks of durable expert state (issue 44): what a snapshot every N
steps costs a training expert, and how fast a state travels to a new replica.

Both rows run in this process: an :class:`~moe_autograd.remote.ExpertServer`
answered through the whole wire (seal, encode, open, decode) by an
in-process transport, no engine. ``durable/save-overhead`` is the time of 10
training steps (forward, backward, the server's Adam step) with a snapshot
every 10 steps against the same without a state directory.
``durable/peer-transfer`` is ``remote_snapshot()`` (the server copies the
state, seals it, the client opens and checks it) against sending the same
number of bytes over a loopback TCP connection (a raw copy: the floor of any
transfer on this machine).
"""
import os
import shutil
import socket
import tempfile
import threading
from typing import Any, List

import torch
from torch import nn

from ..remote import ExpertServer, JobSecret, RemoteExpert
from ..remote.loopback import InProcess
from .measure import Plan, Row, compare, measure

__all__ = ["bench_durable"]

WIDTH, HIDDEN, ROWS = 256, 1024, 64


def _expert() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, WIDTH))


def _socket_copy(nbytes: int) -> Any:
    """A step that sends ``nbytes`` over a loopback TCP connection and
    receives them whole; and a function that closes the connection."""
    listener = socket.create_server(("127.0.0.1", 0))
    sender = socket.create_connection(listener.getsockname())
    receiver, _ = listener.accept()
    listener.close()
    payload = bytes(nbytes)
    sink = bytearray(nbytes)

    def step() -> None:
        thread = threading.Thread(target=sender.sendall, args=(payload,))
        thread.start()
        view, got = memoryview(sink), 0
        while got < nbytes:
            got += receiver.recv_into(view[got:], nbytes - got)
        thread.join()

    def close() -> None:
        sender.close()
        receiver.close()
    return step, close


def bench_durable(quick: bool) -> List[Row]:
    plan = Plan.pick(quick, Plan(warmup=2, reps=15), Plan(warmup=1, reps=3))
    secret = JobSecret.generate()
    transport = InProcess("bench")
    directory = tempfile.mkdtemp(prefix="moe-bench-durable-")
    adam = lambda params: torch.optim.Adam(params, lr=1e-3)  # noqa: E731
    servers = [ExpertServer({"plain": _expert()}, optimizer=adam, secret=secret,
                            transport=transport),
               ExpertServer({"durable": _expert()}, optimizer=adam, secret=secret,
                            transport=transport, state_dir=directory, save_every=10)]
    close_socket = None
    try:
        experts = {name: RemoteExpert("here", name, transport=transport, secret=secret)
                   for name in ("plain", "durable")}
        x = torch.randn(ROWS, WIDTH)

        def steps(expert: RemoteExpert) -> Any:
            def run() -> None:
                for _ in range(10):
                    expert(x).square().mean().backward()
            return run
        samples = measure({name: steps(e) for name, e in experts.items()}, plan.reps,
                          plan.warmup)
        state_mb = sum(os.path.getsize(os.path.join(directory, "durable", f))
                       for f in os.listdir(os.path.join(directory, "durable"))
                       if f.endswith(".snap")) / 1e6 / max(1, len(
                           [f for f in os.listdir(os.path.join(directory, "durable"))
                            if f.endswith(".snap")]))
        rows = [compare("durable/save-overhead", samples, "plain", "durable", 1.05,
                        f"10 training steps of a {WIDTH}-{HIDDEN}-{WIDTH} MLP with Adam on its "
                        f"server (in process, the whole wire), a {state_mb:.1f} MB snapshot "
                        "every 10 steps (written and fsynced within the step that made it "
                        "due) vs no state directory")]
        nbytes = int(state_mb * 1e6)
        copy, close_socket = _socket_copy(nbytes)
        durable = experts["durable"]
        def transfer() -> None:
            durable.remote_snapshot()
        samples = measure({"socket": copy, "transfer": transfer}, plan.reps, plan.warmup)
        mbps = nbytes / 1e3 / sorted(samples["transfer"])[len(samples["transfer"]) // 2]
        raw = nbytes / 1e3 / sorted(samples["socket"])[len(samples["socket"]) // 2]
        rows.append(compare("durable/peer-transfer", samples, "socket", "transfer", None,
                            f"remote_snapshot() of the same expert ({state_mb:.1f} MB: copied "
                            f"under its lock, sealed, opened and checked; in process, no "
                            f"engine): {mbps:.0f} MB/s, vs {raw:.0f} MB/s for the same bytes "
                            "over a loopback TCP connection"))
        return rows
    finally:
        if close_socket is not None:
            close_socket()
        for server in servers:
            server.close()
        shutil.rmtree(directory, ignore_errors=True)

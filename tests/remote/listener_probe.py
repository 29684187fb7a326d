"""Bare connects to a member's TensorPipe listener do not stop the fleet
from growing (issue 45, finding 6; not a test module:
tests/remote/test_durable_fleet.py runs it).

    python listener_probe.py

The trainer founds an elastic world; ``server_a`` (Adam, a step after every
backward, a snapshot directory) serves ``dur`` and trains 3 steps. An
outsider connects to each of ``server_a``'s listening ports twice and closes
at once (torch's TensorPipe agent then stops accepting: before, every later
join timed out). ``server_a`` notices, leaves cleanly and starts again;
``server_b`` joins; 2 more steps run on both. Prints one JSON line: whether
each happened and whether both replicas' weights equal a local run's.
"""
import json
import socket
import subprocess
import tempfile
import threading
import time
from typing import Any, Dict, List

from peer_recovery import _same, batch, reference, serve, stop_all


def _collect(process: "subprocess.Popen[str]", lines: List[str]) -> threading.Thread:
    def read() -> None:
        assert process.stderr is not None
        for line in process.stderr:
            lines.append(line.rstrip())
    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


def _rejoined(lines: List[str]) -> bool:
    """Whether a "joined as" line follows the "starting again" one."""
    text = "\n".join(lines)
    again = text.find("starting again")
    return again >= 0 and text.find("joined as", again) >= 0


def _wait(condition: Any, timeout: float, fleet: Any) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        fleet.refresh()
        if condition():
            return True
        time.sleep(0.2)
    return False


def main() -> None:
    from moe_autograd.remote import Fleet, RemoteExpert, RpcTransport, rpc_bind
    from moe_autograd.remote.loopback import free_port

    port = free_port()
    fleet = Fleet.start("trainer", "127.0.0.1", port)
    servers: Dict[str, "subprocess.Popen[str]"] = {}
    logs: Dict[str, List[str]] = {"server_a": [], "server_b": []}
    result: Dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as state_a, tempfile.TemporaryDirectory() as state_b:
        try:
            servers["server_a"] = serve("server_a", port, 0, "--state-dir", state_a)
            _collect(servers["server_a"], logs["server_a"])
            fleet.wait_for(["dur"], timeout=90)
            expert = fleet.expert("dur", forward_timeout=30, backward_timeout=30)
            for step in range(3):
                expert(batch(step)).square().mean().backward()
            ports = [a for a in rpc_bind.listening(servers["server_a"].pid)
                     if a.startswith("127.")]
            result["probed"] = len(ports)
            for address in ports:
                for _ in range(2):
                    try:
                        socket.create_connection(("127.0.0.1", int(address.rpartition(":")[2])),
                                                 timeout=2).close()
                    except OSError:
                        pass
            result["a_left"] = _wait(lambda: any("starting again" in line
                                                 for line in logs["server_a"]), 60, fleet)
            result["a_back"] = _wait(lambda: _rejoined(logs["server_a"])
                                     and "server_a" in fleet.replicas("dur"), 120, fleet)
            servers["server_b"] = serve("server_b", port, 7, "--state-dir", state_b)
            _collect(servers["server_b"], logs["server_b"])
            started = time.monotonic()
            result["b_joined"] = _wait(lambda: "server_b" in fleet.replicas("dur"), 90, fleet)
            result["b_join_s"] = round(time.monotonic() - started, 1)
            for step in range(3, 5):
                expert(batch(step)).square().mean().backward()
            want = reference(5)
            for name in ("server_a", "server_b"):
                got = RemoteExpert(name, "dur", transport=RpcTransport(),
                                   forward_timeout=30).remote_snapshot().module
                result[f"{name}_equals_reference_5"] = _same(got, want)
        finally:
            stop_all(fleet, servers)
    result["log_a"] = [line for line in logs["server_a"]
                       if "listener" in line or "starting again" in line or "resumed" in line]
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

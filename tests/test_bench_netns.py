"""The rate-limited namespace of the bandwidth rows (:mod:`moe_autograd.bench.netns`):
made with its token bucket, always deleted (``with``, an exception, interpreter
exit, a stale name of a killed run), never touching the host's loopback; and
the rows skip with the reason where namespaces are not allowed. The tests
that make namespaces run only as root with ``ip`` and ``tc`` (skipped
otherwise)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moe_autograd.bench import bandwidth, netns

pytestmark = pytest.mark.timeout(60)
allowed = pytest.mark.skipif(netns.unavailable() is not None,
                             reason=f"no namespaces here: {netns.unavailable()}")


def _ours() -> set:
    return {n for n in netns.namespaces() if n.startswith(netns.PREFIX)}


@allowed
def test_made_limited_and_deleted() -> None:
    before = _ours()
    with netns.RateLimitedNetns(100) as ns:
        assert ns.name in netns.namespaces()
        shown = subprocess.run(ns.command(["tc", "qdisc", "show", "dev", "lo"]),
                               capture_output=True, text=True, timeout=10).stdout
        assert "tbf" in shown and "100Mbit" in shown, shown
        netns.set_rate(1000, ns.name)  # a change of rate, from outside
        inside = subprocess.run(ns.command([sys.executable, "-c", "import os; print(os.environ["
                                            "'MOE_AUTOGRAD_NETNS'])"]),
                                capture_output=True, text=True, timeout=10).stdout.strip()
        assert inside == ns.name
        shown = subprocess.run(ns.command(["tc", "qdisc", "show", "dev", "lo"]),
                               capture_output=True, text=True, timeout=10).stdout
        assert "1Gbit" in shown, shown
    assert _ours() == before - {ns.name}
    with pytest.raises(ZeroDivisionError):
        with netns.RateLimitedNetns(100) as failing:
            assert failing.name in netns.namespaces()
            1 / 0
    assert failing.name not in netns.namespaces()


@allowed
def test_deleted_at_exit_and_stale_names_swept() -> None:
    script = (f"import importlib.util as u; s = u.spec_from_file_location('netns', "
              f"{str(Path(netns.__file__))!r}); m = u.module_from_spec(s); "
              "s.loader.exec_module(m); ns = m.RateLimitedNetns(100).__enter__(); print(ns.name)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=30)  # (the module alone: no torch to import)
    name = done.stdout.strip()
    assert done.returncode == 0 and name.startswith(netns.PREFIX), done.stderr
    assert name not in netns.namespaces()  # the interpreter's exit deleted it
    stale = f"{netns.PREFIX}999999999-dead"  # a pid above any pid_max: its run is gone
    subprocess.run(["ip", "netns", "add", stale], check=True, timeout=10)
    try:
        assert stale in netns.sweep_stale()
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True, timeout=10)
    assert stale not in netns.namespaces()


def test_never_limits_the_hosts_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MOE_AUTOGRAD_NETNS", raising=False)
    with pytest.raises(netns.NetnsUnavailable, match="host's loopback"):
        netns.set_rate(10)


def test_rows_skip_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "needs root" in str(netns.unavailable())
    rows = bandwidth.run(quick=True)
    assert len(rows) == 1 and rows[0]["note"].startswith("skipped: needs root"), rows
    with pytest.raises(netns.NetnsUnavailable, match="needs root"):
        netns.RateLimitedNetns(100)

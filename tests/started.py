"""Slow subprocesses a test module starts together, with its first test, and
that each test then reads: they mostly import torch and wait (for servers,
deadlines, each other's cores), so side by side they take a fraction of
their time one after another (tests/test_examples.py, tests/test_demos.py,
tests/remote/test_fault_plans.py).

A process's time limit counts from its start, not from the test that reads
it; one that no test reads (deselected, or the run stopped) is killed at the
module's end by whoever started it."""
import os
import signal
import subprocess
import time
from typing import Any, List, Sequence, Tuple

import pytest


class Started:
    """A subprocess started now (its output piped), read by :meth:`finish`.

    With ``session`` it runs in a session of its own, and :meth:`kill` ends
    that whole session (the servers it started with it)."""

    def __init__(self, argv: Sequence[str], timeout: float, *, session: bool = False,
                 **popen: Any) -> None:
        popen.setdefault("stderr", subprocess.PIPE)
        self.process = subprocess.Popen(list(argv), stdout=subprocess.PIPE, text=True,
                                        start_new_session=session, **popen)
        self.started = time.monotonic()
        self.timeout = timeout
        self.session = session

    def finish(self) -> Tuple[str, str, bool]:
        """Its output and error output once it exited, and whether it ran
        past its time limit (then it was killed)."""
        left = max(1.0, self.timeout - (time.monotonic() - self.started))
        try:
            out, err = self.process.communicate(timeout=left)
            return out, err or "", False
        except subprocess.TimeoutExpired:
            out, err = self.kill()
            return out, err, True

    def kill(self) -> Tuple[str, str]:
        """Kills it (its session too, with ``session``); its output so far."""
        if self.session:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        else:
            self.process.kill()
        out, err = self.process.communicate(timeout=30)
        return out, err or ""


def selected(request: pytest.FixtureRequest) -> List[str]:
    """The names of the tests of the requesting module that this session runs."""
    return [item.name for item in request.session.items
            if getattr(item, "module", None) is request.module]

"""A whole training job saved and resumed at a step boundary: the trainer's
own modules, optimizers and random state, and every remote expert's state.

Why this module exists: ``model.state_dict()`` holds a trainer's local parts
only; the weights and optimizer states of remote experts live on their
servers, so a trainer that dies could not resume its job as it was.
:func:`save_job` takes everything at once, between two steps (no pass in
flight: every backward has returned, so every server has applied the steps
it owes), and :func:`restore_job` puts it all back: the local parts here,
each expert's state into its server (every live replica of a
:class:`~.replicas.FleetExpert`), whatever those servers held before.

Layout: ``DIRECTORY/job-<step>/`` holds ``trainer.snap`` (the local parts)
and one ``<expert>.snap`` per remote expert, each a sealed snapshot of
:mod:`.durable` (the job's MAC, no pickle). A checkpoint is written in a
temporary folder and renamed into place: it exists whole or not at all, and
:func:`restore_job` takes the newest complete one (a damaged file makes the
whole checkpoint refused, by path and reason, and the one before is used).
The newest :data:`KEEP_JOBS` are kept.
"""
import logging
import os
import shutil
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from .auth import JobSecret, refuse, resolve_secret
from .durable import ExpertState, SnapshotError, numbered, read_snapshot, write_snapshot

__all__ = ["save_job", "restore_job", "JobState", "KEEP_JOBS"]

KEEP_JOBS = 2
_log = logging.getLogger(__name__)


@dataclass
class JobState:
    """What :func:`restore_job` restored: the step, the path it came from,
    the ``extra`` saved with it, and each expert's steps."""

    step: int
    path: str
    extra: Dict[str, Any] = field(default_factory=dict)
    expert_steps: Dict[str, int] = field(default_factory=dict)


def _file(expert: str) -> str:
    return "expert-" + urllib.parse.quote(expert, safe="") + ".snap"


def save_job(directory: str, step: int, *, modules: Mapping[str, nn.Module] = {},
             optimizers: Mapping[str, torch.optim.Optimizer] = {}, experts: Sequence[Any] = (),
             extra: Optional[Dict[str, Any]] = None,
             secret: Optional[JobSecret] = None) -> str:
    """Saves the job at ``step`` (call it between two steps): ``modules`` and
    ``optimizers`` (by name), this process's random state, ``extra`` (numbers,
    strings, lists and dicts of them, tensors), and the state of every one
    of ``experts`` (:class:`~.client.RemoteExpert` or
    :class:`~.replicas.FleetExpert`, each named once); returns the
    checkpoint's path."""
    secret = resolve_secret(secret)
    names = [e.name for e in experts]
    if len(set(names)) != len(names):
        raise ValueError(f"save_job: experts named twice: {sorted(n for n in set(names) if names.count(n) > 1)}")
    states = {e.name: e.remote_snapshot() for e in experts}  # first: nothing written if one fails
    local = ExpertState({}, None, int(step), 0, {
        "modules": {k: m.state_dict() for k, m in modules.items()},
        "optimizers": {k: o.state_dict() for k, o in optimizers.items()},
        "rng": torch.get_rng_state(), "experts": names, "user": dict(extra or {})})
    os.makedirs(directory, exist_ok=True)
    final = os.path.join(directory, f"job-{int(step):012d}")
    building = os.path.join(directory, f".job-{int(step):012d}.tmp-{os.getpid()}")
    shutil.rmtree(building, ignore_errors=True)
    os.makedirs(building, mode=0o700)
    try:
        write_snapshot(os.path.join(building, "trainer.snap"), "trainer", local, secret)
        for name, state in states.items():
            write_snapshot(os.path.join(building, _file(name)), name, state, secret)
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(building, final)
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        shutil.rmtree(building, ignore_errors=True)
        raise
    for old in _checkpoints(directory)[KEEP_JOBS:]:
        shutil.rmtree(old[1], ignore_errors=True)
    _log.info("job saved at step %d: %s (%d remote experts)", step, final, len(states))
    return final


def _checkpoints(directory: str) -> List[Tuple[int, str]]:
    return numbered(directory, "job-")


def _read(path: str, secret: JobSecret) -> Tuple[ExpertState, Dict[str, ExpertState]]:
    name, local = read_snapshot(os.path.join(path, "trainer.snap"), secret)
    if name != "trainer":
        raise SnapshotError(path, f"its trainer.snap holds {name!r}", kind="malformed")
    experts = {}
    for expert in local.extra["experts"]:
        got, state = read_snapshot(os.path.join(path, _file(expert)), secret)
        if got != expert:
            raise SnapshotError(path, f"the file of expert {expert!r} holds {got!r}",
                                kind="malformed")
        experts[expert] = state
    return local, experts


def restore_job(directory: str, *, modules: Mapping[str, nn.Module] = {},
                optimizers: Mapping[str, torch.optim.Optimizer] = {},
                experts: Sequence[Any] = (), secret: Optional[JobSecret] = None
                ) -> Optional[JobState]:
    """Restores the newest complete checkpoint in ``directory`` (None if
    there is none): ``modules``, ``optimizers`` and this process's random
    state here, and each of ``experts`` (those saved, by name; every one must
    be there) on its server. Every file is checked before anything changes."""
    secret = resolve_secret(secret)
    for step, path in _checkpoints(directory):
        try:
            local, states = _read(path, secret)
        except SnapshotError as error:
            refuse(error.kind, f"job checkpoint {path}: {error} (the one before is tried)")
            continue
        except (OSError, KeyError, TypeError) as error:
            refuse("malformed", f"job checkpoint {path}: {type(error).__name__}: {error} (the "
                                "one before is tried)")
            continue
        saved = local.extra
        missing = sorted({e.name for e in experts} - set(states))
        if missing or set(modules) - set(saved["modules"]) or \
                set(optimizers) - set(saved["optimizers"]):
            raise KeyError(f"restore_job: {path} has no state for experts {missing}, modules "
                           f"{sorted(set(modules) - set(saved['modules']))} or optimizers "
                           f"{sorted(set(optimizers) - set(saved['optimizers']))}")
        for name, module in modules.items():
            module.load_state_dict(saved["modules"][name])
        for name, optimizer in optimizers.items():
            optimizer.load_state_dict(saved["optimizers"][name])
        torch.set_rng_state(saved["rng"])
        steps = {e.name: int(e.restore_remote(states[e.name])) for e in experts}
        _log.info("job restored from %s (step %d, %d remote experts)", path, step, len(steps))
        return JobState(local.steps, path, dict(saved["user"]), steps)
    return None

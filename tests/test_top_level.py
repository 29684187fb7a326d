"""The top-level API: every name in ``moe_autograd.__all__`` imports, is the
object its subpackage defines, and the layer's and remote experts' names are
loaded only when first used."""
import importlib

import pytest

import moe_autograd

DEFINED_IN = {
    "MixtureOfExperts": "moe_autograd.moe", "NotEnoughExperts": "moe_autograd.moe",
    "run_experts": "moe_autograd.moe", "grouped_experts": "moe_autograd.moe",
    "ExpertServer": "moe_autograd.remote",
    "RemoteExpert": "moe_autograd.remote", "RemoteExpertError": "moe_autograd.remote",
    "RemoteTimeoutError": "moe_autograd.remote", "RayExpertServer": "moe_autograd.remote",
    "RayTransport": "moe_autograd.remote", "RayFleet": "moe_autograd.remote",
    "RemoteAuthError": "moe_autograd.remote",
    "JobSecret": "moe_autograd.remote",
    "MissingSecretError": "moe_autograd.remote",
    "RayAuthError": "moe_autograd.remote",
    "Fleet": "moe_autograd.remote",
    "FleetExpert": "moe_autograd.remote",
    "ElasticServer": "moe_autograd.remote",
    "NoLiveReplica": "moe_autograd.remote",
    "Compression": "moe_autograd.remote",
    "ReplicaBalancer": "moe_autograd.remote", "ExpertState": "moe_autograd.remote",
    "JobState": "moe_autograd.remote", "save_job": "moe_autograd.remote",
    "restore_job": "moe_autograd.remote",
    "parallel_apply": "moe_autograd.parallel",
    "recompute_early": "moe_autograd.parallel",
    "map_with_parallel_backward": "moe_autograd.autograd",
    "EmulatedAutogradContext": "moe_autograd.autograd",
    "run_isolated_forward": "moe_autograd.autograd",
    "run_isolated_backward": "moe_autograd.autograd",
    "is_checkpointing": "moe_autograd.checkpoint", "is_recomputing": "moe_autograd.checkpoint",
    "execution_stats": "moe_autograd.policy", "ForeignGraphError": "moe_autograd.module_call",
}


def test_all_is_complete_and_unique():
    assert len(set(moe_autograd.__all__)) == len(moe_autograd.__all__)
    assert set(moe_autograd.__all__) == set(DEFINED_IN)
    assert set(moe_autograd.__all__) <= set(dir(moe_autograd))


@pytest.mark.parametrize("name", sorted(DEFINED_IN))
def test_every_name_imports_and_is_the_subpackages(name):
    namespace: dict = {}
    exec(f"from moe_autograd import {name}", namespace)
    assert namespace[name] is getattr(importlib.import_module(DEFINED_IN[name]), name)


def test_star_import_and_unknown_names():
    namespace: dict = {}
    exec("from moe_autograd import *", namespace)
    assert set(moe_autograd.__all__) <= set(namespace)
    with pytest.raises(AttributeError, match="no attribute 'MixtureOfExpert'"):
        moe_autograd.MixtureOfExpert  # noqa: B018
    with pytest.raises(ImportError):
        exec("from moe_autograd import NoSuchName", {})


def test_import_loads_the_runtime_only(run_python):
    out = run_python("""
        import sys
        import moe_autograd
        print(sorted(m for m in ("moe_autograd.moe", "moe_autograd.remote") if m in sys.modules))
        from moe_autograd import MixtureOfExperts, RemoteExpert
        print(sorted(m for m in ("moe_autograd.moe", "moe_autograd.remote") if m in sys.modules))
    """)
    assert out.splitlines() == ["[]", "['moe_autograd.moe', 'moe_autograd.remote']"]

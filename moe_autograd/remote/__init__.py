"""Remote experts: serve experts from other processes and machines.

Experts are served by :class:`ExpertServer` in any process of a
``torch.distributed.rpc`` world (TensorPipe), initialised the usual way with
``rpc.init_rpc(name, rank, world_size, rpc_backend_options=...)``, and called
through :class:`RemoteExpert`, an ``nn.Module`` wired into autograd. It works
alone, in :func:`moe_autograd.parallel_apply` (remote calls overlap in forward
and backward) and in :func:`moe_autograd.map_with_parallel_backward` (with
:class:`~moe_autograd.remote.client.RemoteCall`).

Data flows one way: this package uses the runtime (rng, checkpoint, phony);
nothing in the runtime imports it. The transport sits behind
:mod:`moe_autograd.remote.transport` (``call(worker, fn, args, timeout)``).

Backward strategies, per server: ``stateless`` (default; the client sends the
inputs back and the server recomputes under the same seed, so dropout masks
match) or ``stateful`` (the server keeps the graph by call id; freed at
backward, on the client's release, after ``state_ttl``, or past
``max_states``). Parameter gradients accumulate in the hosted modules' ``.grad``
on the server: train them with ``expert.zero_grad()`` / ``expert.step()``
(server-side optimizer) or ``ExpertServer(..., optimizer=..., auto_step=True)``.

Faults and trust (details in the README's remote section, with a table of
what each fault does to a ``MixtureOfExperts`` step): a server bounds whole
requests' bytes (every tensor however nested, :mod:`.sizes`), held states
(per client and in all) and their bytes; stateful call ids are 128 random
bits owned by the client's worker; parameter updates are all-or-nothing and
skip non-finite gradients. Deadlines accept ``None`` / ``math.inf`` (the
transport's ``rpc_timeout`` still applies) or positive seconds, enforced by
the client below the transport's millisecond too; a call its layer masks
ends with the layer's wait (no request is kept open past it); waits wake
every 0.1 s, so Ctrl-C reaches a waiting caller; at exit, requests still in
flight are settled so that the script exits with its own status. An RPC
world is one trust domain: any member can run any function in any other, so
deploy a world on a private network, one world per trust domain.

Two-machine recipe
------------------
Machine A (10.0.0.1) trains; machine B serves. Both can reach
``MASTER_ADDR:MASTER_PORT`` (on rank 0) and each other on any TCP port (set
``TP_SOCKET_IFNAME``/``GLOO_SOCKET_IFNAME`` to the interface to use if a
machine has several). Write an experts factory, importable on B::

    # my_experts.py
    import torch.nn as nn
    def make():
        return {f"ffn{i}": nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512))
                for i in range(4)}

On B (rank 1 of 2)::

    MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 \\
        python -m moe_autograd serve --experts my_experts:make \\
        --name server-b --rank 1 --world-size 2 --backward stateless

On A (rank 0), in the training script::

    import os, torch
    import torch.distributed.rpc as rpc
    from moe_autograd import parallel_apply
    from moe_autograd.remote import RemoteExpert

    os.environ.setdefault("MASTER_ADDR", "10.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    rpc.init_rpc("trainer", rank=0, world_size=2)
    experts = [RemoteExpert("server-b", f"ffn{i}", forward_timeout=30, backward_timeout=30)
               for i in range(4)]
    for step in range(100):
        for e in experts:
            e.zero_grad()
        xs = [torch.randn(64, 512, requires_grad=True) for _ in experts]
        outs = parallel_apply(experts, xs)        # 4 remote calls at once
        sum(o.square().mean() for o in outs).backward()   # 4 remote backwards at once
        ...  # e.g. experts[i].step() with a server-side optimizer
    rpc.shutdown()   # the server exits once every worker has shut down

The server also stops on SIGINT/SIGTERM (requests in flight get
``--drain-timeout`` seconds). Give each ``RemoteExpert`` deadlines in
production: a dead or unreachable server then fails the call with a
``RemoteExpertError`` (or ``RemoteTimeoutError``) that names worker and expert.

On one machine the same recipe runs on loopback (``MASTER_ADDR=127.0.0.1``);
pass ``--transports uv`` when server processes outnumber cores (TensorPipe's
same-host ``shm`` transport busy-polls). :mod:`moe_autograd.remote.loopback`
starts such worlds for tests and benchmarks (``moe_autograd.bench.remote``).

Engines (:mod:`moe_autograd.remote.transport`): torch RPC (the default) or
Ray (:mod:`moe_autograd.remote.ray_backend`, ``pip install moe_autograd[ray]``):
:class:`RayExpertServer` starts a server as a named Ray actor and
:class:`RayTransport` calls it; the engine is chosen by how the world was
started (``init_rpc`` or ``ray.init``) or explicitly (``transport=``,
:func:`set_transport`). See the README's "Choosing an engine".

Elastic mode (:mod:`moe_autograd.remote.fleet`): :meth:`Fleet.start` founds a
dynamic world (no ``world_size``); servers join and leave it while it runs
(:class:`ElasticServer`, ``python -m moe_autograd serve --join``), publish
their experts by name, and clients call :class:`FleetExpert`\\ s, which
resolve a name to a live replica per call (see the README's elastic section).
"""
from .client import RemoteCall, RemoteExpert, flush_releases
from .errors import RemoteExpertError, RemoteTimeoutError
from .fleet import ElasticServer, Fleet, FleetEvent, FleetExpert, NoLiveReplica
from .membership import MembershipError
from .ray_backend import RayExpertServer, RayTransport
from .ray_fleet import RayFleet
from .server import ExpertServer
from .transport import AutoTransport, RpcTransport, get_transport, set_transport

__all__ = ["ExpertServer", "RemoteExpert", "RemoteTimeoutError", "RemoteExpertError",
           "RemoteCall", "flush_releases", "Fleet", "FleetExpert", "FleetEvent", "ElasticServer",
           "NoLiveReplica", "MembershipError", "RayExpertServer", "RayTransport", "RayFleet", "RpcTransport",
           "AutoTransport", "get_transport", "set_transport"]

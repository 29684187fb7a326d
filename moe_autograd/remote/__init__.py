"""Remote experts: serve experts from other processes and machines, to one job.

Experts are served by :class:`ExpertServer` in a process of a
``torch.distributed.rpc`` world (TensorPipe) or in a Ray actor
(:class:`RayExpertServer`), and called through :class:`RemoteExpert`, an
``nn.Module`` wired into autograd. It works alone, in
:func:`moe_autograd.parallel_apply` (remote calls overlap in forward and
backward) and in :func:`moe_autograd.map_with_parallel_backward` (with
:class:`~moe_autograd.remote.client.RemoteCall`).

Trust model (the README's "Security" section says it in full): a *job* is a
trainer and the servers it admits; they share a :class:`JobSecret`
(``python -m moe_autograd secret``, read from ``MOE_AUTOGRAD_SECRET_FILE``).
Every request and reply is sealed with it (GMAC, a session and a
number against replays, :mod:`.auth`) and is a fixed schema of values and
raw tensor buffers (:mod:`.wire`): nothing our code receives is unpickled,
and a server runs only operations it registered on experts it hosts. A
message that fails is refused before its body is decoded, counted and
logged. The engines' own layers are trusted as their own documentation says:
torch RPC trusts every member of its world (so its worlds listen on
loopback unless an address is named, :mod:`.rpc_bind`), Ray every holder of
the cluster's token (so servers and clients refuse a Ray without token
authentication unless told otherwise, :mod:`.ray_engine`).

Layers, each importing only those below it (data flows one way: a client's
call goes down, through an engine, and up into a server's operation)::

    cli                                   python -m moe_autograd serve / secret
    fleet, elastic, ray_fleet, ray_server fleets and their servers, per engine,
    job                                   checkpoints of a whole job
    replicas                              calls by name
    mirrored, loopback                    training replicas kept one expert; local worlds
    client, batching                      RemoteExpert; one request per server and pass
    batch_server, server                  a server's operations (registered in endpoint)
    registry, membership, state, sizes,   the fleet's signed records; dynamic RPC worlds;
    execution, gather, deadlines,         held states; byte counts; running a call;
    stopping                              many trainers' calls batched into one
    channel | endpoint                    a client's sealed requests | a server's entry
    rpc_engine, ray_engine, rpc_bind      the engines (each registers itself)
    transport, durable, lineage           the seam: frames in, frames out; sealed states;
                                          the version of a training expert's state
    auth, wire, frame, factory, errors,   secrets and MACs; the body codec; the layout;
    compression                           fp16 / bf16 / int8 codecs of tensors
    balance                               which replica a fleet expert's call takes

Backward strategies, per server: ``stateless`` (default; the client sends the
inputs back and the server recomputes under the same seed, so dropout masks
match) or ``stateful`` (the server keeps the graph by call id; freed at
backward, on the client's release, after ``state_ttl``, or past
``max_states``). Parameter gradients accumulate in the hosted modules' ``.grad``
on the server: train them with ``expert.zero_grad()`` / ``expert.step()``
(server-side optimizer) or ``ExpertServer(..., optimizer=..., auto_step=True)``.

Compression (opt-in, :mod:`.compression`): ``RemoteExpert(..., compression="int8")``
(or ``"fp16"``, ``"bf16"``; a fleet's ``compression=`` for all its experts)
sends floating arguments and output gradients in that codec and gets outputs
and input gradients back in it; a compressed tensor is a descriptor and raw
buffers of the schema like any other. Without it, gradients are bit-equal to
local ones.
Many trainers per server: ``ExpertServer(..., batch_across_calls=True)``
(``serve --batch-across-calls``) runs the pending calls of many trainers
(sessions, jobs) to a row-wise expert as one call of their rows
(:mod:`.gather`; the README's "Many trainers per server").

Faults (details in the README's remote section, with a table of what each
fault does to a ``MixtureOfExperts`` step): a server bounds whole requests'
bytes (every tensor, as materialised, per call), held states (per client and
in all) and their bytes; stateful call ids are 128 random bits owned by the
client's authenticated session; parameter updates are all-or-nothing and
skip non-finite gradients. Deadlines accept ``None`` / ``math.inf`` (the
transport's timeout still applies) or positive seconds, enforced by the
client below the transport's millisecond too; a call its layer masks ends
with the layer's wait; waits wake every 0.1 s, so Ctrl-C reaches a waiting
caller; at exit, requests still in flight are settled so that the script
exits with its own status.

Two-machine recipe
------------------
Machine A (10.0.0.1) trains; machine B serves, on a private network (torch
RPC trusts every member of its world). Both can reach
``MASTER_ADDR:MASTER_PORT`` (on rank 0) and each other on any TCP port. Make
the job's secret once and copy it to B as you would an SSH key::

    python -m moe_autograd secret --out job.secret     # mode 600

Write an experts factory, importable on B::

    # my_experts.py
    import torch.nn as nn
    def make():
        return {f"ffn{i}": nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512))
                for i in range(4)}

On B (rank 1 of 2)::

    MOE_AUTOGRAD_SECRET_FILE=job.secret MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 \\
        python -m moe_autograd serve --experts my_experts:make \\
        --name server-b --rank 1 --world-size 2 --backward stateless

On A (rank 0), in the training script (run with
``MOE_AUTOGRAD_SECRET_FILE=job.secret``)::

    import torch
    import torch.distributed.rpc as rpc
    from moe_autograd import parallel_apply
    from moe_autograd.remote import RemoteExpert, start_rpc
    from moe_autograd.remote.rpc_bind import backend_options

    # the store and RPC listen on the interface facing 10.0.0.1 only
    start_rpc("trainer", 0, 2, backend_options("10.0.0.1", 29500))
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

Engines (:mod:`moe_autograd.remote.transport`): torch RPC (the default,
:mod:`.rpc_engine`) or Ray (:mod:`.ray_engine`, ``pip install -e
'.[ray]'``): :class:`RayExpertServer` starts a server as a named Ray
actor and :class:`RayTransport` calls it; the engine is chosen by how the
world was started (``init_rpc`` or ``ray.init``) or explicitly
(``transport=``, :func:`set_transport`). See the README's "Choosing an engine".

Elastic mode (:mod:`.fleet`, :mod:`.elastic`): :meth:`Fleet.start` founds a
dynamic world (no ``world_size``); servers join and leave it while it runs
(:class:`ElasticServer`, ``python -m moe_autograd serve --join``), publish
their experts by name (signed with the job's secret), and clients call
:class:`FleetExpert`\\ s, which resolve a name to a live, admitted replica
per call, chosen by measured latency and calls in flight
(:class:`ReplicaBalancer`, ``balance="latency"``, the default) or by age
(``balance="order"``; see the README's "Replica choice").
"""
from . import batch_server  # noqa: F401 - registers the "batch" and "collect" operations
from .auth import JobSecret, MissingSecretError, job_secret, security_stats, set_job_secret
from .balance import BALANCE_POLICIES, ReplicaBalancer
from .channel import call_operation
from .client import RemoteCall, RemoteExpert, flush_releases
from .compression import Compression
from .elastic import ElasticServer
from .endpoint import register_operation, unregister_operation
from .errors import RemoteAuthError, RemoteExpertError, RemoteTimeoutError
from .durable import ExpertState
from .fleet import Fleet
from .job import JobState, restore_job, save_job
from .membership import MembershipError
from .ray_engine import RayAuthError, RayTransport
from .ray_fleet import RayFleet
from .ray_server import RayExpertServer
from .replicas import FleetEvent, FleetExpert, NoLiveReplica
from .rpc_bind import start_rpc
from .rpc_engine import RpcTransport
from .server import ExpertServer
from .transport import AutoTransport, get_transport, set_transport

__all__ = ["ExpertServer", "RemoteExpert", "RemoteTimeoutError", "RemoteExpertError",
           "RemoteAuthError", "RemoteCall", "flush_releases", "Fleet", "FleetExpert",
           "FleetEvent", "ElasticServer", "NoLiveReplica", "MembershipError",
           "RayExpertServer", "RayTransport", "RayFleet", "RayAuthError", "RpcTransport",
           "AutoTransport", "get_transport", "set_transport", "JobSecret", "MissingSecretError",
           "job_secret", "set_job_secret", "security_stats", "register_operation",
           "unregister_operation", "call_operation", "start_rpc", "Compression",
           "ReplicaBalancer", "BALANCE_POLICIES", "ExpertState", "save_job", "restore_job",
           "JobState"]

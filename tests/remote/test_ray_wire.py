"""Tensors in the Ray backend's messages travel as NumPy arrays
(:mod:`moe_autograd.remote.ray_wire`): what arrives equals what was sent,
aliasing included, and what NumPy cannot carry exactly takes torch's pickling.
Packed messages (one ``bytes`` object, no cloudpickle) arrive as Ray's own
would; what cloudpickle might carry otherwise is refused and goes Ray's way;
a pass sends one packed message per server."""
import pickle
import threading
import types
from typing import Any, List

import pytest
import torch
from torch import nn

from moe_autograd.remote.ray_wire import _WireTensor, to_wire
from moe_autograd.remote.transport import TransportError

pytestmark = pytest.mark.timeout(30)


def _travel(value: Any) -> Any:
    return pickle.loads(pickle.dumps(to_wire(value), protocol=5))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64, torch.int64,
                                   torch.int8, torch.uint8, torch.bool, torch.complex64])
def test_values_dtype_shape_and_requires_grad_arrive(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    t = (torch.randn(3, 5) * 10).to(dtype)
    leaf = torch.randn(2, 2, dtype=torch.float64, requires_grad=True)
    scalar = torch.tensor(1.5)
    sent = ("ok", [(t, {"leaf": leaf}), scalar, None, "text"])
    wire = to_wire(sent)
    assert isinstance(wire[1][0][0], _WireTensor) and isinstance(wire[1][0][1]["leaf"], _WireTensor)
    got = _travel(sent)
    assert got[0] == "ok" and got[1][2:] == [None, "text"]
    for a, b in [(got[1][0][0], t), (got[1][0][1]["leaf"], leaf), (got[1][1], scalar)]:
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b.detach())
        assert a.requires_grad == b.requires_grad
    got[1][0][0].add_(1) if dtype != torch.bool else None  # writable memory of its own


def test_aliasing_is_what_torch_pickling_gives() -> None:
    base = torch.randn(4, 4)
    same, view = torch.randn(3), base[1]
    got = _travel([same, same, base, view])
    plain = pickle.loads(pickle.dumps([same, same, base, view], protocol=5))
    assert got[0] is got[1] and plain[0] is plain[1]  # one object twice: one tensor
    for received in (got, plain):  # a view and its base: two tensors of their own
        assert received[2].untyped_storage().data_ptr() != received[3].untyped_storage().data_ptr()
        assert torch.equal(received[3], view)


@pytest.mark.parametrize("make", [
    lambda: torch.randn(4, 3).t(),                          # transposed
    lambda: torch.ones(()).expand(32, 64),                  # an expanded gradient
    lambda: torch.randn(5, 6)[1:4, ::2],                    # a strided view with an offset
    lambda: torch.empty(0, 3),                              # no elements
])
def test_strides_arrive_and_only_the_elements_travel(make: Any) -> None:
    t = make()
    assert isinstance(to_wire((t,))[0], _WireTensor)
    got = _travel((t,))[0]
    assert got.shape == t.shape and got.stride() == t.stride() and torch.equal(got, t)
    assert got.untyped_storage().nbytes() <= t.untyped_storage().nbytes()


@pytest.mark.parametrize("make", [
    lambda: nn.Parameter(torch.randn(2)),                   # a subclass
    lambda: torch.randn(2, 2, dtype=torch.bfloat16),        # no NumPy dtype
    lambda: torch.randn(2, dtype=torch.complex64).conj(),   # a conjugate bit
    lambda: torch.randn(3).to_sparse(),                     # not strided
])
def test_what_numpy_cannot_carry_takes_torch_pickling(make: Any) -> None:
    t = make()
    assert to_wire((t,))[0] is t
    got = _travel((t,))[0]
    assert type(got) is type(t) and got.dtype == t.dtype and got.stride() == t.stride() \
        if t.layout == torch.strided else got.layout == t.layout


def test_a_read_only_array_is_copied() -> None:
    from moe_autograd.remote.ray_wire import _tensor_from_array

    array = torch.arange(4.0).numpy().copy()
    array.flags.writeable = False
    t = _tensor_from_array(array, (4,), (1,), False)
    t.add_(1)
    assert array.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_messages_without_eligible_tensors_are_returned_as_is() -> None:
    message = ("ok", [1, "a", {"b": None}])
    assert to_wire(message) is message


# -- packed messages: one bytes object through Ray instead of cloudpickle --------------------
def _same_tensor(got: Any, sent: torch.Tensor) -> None:
    assert type(got) is type(sent) and got.dtype == sent.dtype and got.shape == sent.shape
    assert got.stride() == sent.stride() and got.requires_grad == sent.requires_grad
    assert torch.equal(got.detach(), sent.detach())


@pytest.mark.parametrize("make", [
    lambda: torch.randn(32, 64, requires_grad=True),        # a call's input
    lambda: torch.randn(4, 3).t(),                          # transposed
    lambda: torch.ones(()).expand(32, 64),                  # an expanded gradient
    lambda: torch.randn(5, 6)[1:4, ::2],                    # a strided view with an offset
    lambda: torch.empty(0, 3),                              # no elements
    lambda: torch.tensor(2.5),                              # a scalar
    lambda: torch.arange(6).reshape(2, 3) > 2,              # bool
    lambda: torch.randn(3, dtype=torch.complex64),
    lambda: torch.randn(3).half(),
    lambda: torch.randint(0, 9, (4,), dtype=torch.uint8),
    lambda: nn.Parameter(torch.randn(2)),                   # torch's own pickling
    lambda: torch.randn(2, 2, dtype=torch.bfloat16),        # torch's own pickling
])
def test_a_packed_message_arrives_as_the_one_ray_would_carry(make: Any) -> None:
    from moe_autograd.remote.ray_wire import pack, unpack

    t = make()
    message = ("ok", [(t, {"again": t}), None, "text", 3, 1.5, [True]])
    got, ray_way = unpack(pack(message)), _travel(message)
    for received in (got, ray_way):
        assert received[0] == "ok" and received[1][1:] == [None, "text", 3, 1.5, [True]]
        _same_tensor(received[1][0][0], t)
        assert received[1][0][1]["again"] is received[1][0][0]  # one object twice: once
    if type(t) is torch.Tensor and t.dtype != torch.bfloat16:  # as a window of its storage
        storage = got[1][0][0].untyped_storage()
        assert storage.nbytes() <= t.untyped_storage().nbytes()
        before = t.detach().clone()
        storage.fill_(0)  # writable memory of its own
        assert torch.equal(t.detach(), before)


def test_a_packed_request_carries_functions_by_reference() -> None:
    import numpy as np

    from moe_autograd.remote.batch_server import serve_batch
    from moe_autograd.remote.ray_wire import pack, unpack

    x = torch.randn(3, 4, requires_grad=True)
    request = (serve_batch, ("ray-me", "b" * 32, [("forward", ("e", "ray-me", "c" * 32, 7, True,
                                                            [True], (x,)), 30.0)]))
    fn, args = unpack(pack(request))
    assert fn is serve_batch and args[:2] == ("ray-me", "b" * 32)
    _same_tensor(args[2][0][1][6][0], x)
    extras = (torch.float64, torch.device("cpu"), torch.Size([2, 3]), np.arange(3), np.float32)
    got = unpack(pack(extras))
    assert got[:3] == extras[:3] and got[3].tolist() == [0, 1, 2] and got[4] is np.float32


class _Local:
    pass


def _here() -> None:
    pass


@pytest.mark.parametrize("value", [
    _Local(),                                   # a class of this module (cloudpickle: by value if __main__)
    _here,                                      # a function of this module
    lambda: None,                               # a lambda
    threading.Lock(),                           # unpicklable
    torch.zeros(300_000),                       # more than PACKED_MAX_BYTES: out of band
], ids=["object", "function", "lambda", "lock", "big-tensor"])
def test_pack_refuses_what_must_travel_rays_way(value: Any) -> None:
    from moe_autograd.remote.ray_wire import NotPacked, pack

    with pytest.raises(NotPacked):
        pack(("ok", [value]))


def test_the_actor_replies_packed_or_as_one_tuple() -> None:
    """``run_packed`` replies ``bytes`` when the reply packs, else ``(value,)``,
    and the client reads both (``_RayPending``), tensors as they were."""
    from moe_autograd.remote.ray_backend import _ExpertActor, _RayPending
    from moe_autograd.remote.ray_wire import pack

    actor = _ExpertActor.__new__(_ExpertActor)
    t = torch.randn(3, 2).t()
    packed = actor.run_packed(pickle.dumps((torch.clone, (t,)), protocol=5))
    namespace = actor.run_packed(pickle.dumps((_namespace_of, (t,)), protocol=5))
    assert type(packed) is bytes and type(namespace) is tuple and len(namespace) == 1

    class Future:
        def __init__(self, value: Any) -> None:
            self.value = value

        def result(self) -> Any:
            return self.value

    for reply, read in ((packed, lambda v: v), (namespace, lambda v: v.tensor)):
        pending = _RayPending(None, "srv", None, True)  # type: ignore[arg-type]
        pending._on_reply(Future(reply))
        _same_tensor(read(pending.result(1.0)), t)
    pending = _RayPending(None, "srv", None, True)  # type: ignore[arg-type]
    pending._on_reply(Future(b"not a pickle"))
    with pytest.raises(TransportError, match="cannot be read"):
        pending.result(1.0)
    assert pack(("ok", t))  # what the actor packs, the client unpacks (above)


def _namespace_of(t: torch.Tensor) -> Any:
    return types.SimpleNamespace(tensor=t)  # a reply pack refuses


def test_a_pass_sends_one_packed_message_per_server(ray_world: Any) -> None:
    """Forward, and again backward: ONE message per server, a bytes object
    (no cloudpickle of requests), answered packed; the results equal local
    calls'. A message pack refuses still goes (Ray's own way)."""
    import remote_experts as rx

    from moe_autograd import parallel_apply
    from moe_autograd.remote import RemoteExpert
    from moe_autograd.remote.ray_backend import RayTransport

    class Recorded:
        def __init__(self, handle: Any, worker: str, log: List[Any], missing: List[str]) -> None:
            self.handle, self.worker, self.log, self.missing = handle, worker, log, missing

        def __getattr__(self, method: str) -> Any:
            if method in self.missing:
                raise AttributeError(method)
            remote = getattr(self.handle, method).remote
            log, worker = self.log, self.worker

            class Method:
                @staticmethod
                def remote(*args: Any) -> Any:
                    log.append((worker, method, [type(a).__name__ for a in args]))
                    return remote(*args)
            return Method

    class Recording(RayTransport):
        def __init__(self) -> None:
            super().__init__(timeout=30.0)
            self.log: List[Any] = []
            self.missing: List[str] = []  # methods the server "lacks" (an older version)

        def _handle(self, worker: str) -> Any:
            return Recorded(super()._handle(worker), worker, self.log, self.missing)

    t = Recording()
    experts = [RemoteExpert(w, name, transport=t) for w in ("srv-a", "srv-b")
               for name in ("lin", "sf_lin")]
    states = [e.remote_state_dict() for e in experts]
    t.log.clear()
    xs = [torch.randn(3, rx.WIDTH, requires_grad=True) for _ in experts]
    outs = parallel_apply(experts, xs)
    assert sorted(t.log) == [("srv-a", "run_packed", ["bytes"]), ("srv-b", "run_packed", ["bytes"])]
    t.log.clear()
    sum(o.square().sum() for o in outs).backward()
    assert sorted(t.log) == [("srv-a", "run_packed", ["bytes"]), ("srv-b", "run_packed", ["bytes"])]
    for k, (state, out, x) in enumerate(zip(states, outs, xs)):
        lin = nn.Linear(rx.WIDTH, rx.WIDTH)
        lin.load_state_dict(state)
        lx = x.detach().clone().requires_grad_()
        lout = lin(lx)
        lout.square().sum().backward()
        assert torch.equal(out.detach(), lout.detach()), k
        assert x.grad is not None and torch.equal(x.grad, lx.grad), k
    t.log.clear()
    assert t.call("srv-a", rx.kept_batches, (), 10.0).result(10.0) == 0  # a tests' function
    assert t.log == [("srv-a", "run", ["function", "tuple"])]
    t.log.clear()
    t.missing.append("run_packed")  # a server without run_packed: Ray's way, same result
    lin = nn.Linear(rx.WIDTH, rx.WIDTH)
    lin.load_state_dict(experts[0].remote_state_dict())
    x = torch.randn(3, rx.WIDTH)
    with torch.no_grad():
        assert torch.equal(experts[0](x), lin(x))
    assert len(t.log) == 2 and all(method == "run" for _, method, _ in t.log)

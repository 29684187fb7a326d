"""Batching across calls (moe_autograd.remote.gather): several trainers'
calls to one expert run as one kernel call, and each trainer still gets what
it would have got alone.

Concurrency is proven with counters (the server's ``batches`` and
``batched_calls``), never with timing: trainers are threads that meet at a
``threading.Barrier`` before each call, and the servers close a batch when
all the trainers' rows are there (``max_batch_rows``; the window is long
enough never to be what closes it).
"""
import threading
import time
from typing import Any, Callable, Iterator, List, Optional, Tuple

import pytest
import torch
from torch import Tensor, nn

import remote_experts as rx
from moe_autograd.remote import ExpertServer, RemoteExpert, RemoteExpertError
from moe_autograd.remote.cli import build_parser
from moe_autograd.remote.gather import Gatherer, NotRowWise, concat_rows, row_key, split_rows
from wiring import SECRET, Backend, InProcess

pytestmark = pytest.mark.timeout(60)

N, ROWS, WIDTH = rx.XB_TRAINERS, rx.XB_ROWS, rx.WIDTH
WINDOW = 30.0  # never what closes a batch: max_batch_rows = N * ROWS does
SECRET_B = rx.second_job(SECRET)


def trainers(body: Callable[[int, threading.Barrier], Any], n: int = N) -> List[Any]:
    """Runs ``body(k, barrier)`` in ``n`` threads; returns their results;
    raises the first error (a failing thread aborts the barrier)."""
    barrier = threading.Barrier(n, timeout=20.0)
    results: List[Any] = [None] * n
    errors: List[BaseException] = []

    def run(k: int) -> None:
        try:
            results[k] = body(k, barrier)
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)
            barrier.abort()
    threads = [threading.Thread(target=run, args=(k,), name=f"trainer-{k}") for k in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=40.0)
    assert not any(t.is_alive() for t in threads)
    if errors:
        raise errors[0]
    return results


@pytest.fixture
def serve() -> Iterator[Callable[..., ExpertServer]]:
    """Builds in-process servers (reached through ``InProcess``: the whole
    wire, no engine); closes them after the test."""
    made: List[ExpertServer] = []

    def make(experts: Any, **options: Any) -> ExpertServer:
        options.setdefault("batch_across_calls", True)
        options.setdefault("batch_window", WINDOW)
        options.setdefault("max_batch_rows", N * ROWS)
        made.append(ExpertServer(experts, secret=[SECRET, SECRET_B], **options))
        return made[-1]
    yield make
    for server in made:
        server.close()


def expert(name: str, k: int) -> RemoteExpert:
    """Trainer ``k``'s client: even trainers in the test job, odd in another."""
    return RemoteExpert("in-process", name, transport=InProcess(),
                        secret=SECRET if k % 2 == 0 else SECRET_B)


def batch_counts(server: ExpertServer) -> List[int]:
    stats = server.batch_stats()
    return [stats["batches"], stats["batched_calls"], stats["unbatched_calls"],
            stats["batch_fallbacks"]]


# -- keys and rows ------------------------------------------------------------------------
def key_of(*args: Any, **kwargs: Any) -> Any:
    found = row_key(*args, **kwargs)
    return None if found is None else found[0]


def test_row_key_groups_only_calls_that_can_share_a_kernel() -> None:
    x, y = torch.randn(3, 4), torch.randn(5, 4)
    assert key_of([x, 2.0], [True, False]) == key_of([y, 2.0], [True, False])
    assert row_key([x], [True]) == (key_of([x], [True]), 3)
    different = [([x.double()], [True]), ([x], [False]), ([torch.randn(3, 5)], [True]),
                 ([x, 3.0], [True, False]), ([x, 2], [True, False])]
    keys = {key_of(args, flags) for args, flags in different} | {key_of([x, 2.0], [True, False])}
    assert len(keys) == len(different) + 1
    assert key_of([x], [True], extra="forward") != key_of([x], [True], extra="backward")
    # run alone: no tensor, 0-dim or empty tensors, rows that differ, nested or flagged values
    for args, flags in [([2.0], [False]), ([torch.tensor(1.0)], [True]),
                        ([torch.randn(0, 4)], [True]), ([x, torch.randn(2, 4)], [True, True]),
                        ([x, [x]], [True, False]), ([x, 1.0], [True, True]), ([x], [1])]:
        assert row_key(args, flags) is None, (args, flags)
    grads_key = key_of([x], [True], [torch.randn(3, 2), None])
    assert grads_key is not None and grads_key != key_of([x], [True], [None, torch.randn(3, 2)])
    assert row_key([x], [True], [torch.randn(4, 2)]) is None  # not the call's rows


def test_rows_split_back_in_order_and_must_be_row_wise() -> None:
    calls = [[torch.full((k + 1, 2), float(k)), "same"] for k in range(3)]
    args = concat_rows(calls)
    assert args[1] == "same" and args[0].shape == (6, 2)
    parts = split_rows([args[0] * 2, None], [1, 2, 3], "output")
    for k, (value, none) in enumerate(parts):
        assert none is None and torch.equal(value, calls[k][0] * 2)
    with pytest.raises(NotRowWise, match=r"output 0 has shape \[1, 2\], not 6 rows"):
        split_rows([args[0].sum(0, keepdim=True)], [1, 2, 3], "output")


# -- one server in this process, trainers of two jobs -----------------------------------
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_trainers_get_what_they_would_get_alone(serve: Any, dtype: torch.dtype) -> None:
    module = rx.xb_mlp().to(dtype)
    local = rx.xb_mlp().to(dtype)
    server = serve({"gx_mlp": module})
    xs = [torch.randn(ROWS, WIDTH, dtype=dtype, requires_grad=True) for _ in range(N)]
    ws = [torch.randn(ROWS, WIDTH, dtype=dtype) for _ in range(N)]

    def body(k: int, barrier: threading.Barrier) -> Tensor:
        client = expert("gx_mlp", k)
        barrier.wait()
        y = client(xs[k])
        barrier.wait()
        (y * ws[k]).sum().backward()
        return y.detach()
    ys = trainers(body)
    assert batch_counts(server) == [2, 2 * N, 0, 0]  # one forward and one backward, N calls each
    # A batch sums its rows in one matmul, the loop call by call: equal up to
    # reassociation, which holds normwise (|a - b| <= rel |b|, Frobenius), not
    # elementwise (an entry near 0 is a sum that cancels). rel: a few units of
    # the dtype's rounding times the rows summed (measured 6e-7 in float32 at
    # width 256 with plain randn inputs, issue 46).
    rel = 1e-12 if dtype == torch.float64 else 1e-5
    for k in range(N):
        x = xs[k].detach().clone().requires_grad_()
        y = local(x)
        (y * ws[k]).sum().backward()
        assert_normwise_close(ys[k], y.detach(), rel, f"output of call {k}")
        assert_normwise_close(xs[k].grad, x.grad, rel, f"input gradient of call {k}")
    for (name, p), q in zip(module.named_parameters(), local.parameters()):
        assert_normwise_close(p.grad, q.grad, rel, name)  # the sum of the calls'


def assert_normwise_close(actual: Optional[Tensor], expected: Optional[Tensor], rel: float,
                          what: str) -> None:
    assert actual is not None and expected is not None, what
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, what
    error = float((actual - expected).double().norm())
    bound = rel * float(expected.double().norm())
    assert error <= bound, f"{what}: |a - b| = {error:.3g} > {rel} |b| = {bound:.3g}"


def test_batched_gradients_hold_the_normwise_bound_at_width_256() -> None:
    """The bound above at the width the red team drew (issue 46: elementwise
    ``rtol=1e-5, atol=1e-6`` failed on float32 parameter gradients there): the
    gatherer's concatenated rows against the calls one by one."""
    torch.manual_seed(0)
    layer = nn.Linear(256, 256)
    xs = [torch.randn(2, 256) for _ in range(N)]
    gs = [torch.randn(2, 256) for _ in range(N)]
    layer(concat_rows([[x] for x in xs])[0]).backward(torch.cat(gs))
    batched = [layer.weight.grad.clone(), layer.bias.grad.clone()]
    layer.zero_grad()
    for x, g in zip(xs, gs):
        layer(x).backward(g)
    for b, s, name in zip(batched, [layer.weight.grad, layer.bias.grad], ["weight", "bias"]):
        assert_normwise_close(b, s, 1e-5, name)


def test_each_trainer_gets_its_reply_in_its_own_codec(serve: Any) -> None:
    """Calls of trainers with different ``compression`` run as one batch;
    each reply (outputs, input gradients) travels in its own request's codec:
    raw, bf16, int8 (found merging compression with batching: the batch's
    replies went back raw)."""
    module = rx.xb_mlp().to(torch.float64)
    server = serve({"gx_mlp": module})
    codecs = ["none", "bf16", "int8", "none"][:N]
    xs = [torch.randn(ROWS, WIDTH, dtype=torch.float64, requires_grad=True) for _ in range(N)]

    def body(k: int, barrier: threading.Barrier) -> Tensor:
        client = expert("gx_mlp", k)
        client.compression = codecs[k]
        barrier.wait()
        y = client(xs[k])
        barrier.wait()
        y.sum().backward()
        return y.detach()
    ys = trainers(body)
    assert batch_counts(server)[:2] == [2, 2 * N]

    def on_int8_grid(t: Tensor) -> bool:  # every value a multiple of its block's scale
        flat = t.reshape(-1)
        for block in flat.split(64):
            scale = block.abs().max() / 127
            if scale > 0 and not torch.allclose(block / scale, (block / scale).round(),
                                                atol=1e-3):
                return False
        return True

    def on_bf16_grid(t: Tensor) -> bool:
        return bool(torch.equal(t.to(torch.bfloat16).to(t.dtype), t))
    for k, codec in enumerate(codecs):
        for got in (ys[k], xs[k].grad):
            assert got is not None
            assert on_bf16_grid(got) == (codec == "bf16"), (k, codec)
            assert on_int8_grid(got) == (codec == "int8"), (k, codec)


def test_a_failing_call_fails_alone(serve: Any) -> None:
    class Picky(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            if bool((x == 13).any()):
                raise ValueError("13 is unlucky")
            return x * 2

    server = serve({"gx_picky": Picky()})
    xs = [torch.full((ROWS, WIDTH), 13.0 if k == 1 else float(k)) for k in range(N)]

    def body(k: int, barrier: threading.Barrier) -> Any:
        client = expert("gx_picky", k)
        barrier.wait()
        try:
            return client(xs[k])
        except RemoteExpertError as error:
            return error
    out = trainers(body)
    assert isinstance(out[1], RemoteExpertError) and "13 is unlucky" in str(out[1])
    assert "'gx_picky'" in str(out[1])
    for k in (0, 2, 3):
        assert torch.equal(out[k], xs[k] * 2)  # the others' calls, each run alone
    assert batch_counts(server) == [0, 0, N, 1]


def test_experts_not_row_wise_in_shape_or_random_run_alone(serve: Any,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    class Total(nn.Module):  # one row per call: not row-wise
        def forward(self, x: Tensor) -> Tensor:
            return x.sum(0, keepdim=True)

    server = serve({"gx_total": Total(), "gx_drop": nn.Dropout(0.5)})
    xs = [torch.randn(ROWS, WIDTH) for _ in range(N)]

    def body(k: int, barrier: threading.Barrier) -> List[Tensor]:
        total, drop = expert("gx_total", k), expert("gx_drop", k)
        barrier.wait()
        a = total(xs[k])
        barrier.wait()
        b = drop(xs[k])
        barrier.wait()
        return [a, b, drop(xs[k])]  # a second round: the dropout expert runs alone at once
    out = trainers(body)
    for k in range(N):
        assert torch.equal(out[k][0], xs[k].sum(0, keepdim=True))
        for b in out[k][1:]:
            kept = b != 0
            assert torch.allclose(b[kept], 2 * xs[k][kept])  # each call's own mask, p = 0.5
    assert batch_counts(server) == [0, 0, 3 * N, 2], server.batch_stats()
    assert sum("no longer batched across calls" in r.getMessage()
               for r in caplog.records) == 2  # once per expert
    why = {name: expert(name, 0).remote_stats()["expert_batched_no_more"]
           for name in ("gx_total", "gx_drop")}
    assert "not row-wise" in why["gx_total"] and "random numbers" in why["gx_drop"], why


def test_batched_fallback_after_a_random_number_check_adds_no_gradient_twice(
        serve: Any) -> None:
    """A group of stateless backwards of a random expert (Linear, then
    Dropout) finds that it drew random numbers and runs each call alone:
    the expert's parameter gradients are the sum of the single calls', as
    on a server that never batches, and not that sum plus the group's
    (issue 46: a mutant that added the group's gradients before the check
    gave a weight gradient 1.77 x the single calls' sum)."""
    def make() -> nn.Module:
        torch.manual_seed(3)
        return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Dropout(0.5))
    batched = serve({"gx_rand": make()})
    alone = serve({"gx_rand_alone": make()}, batch_across_calls=False)
    xs = [torch.randn(ROWS, WIDTH) for _ in range(N)]
    gs = [torch.randn(ROWS, WIDTH) for _ in range(N)]

    def backward(client: RemoteExpert, k: int) -> List[Any]:
        call = client._new_call(seed=100 + k)  # a stateless backward needs no forward here
        call.flags = [True]
        return client._backward(call, [xs[k]], [gs[k]])

    def body(k: int, barrier: threading.Barrier) -> List[Any]:
        client = expert("gx_rand", k)
        barrier.wait()
        return backward(client, k)
    got = trainers(body)
    assert batch_counts(batched) == [0, 0, N, 1], batched.batch_stats()  # one group, fell back
    want = [backward(expert("gx_rand_alone", k), k) for k in range(N)]
    for k in range(N):
        assert torch.equal(got[k][0], want[k][0])  # each call's own mask, run alone
    grads, reference = expert("gx_rand", 0).remote_grads(), \
        expert("gx_rand_alone", 0).remote_grads()
    assert grads.keys() == reference.keys()
    for name in grads:  # (the sum's order may differ: the threads' order)
        torch.testing.assert_close(grads[name], reference[name], rtol=1e-6, atol=1e-6)
    del alone


def test_stateful_and_auto_step_servers(serve: Any) -> None:
    """A stateful server batches no-grad forwards only (a held graph is one
    call's); an auto-step server batches forwards, not backwards (one
    optimizer step per backward, as without batching)."""
    sgd = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    stateful = serve({"gx_sf": nn.Linear(WIDTH, WIDTH)}, backward="stateful")
    auto = serve({"gx_auto": nn.Linear(WIDTH, WIDTH)}, optimizer=sgd)
    xs = [torch.randn(ROWS, WIDTH, requires_grad=True) for _ in range(N)]

    def body(k: int, barrier: threading.Barrier) -> None:
        sf, au = expert("gx_sf", k), expert("gx_auto", k)
        barrier.wait()
        with torch.no_grad():
            sf(xs[k])
        barrier.wait()
        sf(xs[k]).sum().backward()
        barrier.wait()
        au(xs[k]).sum().backward()
    trainers(body)
    assert batch_counts(stateful) == [1, N, 2 * N, 0]  # grad forwards, backwards: alone
    assert stateful.stats()["live"] == 0
    assert batch_counts(auto) == [1, N, N, 0]  # the forward batched, each backward alone


def test_options_are_checked(serve: Any) -> None:
    server = serve({"gx_a": nn.Linear(2, 2), "gx_b": nn.Linear(2, 2)},
                   batch_across_calls=["gx_b"])
    assert server.stats()["batch_across_calls"] == ["gx_b"]
    with pytest.raises(ValueError, match=r"names experts \['nope'\]"):
        ExpertServer({"gx_c": nn.Linear(2, 2)}, batch_across_calls=["nope"])
    with pytest.raises(TypeError, match="batch_across_calls"):
        ExpertServer({"gx_c": nn.Linear(2, 2)}, batch_across_calls="gx_c")  # type: ignore[arg-type]
    for bad in (-1.0, float("nan"), 61.0):
        with pytest.raises(ValueError, match="batch_window"):
            ExpertServer({"gx_c": nn.Linear(2, 2)}, batch_window=bad)
    with pytest.raises(ValueError, match="max_batch_rows"):
        ExpertServer({"gx_c": nn.Linear(2, 2)}, max_batch_rows=0)
    args = build_parser().parse_args(["--experts", "m:f", "--batch-across-calls"])
    assert args.batch_across_calls is True and args.batch_window == 0.0
    args = build_parser().parse_args(["--experts", "m:f", "--batch-across-calls", "a,b",
                                      "--batch-window", "0.002", "--max-batch-rows", "64"])
    assert (args.batch_across_calls, args.batch_window, args.max_batch_rows) == (["a", "b"],
                                                                                 0.002, 64)
    assert build_parser().parse_args(["--experts", "m:f"]).batch_across_calls is False
    from moe_autograd.remote.ray_server import _server_parameters

    assert {"batch_across_calls", "batch_window", "max_batch_rows"} <= set(_server_parameters())


# -- both engines: the shared servers' xb_* experts -------------------------------------
@pytest.mark.parametrize("name", ["xb_int", "xb_mlp"])
def test_trainers_of_two_jobs_batched_on_both_engines(backend: Backend, name: str) -> None:
    """Four trainers (two jobs), float64: ``xb_int`` computes exactly (integer
    weights and data), so batched results are bit-equal to a local
    replica's; ``xb_mlp`` (random weights) within float64 rounding."""
    exact = name == "xb_int"
    clients = [backend.expert("srv-b", name, secret=SECRET if k % 2 == 0 else SECRET_B,
                              forward_timeout=40, backward_timeout=40) for k in range(N)]
    local = rx.xb_int() if exact else rx.xb_mlp()
    local.load_state_dict(clients[0].remote_state_dict())
    clients[0].zero_grad()
    before = clients[0].remote_stats()["expert_batches"]

    def data(*shape: int) -> Tensor:
        if exact:
            return torch.randint(-4, 5, shape).double()
        return torch.randn(*shape, dtype=torch.float64)
    xs = [data(ROWS, WIDTH).requires_grad_() for _ in range(N)]
    ws = [data(ROWS, WIDTH) for _ in range(N)]

    def body(k: int, barrier: threading.Barrier) -> Tensor:
        barrier.wait()
        y = clients[k](xs[k])
        barrier.wait()
        (y * ws[k]).sum().backward()
        return y.detach()
    ys = trainers(body)
    after = clients[1].remote_stats()["expert_batches"]  # the other job sees the same expert
    assert after["batches"] - before["batches"] == 2, (before, after)
    assert after["batched_calls"] - before["batched_calls"] == 2 * N
    check: Callable[[Tensor, Tensor], None] = (
        (lambda a, b: assert_equal(a, b)) if exact
        else (lambda a, b: torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)))
    for k in range(N):
        x = xs[k].detach().clone().requires_grad_()
        y = local(x)
        (y * ws[k]).sum().backward()
        check(ys[k], y.detach())
        check(xs[k].grad, x.grad)  # type: ignore[arg-type]
    remote = clients[0].remote_grads()
    for pname, p in local.named_parameters():
        check(remote[pname], p.grad)  # type: ignore[arg-type]


def assert_equal(a: Optional[Tensor], b: Optional[Tensor]) -> None:
    assert a is not None and b is not None
    assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (a, b)


# -- the gatherer alone -----------------------------------------------------------------
def test_gatherer_waits_only_for_callers_it_expects() -> None:
    """A lone caller never waits for the window (60 s here: waiting would
    time the test out); once callers A, B and C called a key together, its
    next group waits until all three are there (it cannot be smaller), while
    a ready group of another key runs meanwhile."""
    gatherer = Gatherer(window=60.0)
    sizes: List[Tuple[str, int]] = []

    def execute(tasks: List[Any]) -> None:
        sizes.append((tasks[0].key, len(tasks)))
        for task in tasks:
            task.finish(task.payload * 10)

    assert gatherer.run("k", 1, 1, execute, who="A") == 10 and sizes == [("k", 1)]
    started = threading.Event()

    def hold(tasks: List[Any]) -> None:  # the first group holds the expert...
        started.set()
        deadline = time.monotonic() + 20.0
        while len(gatherer._queue) < 3 and time.monotonic() < deadline:
            time.sleep(0.001)
        execute(tasks)

    def first(k: int, barrier: threading.Barrier) -> int:
        if k == 0:
            return gatherer.run("other", 1, k, hold, who="A")  # type: ignore[no-any-return]
        started.wait(20.0)  # ...while A, B and C queue for "k": one group
        return gatherer.run("k", 1, k, execute, who="ABC"[k - 1])  # type: ignore[no-any-return]
    assert trainers(first, 4) == [0, 10, 20, 30]
    assert sizes[1:] == [("other", 1), ("k", 3)], sizes

    def again(k: int, barrier: threading.Barrier) -> int:
        barrier.wait()
        return gatherer.run("k", 1, k, execute, who="ABC"[k])  # type: ignore[no-any-return]
    assert trainers(again, 3) == [0, 10, 20]
    assert sizes[3:] == [("k", 3)], sizes  # the first waited for the two others


def test_gatherer_runs_keys_that_wait_on_each_other() -> None:
    """A waits in key "a" for B, whose call waits in key "b" for A: one of
    them runs (their callers are queued, waiting gains nothing), then the
    other waits its window for the caller that is not coming, and forgets it."""
    gatherer = Gatherer(window=0.05)  # how long "b" waits for A, who is gone
    sizes: List[Tuple[str, int]] = []

    def execute(tasks: List[Any]) -> None:
        sizes.append((tasks[0].key, len(tasks)))
        for task in tasks:
            task.finish(None)

    now = time.monotonic()  # A and B called both keys lately
    gatherer._recent.update(a={"A": now, "B": now}, b={"A": now, "B": now})
    trainers(lambda k, barrier: (barrier.wait(), gatherer.run("ab"[k], 1, k, execute,
                                                              who="AB"[k])), 2)
    assert sorted(sizes) == [("a", 1), ("b", 1)]
    assert len(gatherer._recent["a"]) + len(gatherer._recent["b"]) <= 3  # who did not come


def test_gradient_hooks_keep_backwards_alone(serve: Any) -> None:
    """A batched backward computes parameter gradients, then accumulates
    them: a gradient hook would run twice, so such an expert's backwards run
    alone (its forwards are still batched), and each hook runs once per call."""
    module = nn.Linear(WIDTH, WIDTH)
    seen: List[int] = []
    module.weight.register_hook(lambda g: seen.append(1))
    server = serve({"gx_hooked": module})
    xs = [torch.randn(ROWS, WIDTH, requires_grad=True) for _ in range(N)]

    def body(k: int, barrier: threading.Barrier) -> None:
        client = expert("gx_hooked", k)
        barrier.wait()
        y = client(xs[k])
        barrier.wait()
        y.sum().backward()
    trainers(body)
    assert batch_counts(server) == [1, N, N, 0] and len(seen) == N


class _PickyGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:  # type: ignore[override]
        if bool((grad == 13).any()):
            raise ValueError("an unlucky gradient")
        return grad


class PickyGrad(nn.Module):
    """A Linear whose backward refuses a gradient holding 13."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH).double()

    def forward(self, x: Tensor) -> Tensor:
        return _PickyGrad.apply(self.lin(x))


def test_a_failing_backward_fails_alone_and_accumulates_once(serve: Any) -> None:
    module, local = PickyGrad(), PickyGrad()
    local.load_state_dict(module.state_dict())
    server = serve({"gx_picky_grad": module})
    xs = [torch.randn(ROWS, WIDTH, dtype=torch.float64, requires_grad=True) for _ in range(N)]
    ws = [torch.full((ROWS, WIDTH), 13.0 if k == 2 else k + 0.5, dtype=torch.float64)
          for k in range(N)]

    def body(k: int, barrier: threading.Barrier) -> Optional[Exception]:
        client = expert("gx_picky_grad", k)
        barrier.wait()
        y = client(xs[k])
        barrier.wait()
        try:
            (y * ws[k]).sum().backward()
        except RemoteExpertError as error:
            return error
        return None
    out = trainers(body)
    assert isinstance(out[2], RemoteExpertError) and "an unlucky gradient" in str(out[2])
    assert xs[2].grad is None and out[0] is out[1] is out[3] is None
    for k in (0, 1, 3):  # the others' gradients, each run alone; parameters' added once each
        x = xs[k].detach().clone().requires_grad_()
        (local(x) * ws[k]).sum().backward()
        torch.testing.assert_close(xs[k].grad, x.grad, rtol=1e-12, atol=1e-14)
    for p, q in zip(module.parameters(), local.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14)
    assert batch_counts(server) == [1, N, N, 1]  # the forward batched, the backward fell back


def test_gatherer_brings_callers_back_in_step() -> None:
    """A in forward ("f") and B in backward ("b") wait for each other: A's
    group runs (the oldest), holding the expert past B's window; B's call
    still gets a window from that group's end, in which A's backward comes:
    one group of two, the two callers in step again."""
    window = 1.0
    gatherer = Gatherer(window=window)
    now = time.monotonic()
    gatherer._recent.update(f={"A": now, "B": now}, b={"A": now, "B": now})
    sizes: List[Tuple[str, int]] = []

    def execute(tasks: List[Any]) -> None:
        sizes.append((tasks[0].key, len(tasks)))
        for task in tasks:
            task.finish(None)

    def slow(tasks: List[Any]) -> None:  # holds the expert until B's window ran out
        deadline = time.monotonic() + 20.0
        while len(gatherer._queue) < 1 and time.monotonic() < deadline:
            time.sleep(0.001)
        time.sleep(1.2 * window)
        execute(tasks)

    def body(k: int, barrier: threading.Barrier) -> None:
        if k == 0:
            gatherer.run("f", 1, None, slow, who="A")
            time.sleep(0.05)  # A's turn-around (a trainer's autograd, its next message)
            gatherer.run("b", 1, None, execute, who="A")
        else:
            deadline = time.monotonic() + 20.0
            while not gatherer._queue and time.monotonic() < deadline:  # A's "f" waits for B
                time.sleep(0.001)
            gatherer.run("b", 1, None, execute, who="B")
    trainers(body, 2)
    assert sizes == [("f", 1), ("b", 2)], sizes

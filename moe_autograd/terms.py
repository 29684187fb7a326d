"""A call's gradient *terms* for a tensor its graph reaches on several paths,
handed to the engine one by one, in the order a loop's backward adds them.

Why
---
The engine sums the gradient of a tensor term by term, as each node that
uses it runs: ``((c + t1) + t2) + ...``. A loop's backward adds the caller's
terms first (its nodes after the calls are the newest), then every term of
the last call, in the order its nodes run, then the call before, and so on.
A call run on a worker computes its gradients with one
``torch.autograd.grad`` over its own graph, which sums its terms first:
handing the engine ``t1 + t2`` gives ``c + (t1 + t2)``, not the loop's
``(c + t1) + t2``, and the last bits differ. That is ordinary code: an expert
that reads its input twice (SwiGLU's two projections, a residual) on an input
the caller also uses, or that several calls share.

How
---
After the forward, the walk that finds the call's leaves also counts the
edges into each leaf (:func:`count_edges`). A caller's tensor (or parameter)
reached on ``E >= 2`` edges, through one leaf or through several (the same
tensor passed twice), gets ``E`` slots among the call's inputs: its own, plus
copies of it appended after the call's other inputs. In backward, post hooks
on the nodes that own those edges record each term as the call's
``torch.autograd.grad`` produces it; the terms go to the slots in that
order, and the engine, which adds a node's input gradients in input order,
sums them as the loop does.

Invariants: a call whose every tensor has one edge has no split (nothing
here runs in its backward); a node the backward does not run (a branch with
no gradient) gives no term, and its slot gets None; more terms than edges
(never seen) fall back to the per-leaf sums for that tensor; the hooks live
only for the duration of one ``torch.autograd.grad``.
A checkpointed call counts its edges on its forward's graph (built with grad
on, nothing saved) and records its terms on its recomputation's:
:meth:`TermSplit.rebind` moves the split onto the recomputed graph's nodes
(the same computation; where it reaches a tensor on fewer edges, built
otherwise, those fill the first slots, and where on more than the slots or
on one, that tensor keeps the per-leaf sums).
"""
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

__all__ = ["TermSplit", "Edges", "ACCUMULATE_GRAD"]

#: ``id(leaf) -> [(node, input position of that node's gradient output)]``.
Edges = Dict[int, List[Tuple[Any, int]]]


def _accumulate_grad_type() -> type:
    leaf = torch.zeros(1, requires_grad=True)
    with torch.enable_grad():
        node = leaf.view(1).grad_fn
    assert node is not None
    return type(node.next_functions[0][0])


#: The node type that accumulates a leaf's gradient.
ACCUMULATE_GRAD = _accumulate_grad_type()


class _Group:
    __slots__ = ("slots", "edges", "targets", "terms", "summed")

    def __init__(self, slots: List[int], edges: List[Tuple[Any, int]],
                 targets: List[int]) -> None:
        #: Positions in the call's inputs that take this tensor's terms.
        self.slots = slots
        self.edges = edges
        #: Positions of the leaves (own slots) whose sums are the fallback.
        self.targets = targets
        self.terms: List[Optional[Tensor]] = []
        #: The fallback for good: its edges could not be found again.
        self.summed = False


class TermSplit:
    """The slots and the edges of a call's tensors that get several terms."""

    __slots__ = ("_groups", "_uses", "extras")

    def __init__(self, groups: List[_Group], extras: List[Tensor]) -> None:
        self._groups = groups
        #: Tensors to append to the call's inputs (one per extra slot).
        self.extras = extras
        self._uses: List[Tuple[Any, List[Tuple[int, _Group]]]] = []
        self._index()

    def _index(self) -> None:
        # Per node that owns such edges: its edges' positions (the engine adds
        # a node's gradients in input order) and the groups they feed.
        by_node: Dict[int, Tuple[Any, List[Tuple[int, _Group]]]] = {}
        for group in self._groups:
            for node, j in group.edges:
                by_node.setdefault(id(node), (node, []))[1].append((j, group))
        self._uses = [(node, sorted(uses, key=lambda use: use[0]))
                      for node, uses in by_node.values()]

    def rebind(self, leaves: Sequence[Tensor], edges: Edges) -> None:
        """Moves the split onto another graph of the same computation (a
        checkpointed call's recomputation): ``edges`` are that graph's, for
        the same ``leaves`` as :meth:`of` got. The graphs may differ in
        shape where the same computation is built otherwise (a nested batch
        fanned out in forward, and inline in the recomputation, reaches a
        tensor through its parallel node and its calls' gradient nodes, or
        through the calls' own nodes): fewer edges fill the first slots, the
        rest get None; a tensor with more edges than slots, or fewer than
        two, keeps the per-leaf sums."""
        for group in self._groups:
            found = [e for k in group.targets for e in edges.get(id(leaves[k]), ())]
            if 2 <= len(found) <= len(group.slots) and not group.summed:
                group.edges = found
            else:
                group.edges, group.summed = [], True
        self._index()

    @staticmethod
    def of(outer: Sequence[Tensor], leaves: Sequence[Tensor], edges: Edges) -> Optional["TermSplit"]:
        """``outer[k]`` is what the caller sees of ``leaves[k]`` (its tensor, or
        the parameter itself). None where no tensor has two edges."""
        by_tensor: Dict[int, List[int]] = {}
        for k, t in enumerate(outer):
            by_tensor.setdefault(id(t), []).append(k)
        groups: List[_Group] = []
        extras: List[Tensor] = []
        n = len(outer)
        for positions in by_tensor.values():
            found = [e for k in positions for e in edges.get(id(leaves[k]), ())]
            if len(found) < 2:
                continue
            # The engine runs a leaf's consumers in no order we can know here
            # (it depends on readiness); the hooks record the order it took.
            more = len(found) - len(positions)
            slots = list(positions) + list(range(n + len(extras), n + len(extras) + more))
            extras.extend([outer[positions[0]]] * more)
            groups.append(_Group(slots, found, list(positions)))
        return TermSplit(groups, extras) if groups else None

    @contextmanager
    def capture(self) -> Iterator[None]:
        """Records each group's terms while the call's backward runs."""
        for group in self._groups:
            group.terms = []
        handles = []
        for node, uses in self._uses:
            def record(grad_inputs: Tuple[Optional[Tensor], ...], _: Any,
                       uses: List[Tuple[int, _Group]] = uses) -> None:
                for j, group in uses:
                    group.terms.append(grad_inputs[j])
            handles.append(node.register_hook(record))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def apply(self, grads: List[Optional[Tensor]]) -> List[Optional[Tensor]]:
        """``grads`` (one per leaf, summed per leaf) with each split tensor's
        terms in its slots instead, extras appended."""
        out = list(grads) + [None] * len(self.extras)
        for group in self._groups:
            terms, group.terms = group.terms, []
            if group.summed or not terms or len(terms) > len(group.slots):
                continue  # keep the sums (extras None)
            for k in group.targets:
                out[k] = None
            slot = iter(group.slots)
            for term in terms:
                if term is not None:
                    out[next(slot)] = term
        return out

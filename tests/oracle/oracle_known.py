"""The oracle's two tables, keyed by construct (see ``oracle_cases.constructs``).

``RAISES_IS_CONTRACT``: constructs for which the runtime may raise a clear
error (naming the call: ``call i of n``) where the loop computes; a case that
has one of them passes if the runtime raises such an error. Anywhere else a
runtime error the loop does not raise is a divergence.

``KNOWN_DIVERGENCES``: divergences found and not fixed yet. An entry names
the constructs a case must have (``applies``) and where the divergence shows
(``steps``: the step of the record, ``kinds``: value / unexpected_error /
missing_error). A case it applies to that diverges *there* is xfailed; any
other divergence of that case still fails. For every entry a sentinel test,
``test_known_divergence_still_present[<name>]``, is ``xfail(strict=True)``:
it fails (as expected) while some case of the sample still shows the
divergence, and XPASSes (so fails, strict) once none does: then delete the
entry (and the ``xfail`` of its test in ``tests/test_regressions_oracle.py``).

Replay one case: ``pytest tests/oracle --fuzz-seed=S --fuzz-case=K``.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, FrozenSet, List, Optional, Tuple

from oracle_cases import Case, constructs
from oracle_harness import Divergence, Raised

#: Constructs for which "a clear error naming the call" is the contract.
RAISES_IS_CONTRACT: FrozenSet[str] = frozenset({
    # The caller's saved_tensors_hooks and an expert that changes in place a
    # tensor it saved (its input after a Linear saved it, an EMA teacher's
    # weights after its forward used them): the runtime packs
    # a call's saves once it returned, so it raises "a tensor it saved for
    # backward was modified in place later in the call" (was D46j: a copying
    # pack copied the changed values, silently).
    "caller:saved_hooks+saved_then_changed",
    # Tensors inside objects that are not pytrees: the runtime refuses them
    # ("the expert returned a SimpleNamespace holding tensors ...").
    "output:dataclass",
    "output:namespace",
    # Reentrant torch.utils.checkpoint inside an expert cannot run in the
    # call's backward (a torch.autograd.grad): "the expert uses
    # torch.utils.checkpoint(use_reentrant=True) ...".
    "stage:ckpt_reentrant",
    # An input of a checkpointed call modified in place after the call: the
    # recomputation cannot see the forward's values (the loop kept them as
    # saved activations, or raises): "an input of the checkpointed call was
    # modified in place after the call ...".
    "checkpoint+post:in_add_",
    # The same through an output that is the input (returned as is) and
    # modified in place by the caller.
    "checkpoint+post:out_mul_on_input",
    # The same, by the checkpointed expert itself (an in-place op on its input).
    "checkpoint+stage:input_inplace",
    # requires_grad_() by a checkpointed expert on an input that did not
    # require grad: "the checkpointed expert called requires_grad_() ..." (was D7b).
    "checkpoint+stage:requires_grad_",
    # requires_grad_() by an expert on an input a later call also receives:
    # "the expert called requires_grad_() on an input that call j of n also
    # receives ..." (was D7a).
    "requires_grad_+later_same_input",
    # A checkpointed expert whose forward changes a parameter in place (a
    # Parameter that does not require grad, a frozen EMA teacher's weights,
    # one that does), its own or one tied to other experts: "the checkpointed
    # expert modified one of its parameters in place in its forward ...", or
    # "a parameter ... of the checkpointed call was modified in place after
    # the call" (README's semantics table: a max-norm constraint; issue 46).
    "checkpoint+stage:drift_param",
    "checkpoint+stage:drift_param_rg",
    "checkpoint+stage:teacher",
    # A checkpointed expert that changes its weight through .data in forward
    # in a way its recomputation would repeat (a decay, not a clamp): "the
    # checkpointed expert changed its parameters in its forward where
    # autograd does not see it (through .data ...)" (issue 46, class 5).
    "checkpoint+stage:data_decay",
    # torch.autograd.functional.jvp / hvp over a batch: they differentiate the
    # batch's gradients (double backward), which the node refuses: "parallel_apply:
    # trying to differentiate twice ..." (names the batch; issue 30 item 4).
    "transform:jvp",
    "transform:hvp",
    # autograd.grad / backward(inputs=...) naming only tensors an expert kept
    # and computes further from: the call's own backward does not run, so their
    # part through the call's outputs is missing: "call i of n: the gradient of
    # the tensor the expert kept in 'keep' ..." (moe_autograd.kept).
    "keep:named_alone",
})


@dataclasses.dataclass(frozen=True)
class Known:
    """One known divergence: the cases it may show in, and where it shows."""
    name: str
    reason: str
    applies: Callable[[Case], bool]
    #: Steps of the record (the key without its ``itN.`` prefix) where it shows.
    steps: Tuple[str, ...]
    kinds: Tuple[str, ...] = ("value",)
    #: ``(seed, index)`` of cases that showed it, run by its sentinel besides
    #: the sample (a divergence may hide behind another in the sample's cases).
    witnesses: Tuple[Tuple[int, int], ...] = ()
    #: Shows in some runs only (it depends on the process's history): a run
    #: where no case shows it is not taken as its end.
    sometimes: bool = False
    #: Where set, the runtime's side must be an error whose text (message,
    #: notes, causes) contains it.
    runtime_text: Optional[str] = None
    #: The same for the loop's side.
    loop_text: Optional[str] = None

    def matches(self, case: Case, divergence: Divergence) -> bool:
        step = divergence.key.split(".", 1)[1] if divergence.key.startswith("it") \
            else divergence.key
        if self.runtime_text is not None and not (
                isinstance(divergence.runtime, Raised)
                and self.runtime_text in divergence.runtime.text):
            return False
        if self.loop_text is not None and not (
                isinstance(divergence.loop, Raised) and self.loop_text in divergence.loop.text):
            return False
        return self.applies(case) and divergence.kind in self.kinds and step in self.steps


def _all(*names: str) -> Callable[[Case], bool]:
    def applies(case: Case) -> bool:
        return set(names) <= constructs(case)
    return applies


def _any(*names: str) -> Callable[[Case], bool]:
    def applies(case: Case) -> bool:
        return bool(set(names) & constructs(case))
    return applies


#: Divergences not fixed yet. Keep them few and precise: a case may only be
#: xfailed by an entry whose constructs it has and whose step it diverges at.
KNOWN_DIVERGENCES: List[Known] = [
    Known("D3-checkpoint-input-modified-in-place",
          "checkpoint=True: the recomputation uses an input modified in place after the call "
          "(the loop raises, or keeps the old values)",
          lambda c: bool({"post:in_add_", "checkpoint+stage:input_inplace",
                          "checkpoint+post:out_mul_on_input"} & constructs(c))
          and _any_checkpointed(c),
          ("backward", "autograd_grad", "grads", "autograd_grad.values", "grads2",
           "after_step", "hooks"), ("value", "missing_error"),
          witnesses=((0, 877), (1795471345, 6636), (1795473307, 3722))),
    Known("D5-output-hook-partial-gradient",
          "a hook on an output that other outputs or self.aux are computed from runs before "
          "the call's backward and sees only its direct gradient (.grad, autograd.grad and "
          "backward(inputs=...) of it are the loop's since issue 30)",
          lambda c: "hook:out" in constructs(c) and bool(
              {"output:tuple", "output:list", "output:aux", "output:internal_views"}
              & constructs(c)), ("hooks",),
          witnesses=((0, 64), (0, 102), (0, 133))),
    Known("D5b-autograd-grad-of-kept-tensor-direct-part-only",
          "torch.autograd.grad naming a tensor an expert kept and computes further from "
          "(self.keep = h), together with the call's inputs or parameters: it captures that "
          "tensor's gradient before the node runs and returns its direct part only (the "
          "caller's use), not the part through the call's outputs (README's semantics "
          "table; .grad and backward(inputs=...) are the loop's)",
          lambda c: c.grad_method == "autograd_grad" and c.keep_named == "with_inputs"
          and c.keep_in_loss, ("autograd_grad.values",)),
    Known("D5c-autograd-grad-of-unused-kept-tensor-none",
          "a kept tensor the loss does not use, asked for with torch.autograd.grad("
          "allow_unused=True): an output of the node that no pass reaches, so None where "
          "the loop's is its gradient through the call's outputs",
          lambda c: c.grad_method == "autograd_grad" and c.keep_named is not None
          and not c.keep_in_loss, ("autograd_grad.values",),
          witnesses=((0, 960), (1795791825, 154), (1795791825, 546))),
    Known("D5c2-autograd-grad-of-unused-kept-tensor-before-a-reentrant-checkpoint",
          "D5c where the loop's path from the loss to the kept tensor runs through a "
          "use_reentrant=True torch.utils.checkpoint inside the expert: the loop's "
          "autograd.grad raises torch's 'incompatible with .grad()'; the node's output is "
          "reached by no pass, so the runtime gives None without running that checkpoint",
          lambda c: c.grad_method == "autograd_grad" and c.keep_named is not None
          and not c.keep_in_loss and any("ckpt_reentrant" in s.stages for s in c.calls),
          ("autograd_grad",), ("missing_error",),
          loop_text="When use_reentrant=True, torch.utils.checkpoint is incompatible",
          witnesses=((1796680548, 2358),)),
    Known("D7g-view-of-input-before-a-later-flip",
          "a call returns a view of its input and a later call calls requires_grad_() on "
          "that input: the loop's view was made before the flip (a leaf view, no grad_fn); "
          "the runtime replays the view after it (a non-leaf view)",
          lambda c: _all("stage:requires_grad_", "output:input_view", "same_input")(c),
          ("outputs", "relations", "post.outputs"),
          witnesses=((1795473307, 15648), (1795473307, 6403))),
    Known("D9b-backward-inputs-retained-grad-of-dirty-input",
          "backward(inputs=...) with retain_grad() on a map's output that is the caller's "
          "tensor marked dirty: the runtime fills its .grad, the loop's pruned backward "
          "does not (see D9)",
          lambda c: c.grad_method == "backward_inputs" and c.retain_grad
          and c.function == "FDirty", ("grads",),
          witnesses=((1795473307, 12941),)),
    Known("D7f-requires-grad-in-non-reentrant-frame",
          "x.requires_grad_() inside an expert on an input that did not require grad, in a "
          "non-reentrant checkpoint frame: the loop's recomputation raises CheckpointError "
          "(the flipped input saves other tensors the second time) where the runtime "
          "computes or meets another error first, or the other way round (the frame's "
          "recomputation runs the batch in another mode, which saves other tensors)",
          lambda c: _all("stage:requires_grad_", "x:leaf", "frame:ckpt_nonreentrant")(c)
          and c.grad_mode == "grad",
          ("backward", "autograd_grad", "grads", "autograd_grad.values", "after_step",
           "fail.outcome"),
          ("missing_error", "value", "unexpected_error"),
          witnesses=((0, 468), (1795676629, 824), (1795676629, 17619))),
    Known("D15-expert-in-place-on-non-leaf-input",
          "an in-place op of the expert on its non-leaf input raises 'a leaf Variable that "
          "requires grad is being used in an in-place operation' (the call sees a detached "
          "leaf); the loop computes",
          lambda c: any("input_inplace" in s.stages and s.x_kind == "nonleaf"
                        for s in c.calls),
          ("forward", "fail.outcome", "fail.names_call", "interrupt.outcome", "inputs",
           "outputs", "relations", "post.outputs", "grads",
           "autograd_grad.values", "input_versions", "post.versions", "backward", "hooks",
           "after_step"), ("value", "unexpected_error", "missing_error"),
          # (1795861263, 5156): that error comes before a later call's interruption
          witnesses=((0, 84), (0, 250), (0, 577), (1795861263, 5156))),
    Known("D19b-expert-sees-non-leaf-input-as-leaf",
          "a non-leaf input is seen by the expert as a leaf (is_leaf True, grad_fn None), "
          "also under no_grad / inference_mode where nothing needs isolating",
          lambda c: any("introspect" in s.stages and s.x_kind == "nonleaf" for s in c.calls),
          ("state", "after_step"),
          witnesses=((0, 152), (0, 204), (0, 269))),
    Known("D9-no-pruning",
          "backward(inputs=...) / autograd.grad(subset) run every call's whole backward: "
          "hooks fire and grads are retained on outputs the loop never reaches, errors of "
          "unneeded parts are raised",
          lambda c: c.grad_method in ("backward_inputs", "autograd_grad")
          and (bool({"hook:out", "retain_grad", "raise:backward", "stage:keep"} & constructs(c))
               or c.function is not None
               or any("input_inplace" in s.stages for s in c.calls)
               # (an expert's own non-reentrant checkpoint, recomputed in eval
               # mode after eval() between forward and backward: torch raises
               # CheckpointError there, in the part the loop prunes)
               or ("eval" in c.between
                   and any("ckpt_nonreentrant" in s.stages for s in c.calls))),
          ("hooks", "retained", "fail.outcome", "fn_log.backward", "backward", "kept_grads"),
          ("value", "unexpected_error"),
          witnesses=((0, 210), (0, 750), (0, 795), (1795676440, 1137))),
    Known("D9c-post-accumulate-hook-of-an-unreached-parameter",
          "a parameter that reaches only a call's outputs or kept tensors the pass does not "
          "reach (an identity output, the kept tensor outside the loss) is an input of the "
          "node: the engine runs its accumulator with None and its post-accumulate hooks "
          "fire, where the loop never reaches it",
          lambda c: "hook:post_acc" in constructs(c) and "stage:keep" in constructs(c)
          and not c.keep_in_loss, ("hooks",), ("value",),
          witnesses=((1795791825, 1462), (1795791825, 3177))),
    Known("D9d-tensor-hook-of-an-unreached-parameter-fires-with-none",
          "found by the oracle (seed 1796693227), not fixed (reported): as D9c, for a "
          "tensor hook (register_hook) of such a parameter: the runtime calls it with None "
          "(a hook that computes with its gradient raises), the loop never calls it",
          lambda c: "hook:param" in constructs(c)
          and bool({"stage:keep", "stage:keep_plain"} & constructs(c))
          and not c.keep_in_loss, ("hooks",), ("value",),
          witnesses=((1796693227, 376),)),
    Known("D10-inline-backward-error-unnamed",
          "mode=inline (or auto where the policy runs the batch inline): an expert's error "
          "in backward does not name the call",
          lambda c: "raise:backward" in constructs(c) and bool(
              {"mode:inline", "mode:auto"} & constructs(c)), ("fail.names_call",),
          witnesses=((0, 2), (0, 588), (1, 300))),
    Known("D12-returned-view-of-input-grad-bits",
          "a view of an input returned by the call, the input also used on other paths "
          "(inside the call, or by another call): the view's gradient term is added before "
          "the calls' terms (the view is replayed after every call's node), not where the "
          "loop's view node runs (last bits)",
          lambda c: any(s.output == "input_view" for s in c.calls) and (
              "same_input" in constructs(c)
              or any({"nested", "requires_grad_"} & set(s.stages) for s in c.calls)),
          ("grads", "autograd_grad.values", "grads2", "after_step"),
          witnesses=((1, 4), (1, 1675), (1, 1719))),
    Known("D21-backward-error-under-autocast-unnamed",
          "under autocast, an expert's error in backward does not name the call",
          _all("raise:backward", "frame:autocast"), ("fail.names_call",),
          witnesses=((1, 467), (1, 505), (1, 1788))),
    Known("D26-map-dirty-input-retain-grad-then-apply",
          "map_with_parallel_backward: a Function marking dirty the caller's tensor, with "
          "retain_grad() on the outputs; a later batch on that tensor raises PyTorch's "
          "internal assert 'out != nullptr' (variable.cpp:207) in Function.apply",
          lambda c: c.function == "FDirty" and c.retain_grad and c.iterations > 1,
          ("forward",), ("unexpected_error",),
          witnesses=((1795467467, 101), (1795467467, 9586)),
          sometimes=True),
    Known("D27-frame-not-recomputed-for-checkpointed-calls",
          "a non-reentrant checkpoint frame, checkpointed calls, and backward(inputs=...) / "
          "autograd.grad that needs only them: the runtime's checkpointed calls recompute "
          "themselves and pack nothing into the frame, so the frame never recomputes and "
          "never meets its own check (an input of the frame, here one that another call "
          "modified in place in its forward), which the loop's recomputation raises; the "
          "runtime's gradients are those of the loop's forward",
          lambda c: c.frame == "ckpt_nonreentrant" and _any_checkpointed(c)
          and c.grad_method in ("backward_inputs", "autograd_grad")
          and any("input_inplace" in s.stages for s in c.calls),
          ("backward", "autograd_grad"), ("missing_error",),
          witnesses=((1795680476, 2555),)),
    Known("D14-checkpoint-frame-around-stateful-calls",
          "a non-reentrant checkpoint frame around calls whose forward updates module state "
          "(BatchNorm, spectral_norm, a counter, self.aux, self.keep): the frame's "
          "recomputation stops "
          "early in the loop (at the last tensor it saved), but runs the runtime's batch "
          "whole (checkpoint=False) or not at all (checkpoint=True): buffers, attributes "
          "and gradients differ; with mixed checkpointing in parallel mode, the frame's "
          "recomputation can run a checkpointed call's forward while the runtime recomputes "
          "it on another worker, and the runtime's backward raises in some runs (seed "
          "1795803072 case 1392: not a witness, it shows in about half the runs)",
          lambda c: c.frame == "ckpt_nonreentrant" and c.grad_mode == "grad" and (any(
              st in s.stages or s.output == "aux" for s in c.calls
              for st in ("spectral_norm", "bn", "counter", "introspect", "keep", "keep_plain",
                         "threads", "mark", "step",
                         # issue 46's stages that change a tensor in forward
                         "drift_buffer", "drift_param", "drift_param_rg", "teacher",
                         "data_decay")) or c.shared_stage is not None),
          ("grads", "autograd_grad.values", "grads2", "after_step", "state", "outputs",
           "kept_grads", "backward"), ("value", "unexpected_error"),
          witnesses=((1, 313), (1, 2457), (7, 541), (1795467467, 4032), (1795467467, 17148),
                     (1795671127, 799), (1795671127, 7014), (1795791825, 2653),
                     (1796693443, 1563))),
]


#: Issue 46's known limits (README's semantics table, each with a strict
#: xfail in tests/), drawn by ``oracle_cases._issue46``.
KNOWN_DIVERGENCES += [
    Known("D46b2-caller-pack-hooks-inside-a-checkpoint-frame-bypassed",
          "the caller's own saved_tensors_hooks (a lossy bf16 round trip) entered inside a "
          "non-reentrant torch.utils.checkpoint frame, around checkpointed calls: the loop's "
          "saves go through the lossy pack both in the forward and in the frame's "
          "recomputation; the runtime's checkpointed calls replay the caller's hooks on "
          "their own recomputation (issue 46, class 6), but not the frame's rerun of them: "
          "their gradients are the lossless ones (README's semantics table)",
          lambda c: c.caller_ctx == "saved_hooks" and c.frame == "ckpt_nonreentrant"
          and _any_checkpointed(c),
          ("grads", "autograd_grad.values", "grads2", "after_step", "transform.values",
           "kept_grads", "retained", "hooks", "outputs", "loss.value"),
          witnesses=((1796695381, 2602),)),
    Known("D46k-subclass-compiled-stage-fails-in-the-loop",
          "a __torch_function__ subclass argument reaching a torch.compile'd (aot_eager) "
          "stage: the reference loop raises torch's TypeError 'Multiple dispatch failed for "
          "aten.mm.default' under its per-call random stream, where the runtime's sequential "
          "run of the same calls computes; whether it shows depends on what dynamo compiled "
          "earlier in the process (not analysed further)",
          lambda c: c.subclass and any(st.startswith("compiled_") for s in c.calls
                                       for st in s.stages),
          ("forward", "fail.outcome", "interrupt.outcome", "backward", "autograd_grad",
           "transform"),
          ("missing_error", "value"), loop_text="Multiple dispatch failed",
          witnesses=((1796695381, 17),), sometimes=True),
    Known("D46i-fallback-backward-error-unnamed",
          "under allow_mutation_on_saved_tensors() or disable_saved_tensors_hooks(), or "
          "with a tensor subclass argument, the calls run as the loop, on the caller: an "
          "expert's error in backward does not name the call (as D10's inline mode)",
          lambda c: (c.caller_ctx in ("allow_mutation", "disable_saved_hooks") or c.subclass)
          and "raise:backward" in constructs(c), ("fail.names_call",),
          witnesses=((1796693227, 2102),)),
    Known("D46c-shared-torch-nn-teacher-updated-in-forward",
          "an EMA teacher nn.Linear shared by distinct experts and updated in place in "
          "forward: a torch.nn module that only computes orders nothing, so in lanes/parallel "
          "its update races with the other calls' reads (README's semantics table, strict "
          "xfail in tests/test_module_state.py)",
          lambda c: "tied:teacher" in constructs(c) and c.mode in ("lanes", "parallel", "auto"),
          ("outputs", "state", "loss.value", "grads", "autograd_grad.values", "grads2",
           "after_step", "transform.values", "post.outputs", "kept_grads", "retained",
           "hooks"),
          sometimes=True,
          witnesses=((0, 132), (1796691663, 3002))),
]


def _any_checkpointed(case: Case) -> bool:
    return case.grad_mode == "grad" and any(case.checkpoint_of(i) for i in range(case.n))


def may_raise(case: Case) -> bool:
    return bool(RAISES_IS_CONTRACT & constructs(case))


def known_divergence(case: Case, divergence: Divergence) -> Optional[Known]:
    for known in KNOWN_DIVERGENCES:
        if known.matches(case, divergence):
            return known
    return None

"""Differentiation beyond first-order reverse mode: what every backend refuses, in one place.

Every backend gives exact first-order gradients (``backward()``, ``torch.autograd.grad``, ``gradcheck``, several
backwards over a retained graph).  Their backward passes run kernels that autograd does not record, and none
defines a forward-mode rule, so without a guard a second derivative or a tangent would be dropped without a word
(a zero term).  The backends' autograd pieces use the helpers below instead, so each of these raises a
``RuntimeError`` naming the backend:

* double backward: a second derivative through an attention call (``create_graph=True`` and then a backward
  through the gradients, ``torch.autograd.grad`` of a gradient, ``gradgradcheck``, Hessian-vector products).
  ``first_order_only`` wraps each backward: with ``create_graph=True`` its gradients hang from a node that raises
  when a second derivative reaches it, so a graph built with ``create_graph=True`` whose second backward never
  passes through an attention call still works;
* forward-mode AD: ``torch.autograd.forward_ad`` dual tensors and ``torch.func.jvp`` / ``jacfwd`` / ``hessian``
  (``check_call`` at the call, ``refuse_jvp`` as the ``jvp`` of each ``autograd.Function``);
* ``torch.func`` transforms a backend does not list in its ``functorch_transforms`` (``check_call``): ``fused``
  serves ``vmap`` (its registered custom op, run per batch element); no backend serves ``torch.func.grad`` /
  ``vjp`` / ``jacrev``.

The call-time checks are skipped while ``torch.compile`` traces (the compiled graph calls the registered ops, and
aot_autograd refuses a double backward through a compiled graph itself).
"""
from __future__ import annotations

import functools

import torch
import torch.autograd.forward_ad as _forward_ad
from torch._C import _functions

__all__ = ["check_call", "first_order_only", "refuse_forward_ad", "refuse_jvp", "double_backward_message",
           "forward_ad_message"]

# torch.func transform kinds (``torch._C._functorch.TransformType`` names, lower case) and what a user calls them
_TRANSFORM_NAMES = {
    "grad": "torch.func.grad / vjp / jacrev (reverse mode under torch.func)",
    "vmap": "torch.func.vmap",
}


def double_backward_message(who: str) -> str:
    return (f"{who}: double backward (create_graph=True followed by a backward through the gradients, or "
            f"torch.autograd.grad of a gradient) is not supported: the backward runs kernels that autograd does not "
            f"record, so second derivatives through neighborhood attention are not available from any backend. "
            f"First-order gradients are exact (backward without create_graph=True).")


def forward_ad_message(who: str) -> str:
    return (f"{who}: forward-mode AD (torch.func.jvp / jacfwd / hessian, torch.autograd.forward_ad dual tensors) is "
            f"not supported: no backend defines a tangent rule for neighborhood attention. Use reverse mode "
            f"(backward / torch.autograd.grad).")


def transform_message(who: str, transform: str) -> str:
    return (f"{who}: {_TRANSFORM_NAMES.get(transform, 'torch.func.' + transform)} is not supported; call the "
            f"attention outside the transform (reverse mode: backward / torch.autograd.grad; batches: a batch "
            f"axis or a loop).")


def _has_tangent(t) -> bool:
    return isinstance(t, torch.Tensor) and _forward_ad.unpack_dual(t).tangent is not None


def refuse_forward_ad(who: str, tensors) -> None:
    """Raises where one of ``tensors`` is a dual tensor of the current ``torch.autograd.forward_ad`` level."""
    if _forward_ad._current_level >= 0 and any(_has_tangent(t) for t in tensors):
        raise RuntimeError(forward_ad_message(who))


def check_call(who: str, tensors, functorch_transforms=()) -> None:
    """Refuses, before anything runs, a call that would be differentiated in forward mode (dual ``tensors``, or
    an active ``torch.func.jvp``) or run under a ``torch.func`` transform not in ``functorch_transforms``
    (``"vmap"``, ``"grad"``).  Two flag reads on the common path; skipped while ``torch.compile`` traces."""
    if torch.compiler.is_compiling():
        return
    if torch._C._are_functorch_transforms_active():
        from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

        for interpreter in retrieve_all_functorch_interpreters():
            kind = interpreter.key().name.lower()
            if kind == "jvp":
                raise RuntimeError(forward_ad_message(who))
            if kind in _TRANSFORM_NAMES and kind not in functorch_transforms:
                raise RuntimeError(transform_message(who, kind))
    refuse_forward_ad(who, tensors)


def refuse_jvp(who: str):
    """A ``jvp`` staticmethod for an ``autograd.Function``: forward-mode AD raises ``forward_ad_message``."""

    def jvp(ctx, *tangents):
        raise RuntimeError(forward_ad_message(who))

    return staticmethod(jvp)


def first_order_only(who: str):
    """Decorates a backward (an ``autograd.Function``'s, or a formula given to ``torch.library.register_autograd``),
    ``backward(ctx, *grads)``, whose own operations autograd must not be asked to differentiate.

    Without ``create_graph`` it is called as it is.  With it, it runs under ``no_grad`` and its gradients are tied
    to everything they depend on (the saved tensors and incoming gradients that require grad) through a node
    that raises ``double_backward_message(who)`` when a second derivative reaches it.  Unlike
    ``torch.autograd.function.once_differentiable``, which ties them to the incoming gradients only, this also
    catches second derivatives with respect to the attention's own inputs (``torch.autograd.grad(dq.sum(), q)``),
    which would otherwise be dropped or reported as an input "not used in the graph"."""
    message = double_backward_message(who)

    def decorate(backward):
        @functools.wraps(backward)
        def wrapper(ctx, *grads):
            if not torch.is_grad_enabled():  # create_graph=False: nothing will differentiate the gradients
                return backward(ctx, *grads)
            # (unpacked before the backward runs: gemm's writes dS over its saved logits)
            sources = [t for t in (*ctx.saved_tensors, *grads) if isinstance(t, torch.Tensor) and t.requires_grad]
            with torch.no_grad():
                result = backward(ctx, *grads)
            return _tie_to_error(result, sources, message)

        return wrapper

    return decorate


def _tie_to_error(result, sources, message: str):
    """``result`` (a tensor or a tuple holding tensors / None) with each tensor replaced by an alias whose grad_fn
    raises ``message``, its next edges ``sources``."""
    single = not isinstance(result, tuple)
    values = [result] if single else list(result)
    slots = [i for i, t in enumerate(values) if isinstance(t, torch.Tensor)]
    if not slots or not sources:  # nothing upstream requires grad: the gradients are constants
        return result
    tied = _functions.DelayedError(message, len(slots) + len(sources))(*(values[i] for i in slots), *sources)
    for i, t in zip(slots, tied):
        values[i] = t
    return values[0] if single else tuple(values)

"""Differentiation beyond first-order reverse mode, for every backend, in one place.

The backends' kernels compute the attention and its first-order gradient; autograd does not record what runs inside
them.  Everything beyond that comes from two exact compositions that autograd differentiates to any order:
``reference_attention`` (plain tensor ops, the naive backend's gather form: constant index tables, per-chunk
gathers, ``einsum``; ``torch.func`` transforms it too) and ``recompute_attention`` (the gemm backend's operators,
each differentiable through the others, so no gathered rows are held):

* forward-mode AD (``torch.func.jvp`` / ``jacfwd`` / ``hessian``, ``torch.autograd.forward_ad`` dual tensors) and
  the ``torch.func`` transforms (``grad``, ``vjp``, ``jacrev``, ``vmap``): a call made while one is active runs
  ``reference_attention`` instead of the backend's kernels (``reference_reason`` says why, and the choice goes to
  the ``ops.backends`` debug log), except the transforms a backend lists in ``functorch_transforms`` (``fused``
  serves ``vmap`` with its registered op, per batch element, and forward mode on its own with a tangent kernel,
  ``ops/fused/jvp.py``).  Forward mode keeps no graph, so the chunks bound the reference's memory as they bound
  the naive forward's;
* double backward (``create_graph=True`` followed by a backward through the gradients, ``torch.autograd.grad`` of
  a gradient, ``gradgradcheck``, gradient penalties, Hessian-vector products): ``second_order`` wraps each
  backend's backward.  Without ``create_graph`` the backend's kernels run as always; with it, the attention is
  recomputed from the saved inputs with ``recompute_attention`` (the gemm backend's three operators, whose gradients
  are each other, so autograd differentiates them through the same kernels to any order) and differentiated with
  ``create_graph=True``, so the gradients carry every second-order term.  That graph holds the
  ``[B, N, H, prod(K)]`` weights, never an ``N x N`` matrix nor the neighbors' gathered rows.

The call-time routing is skipped while ``torch.compile`` traces (the compiled graph calls the registered ops, and
aot_autograd refuses a double backward through a compiled graph itself).

``ops.unfused``'s weight operators (``na_qk`` / ``na_av``) follow the same rules: forward mode and the transforms
run their plain forms (``ops.naive.plain_qk`` / ``plain_av``), a backward with ``create_graph=True`` recomputes
through the gemm operators.
"""
from __future__ import annotations

import functools

import torch
import torch.autograd.forward_ad as _forward_ad

__all__ = ["reference_attention", "recompute_attention", "recompute_with", "saved_inputs", "reference_reason",
           "forward_mode", "recomputed_gradients", "second_order", "REFERENCE", "refuse_forward_ad"]

# torch.func transform kinds (``torch._C._functorch.TransformType`` names, lower case) and what a user calls them
_TRANSFORM_NAMES = {
    "grad": "torch.func.grad / vjp / jacrev (reverse mode under torch.func)",
    "vmap": "torch.func.vmap",
    "jvp": "torch.func.jvp / jacfwd / hessian (forward mode)",
}


def reference_attention(q, k, v, params, rpb, scale):
    """``(out, lse)`` of heads-last inputs as plain tensor ops (the naive backend's traced form): what forward mode
    and the ``torch.func`` transforms differentiate where a backend's kernels do not serve them."""
    from .backends import load_backend  # (ops.naive imports this module)

    return load_backend("naive").traced_attention(q, k, v, params, rpb, scale)


def recompute_attention(q, k, v, params, rpb, scale):
    """``(out, lse)`` of heads-last (or flat ``[B, N, H, D]``) inputs from the gemm backend's operators, each
    differentiable to any order (``ops.gemm.autograd.differentiable_attention``): what ``second_order`` differentiates
    with ``create_graph=True``.  It holds the ``[B, N, H, prod(K)]`` weights, not the neighbors' gathered rows."""
    from .backends import run_on_token_rows
    from .gemm.autograd import differentiable_attention

    return run_on_token_rows(differentiable_attention, q, k, v, rpb, params, scale)


def recompute_with(params, scale):
    """``attend(q, k, v, rpb) -> (out, lse)``: ``recompute_attention`` for one problem, as ``second_order`` takes it."""
    return functools.partial(_recompute, params, scale)


def _recompute(params, scale, q, k, v, rpb):
    return recompute_attention(q, k, v, params, rpb, scale)


def saved_inputs(ctx):
    """``second_order``'s ``inputs`` for a Function that saved ``(q, k, v, rpb, ...)`` first and keeps
    ``ctx.params`` and ``ctx.scale``."""
    return ctx.saved_tensors[:4], recompute_with(ctx.params, ctx.scale)


class _Reference:
    """The stand-in backend of calls routed to ``reference_attention`` (the call sites treat it as any backend)."""

    name = "reference"

    def unsupported(self, problem) -> str | None:
        return None

    def attention(self, q, k, v, params, rpb, scale, need_lse=True):
        return reference_attention(q, k, v, params, rpb, scale)


REFERENCE = _Reference()


def _has_tangent(t) -> bool:
    return isinstance(t, torch.Tensor) and _forward_ad.unpack_dual(t).tangent is not None


def _dual(tensors) -> bool:
    """Whether one of ``tensors`` is a dual tensor of the current ``torch.autograd.forward_ad`` level."""
    return _forward_ad._current_level >= 0 and any(_has_tangent(t) for t in tensors)


def _active_transforms() -> list[str]:
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    return [interpreter.key().name.lower() for interpreter in retrieve_all_functorch_interpreters()]


def forward_mode(tensors) -> bool:
    """Whether a call on ``tensors`` is differentiated in forward mode: a ``torch.func.jvp`` (``jacfwd``,
    ``hessian``) is active, or one of them is a dual tensor of the current ``torch.autograd.forward_ad`` level."""
    if torch._C._are_functorch_transforms_active() and "jvp" in _active_transforms():
        return True
    return _dual(tensors)


def reference_reason(tensors, functorch_transforms=()) -> str | None:
    """Why a call on ``tensors`` must run ``reference_attention`` rather than a backend whose kernels serve the
    ``torch.func`` transforms ``functorch_transforms`` (each on its own: ``"vmap"``, ``"jvp"``, where ``"jvp"``
    also stands for dual tensors); None for an ordinary call (two flag reads)."""
    if torch.compiler.is_compiling():
        return None
    if torch._C._are_functorch_transforms_active():
        kinds = _active_transforms()
        for kind in kinds:
            if kind not in functorch_transforms:
                return f"{_TRANSFORM_NAMES.get(kind, 'torch.func.' + kind)} is active"
        if len(set(kinds)) > 1:
            return f"nested torch.func transforms ({', '.join(kinds)})"
        if "jvp" not in kinds and _dual(tensors):
            return "dual tensors under a torch.func transform"
    if "jvp" not in functorch_transforms and _dual(tensors):
        return "an input is a forward-mode dual tensor (torch.autograd.forward_ad)"
    return None


def second_order(inputs):
    """Decorates a backward ``backward(ctx, d_out, d_lse)`` (an ``autograd.Function``'s, or a formula given to
    ``torch.library.register_autograd``) of an attention ``(out, lse)``.

    ``inputs(ctx) -> (tensors, attend)``: the Function's inputs in argument order (None where an argument is not a
    tensor, or no tensor was given) and ``attend(*tensors) -> (out, lse)``, differentiable to any order.  Without
    ``create_graph`` the backward runs as it is; with it, the gradients come from differentiating ``attend``
    recomputed on the saved inputs, with ``create_graph=True`` (module docstring)."""

    def decorate(backward):
        @functools.wraps(backward)
        def wrapper(ctx, *grads):
            if not torch.is_grad_enabled():  # create_graph=False: nothing will differentiate the gradients
                return backward(ctx, *grads)
            tensors, attend = inputs(ctx)
            return recomputed_gradients(ctx.needs_input_grad, tensors, attend, grads)

        return wrapper

    return decorate


def recomputed_gradients(needs_input_grad, tensors, attend, grads):
    """Gradients of ``attend(*tensors)`` (a tuple of outputs) for the incoming ``grads``, with ``create_graph=True``,
    in the slots ``needs_input_grad`` asks for: the backward of a node whose own kernels autograd cannot
    differentiate."""
    wanted = [i for i, t in enumerate(tensors) if t is not None and needs_input_grad[i] and t.requires_grad]
    result = [None] * len(needs_input_grad)
    if not wanted:
        return tuple(result)
    # one alias per argument: a tensor passed twice (k and v both x) gets each role's gradient in its own slot
    tensors = [None if t is None else t.view_as(t) for t in tensors]
    outputs = attend(*tensors)
    pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None and o is not None]
    if not pairs:
        return tuple(result)
    computed = torch.autograd.grad([o for o, _ in pairs], [tensors[i] for i in wanted], [g for _, g in pairs],
                                   create_graph=True, allow_unused=True)
    for i, g in zip(wanted, computed):
        result[i] = g if g is not None else torch.zeros_like(tensors[i])
    return tuple(result)


def forward_ad_message(who: str) -> str:
    return (f"{who}: forward-mode AD reached a kernel without a tangent rule (a direct call of a registered op); "
            f"call ops.na1d / na2d / na3d, which serve forward mode.")


def refuse_forward_ad(who: str, tensors) -> None:
    """Raises where one of ``tensors`` is a dual tensor of the current ``torch.autograd.forward_ad`` level: a guard
    for kernels without a tangent rule, reached only by calls that bypass ``ops.functional``'s routing."""
    if _dual(tensors):
        raise RuntimeError(forward_ad_message(who))

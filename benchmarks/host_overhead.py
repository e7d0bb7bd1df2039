"""Host (Python) time per NA call on the GPU, layer by layer of the fused path, beside SDPA.

    python benchmarks/host_overhead.py [--calls 300]

With batch 1 the kernels take a few microseconds, so the wall time of a long run of calls (one
synchronisation at the end) is the host's time per call.  Rows: the public ``ops.na2d`` call, the
host side of the fused backend (``launch.forward``), a bare Triton launch of the forward kernel with
prepared arguments, ``scaled_dot_product_attention`` and one ``torch.add`` for scale; then a whole
NAT-Tiny forward at batch 1 (fused vs its dense-SDPA twin).
"""
import argparse
import time

import torch
import torch.nn.functional as F

import ops
from ops.fused import decide, launch
from ops.functional import make_params


def per_call_us(fn, calls):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--dump-triton", default=None, help="write the installed Triton's launch path source here")
    args = ap.parse_args()
    if args.dump_triton:  # what a launch costs depends on this version's JITFunction.run
        import inspect

        import triton.compiler.compiler as tc
        from triton.runtime import jit

        with open(args.dump_triton, "w") as f:
            f.write(inspect.getsource(jit.JITFunction.run) + "\n" + inspect.getsource(tc.CompiledKernel))
    B, H, D = 1, 8, 32
    x = torch.randn(B, 14, 14, 3, H, D, device="cuda", dtype=torch.bfloat16)
    q, k, v = x.unbind(-3)  # strided views, as a model's qkv projection gives them
    rpb = torch.randn(H, 13, 13, device="cuda")
    params = make_params((14, 14), 7)
    launch.forward(q, k, v, rpb, params, D ** -0.5)
    (plan,) = decide.plans("forward")  # the bare launch: the plan's kernel with this call's arguments prepared
    q4, k4, v4 = (launch._tokens(t, plan.tokens) if plan.as_tokens else t for t in (q, k, v))
    out = torch.empty(plan.out_shape, dtype=q.dtype, device="cuda")
    lse = torch.empty(plan.lse_shape, dtype=torch.float32, device="cuda")
    kernel, grid, meta = plan.launch.kernel, plan.launch.grid, plan.launch.meta
    kargs = (q4, k4, v4, rpb, out, lse, *launch.descriptor_args(q4, plan.host_desc_layouts, (k4, v4)),
             *plan.launch.scalars)
    qh, kh, vh = (t.transpose(1, 2).reshape(B, H, 196, D) for t in (q, k, v))
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    rpb_g = rpb.clone().requires_grad_()
    qhg, khg, vhg = (t.detach().clone().requires_grad_() for t in (qh, kh, vh))
    g = torch.randn_like(q)
    gh = torch.randn_like(qh)
    rows = [
        ("ops.na2d (fused, rpb)", lambda: ops.na2d(q, k, v, 7, rpb=rpb, backend="fused")),
        ("launch.forward", lambda: launch.forward(q, k, v, rpb, params, D ** -0.5)),
        ("bare Triton launch", lambda: kernel[grid](*kargs, **meta)),
        ("ops.na2d fwd+bwd (fused, trainable rpb)",
         lambda: ops.na2d(qg, kg, vg, 7, rpb=rpb_g, backend="fused").backward(g)),
        ("ops.na2d fwd+bwd (fused, frozen rpb: no dRPB kernel)",
         lambda: ops.na2d(qg, kg, vg, 7, rpb=rpb, backend="fused").backward(g)),
        ("sdpa", lambda: F.scaled_dot_product_attention(qh, kh, vh)),
        ("sdpa fwd+bwd", lambda: F.scaled_dot_product_attention(qhg, khg, vhg).backward(gh)),
        ("torch.add", lambda: torch.add(qh, kh)),
    ]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| call | host us per call |\n|---|---|")
    for name, fn in rows:
        print(f"| {name} | {per_call_us(fn, args.calls):.1f} |", flush=True)

    import timm

    import namodels  # noqa: F401
    from namodels.benchmark.models import swap_dense_attention

    img = torch.randn(1, 3, 224, 224, device="cuda")
    for backend in ("fused", "sdpa"):
        model = timm.create_model("nat_tiny").cuda().eval()
        if backend == "sdpa":
            swap_dense_attention(model)

        def fwd():
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                model(img)

        with namodels.set_backend(model, None if backend == "sdpa" else backend):
            print(f"| nat_tiny batch 1 forward, {backend} | {per_call_us(fwd, 30):.1f} |", flush=True)


if __name__ == "__main__":
    main()

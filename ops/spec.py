"""Problem specs as text, ``B,H,D,spatial,K[,stride,dilation,causal[,rpb]]`` with per-axis values joined by 'x'
(``2,8,64,64x64,13x13,1,1,0``; a single value applies to every axis).

No imports: ``benchmarks/fused_sass.py`` loads this file on its own, without torch.
"""


def parse_problem_spec(spec: str) -> dict:
    """The spec's fields: batch, heads, dim, spatial, kernel_size, and stride / dilation / causal (None where the spec
    leaves them out) and rpb."""
    fields = spec.split(",")
    if len(fields) < 5:
        raise ValueError(f"expected B,H,D,spatial,K[,stride,dilation,causal[,rpb]], got {spec!r}")
    axes = lambda s: tuple(int(x) for x in s.split("x"))  # noqa: E731
    batch, heads, dim = (int(x) for x in fields[:3])
    spatial = axes(fields[3])
    per_axis = lambda s: axes(s) if "x" in s else axes(s) * len(spatial)  # noqa: E731
    return dict(
        batch=batch, heads=heads, dim=dim, spatial=spatial, kernel_size=per_axis(fields[4]),
        stride=per_axis(fields[5]) if len(fields) > 5 else None,
        dilation=per_axis(fields[6]) if len(fields) > 6 else None,
        causal=tuple(bool(c) for c in per_axis(fields[7])) if len(fields) > 7 else None,
        rpb=len(fields) > 8 and fields[8] not in ("0", ""),
    )

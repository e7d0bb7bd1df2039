"""One fused forward of a standard problem (for ncu)."""
import sys, torch
sys.path.insert(0, '.')
from ops import functional
from ops.bench import standard_problems
p = {x.name: x for x in standard_problems()}[sys.argv[1]]
params = p.params
shape = (p.batch, *p.spatial, p.heads, p.dim)
q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
fn = {1: functional.na1d, 2: functional.na2d, 3: functional.na3d}[params.rank]
out = fn(q, k, v, p.kernel_size, p.stride, p.dilation, p.causal, backend="fused")
torch.cuda.synchronize()
print("done", sys.argv[1])

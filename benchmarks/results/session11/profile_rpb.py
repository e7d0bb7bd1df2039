"""Kernel times of one fwd+bwd of a bench problem (torch.profiler, CUDA time per kernel; session 11).
    python3 profile_rpb.py PROBLEM [--offset]   (--offset: the dRPB offset pass instead of the window-layout dS)"""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, ".")
from ops import bench  # noqa: E402
from ops.fused import rpb_grad  # noqa: E402

if "--offset" in sys.argv:
    rpb_grad.WINDOW_BUFFER_BYTES = 0
p = {q.name: q for q in bench.standard_problems()}[sys.argv[1]]
gen = torch.Generator(device="cuda").manual_seed(0)
q, k, v, rpb = p.random_inputs("cuda", torch.bfloat16, gen, requires_grad=True)
d_out = torch.randn_like(q)
for _ in range(3):
    p.attention(q, k, v, rpb, "fused").backward(d_out)
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
    for _ in range(10):
        p.attention(q, k, v, rpb, "fused").backward(d_out)
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))

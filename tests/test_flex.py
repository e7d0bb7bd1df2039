"""Backend `flex` against the dense-mask oracle: float32 forward on CPU, forward+backward on CUDA."""
import random
import warnings

import pytest
import torch

import ops
from tests.backend_check import check_backend
from tests.oracle import random_problem

warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("seed", range(300))
def test_random_problems_forward_cpu(seed):
    rng = random.Random(5000 + seed)
    problem = random_problem(rng, max_tokens=64)
    check_backend(problem, "flex", torch.float32, grad=False, generator=torch.Generator().manual_seed(seed),
                  extra_tokens=rng.choice([0, 0, 2]))


def test_backward_on_cpu_is_refused_with_reason():
    q = torch.randn(1, 8, 8, 2, 4, requires_grad=True)
    with pytest.raises(ValueError, match="backend: 'flex' cannot serve.*no backward on CPU"):
        ops.na2d(q, q, q, 3, backend="flex")
    with torch.no_grad():
        ops.na2d(q, q, q, 3, backend="flex")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("seed", range(60))
def test_random_problems_cuda(seed):
    rng = random.Random(9000 + seed)
    problem = random_problem(rng, max_tokens=256, max_dim=16)
    problem.dim, problem.dim_v = 16, 16  # compiled flex kernels need head dims >= 16
    check_backend(problem, "flex", torch.float32, device="cuda", generator=torch.Generator("cuda").manual_seed(seed),
                  tol=5e-3)

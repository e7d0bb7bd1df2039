"""Shared pytest setup: the repository root on sys.path and a guard against empty runs."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Without a GPU the Triton kernels are checked through Triton's interpreter.  Triton decides at
# decoration time, so this must hold for the whole session, before any test imports ops.fused/ops.gemm
# (automatic backend selection never picks the interpreter, so other tests are unaffected).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def poison_torch_empty(monkeypatch):
    """``torch.empty`` returns NaN-filled float tensors, so a backend that leaves an output element
    unwritten fails its comparison instead of passing on whatever memory held."""
    real_empty = torch.empty

    def poisoned_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", poisoned_empty)


@pytest.fixture
def h100_sms_without_a_gpu(monkeypatch):
    """Hopper plans built on the CPU order their tiles for an H100's 132 SMs; on a GPU the device's own count holds."""
    from ops.fused import hopper

    real = hopper.multiprocessors
    monkeypatch.setattr(hopper, "multiprocessors",
                        lambda device: real(device) if torch.device(device).type == "cuda" else 132)


SLOW_TESTS = frozenset(
    line.strip() for line in open(os.path.join(os.path.dirname(__file__), "slow_tests.txt"), encoding="utf-8")
    if line.strip() and not line.startswith("#"))


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(config, items):
    """Marks the tests listed in ``slow_tests.txt`` as ``slow``."""
    for item in items:
        if item.nodeid in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)


# ``-n auto`` (pyproject's addopts) runs one worker per core up to this many: on a many-core GPU host every worker of
# a ``-m gpu`` run holds a CUDA context on the same device
MAX_WORKERS = 8


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist's
def pytest_xdist_auto_num_workers(config):
    return max(1, min(MAX_WORKERS, os.cpu_count() or 1))


def pytest_sessionfinish(session, exitstatus):
    # pytest exits 5 when nothing was collected; make sure CI can never pass on an empty selection.
    if exitstatus == 0 and session.testscollected == 0:
        session.exitstatus = 1

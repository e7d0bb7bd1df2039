"""Training-speed settings shared by the tasks and the benchmark (``namodels.speed``): the backward on the calling
thread."""
import threading

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from namodels.benchmark.throughput import measure_throughput
from namodels.benchmark.timing import TimingSettings
from namodels.speed import CallingThreadBackward, calling_thread_backward


class _Recorded(torch.autograd.Function):
    """Identity that records, in its backward, whether autograd's worker threads are on and which thread runs it."""

    seen: list = []

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        _Recorded.seen.append((torch.autograd.is_multithreading_enabled(), threading.get_ident()))
        return grad


@pytest.fixture
def seen():
    _Recorded.seen = []
    return _Recorded.seen


def _loss(device="cpu"):
    x = torch.randn(3, device=device, requires_grad=True)
    return _Recorded.apply(x * 2).sum()


def test_calling_thread_backward_turns_the_worker_threads_off_for_its_block(seen):
    with calling_thread_backward():
        _loss().backward()
    _loss().backward()
    assert [on for on, _ in seen] == [False, True]


def test_every_task_runs_lightnings_backward_hook_on_the_calling_thread(seen):
    from namodels.tasks.classification import ClassificationModule  # (the tasks need Hydra; the GPU test does not)
    from namodels.tasks.gan import GANTask
    from namodels.tasks.video import VideoTask

    for task in (ClassificationModule, GANTask, VideoTask):
        assert task.backward is CallingThreadBackward.backward, task.__name__

    class Module(CallingThreadBackward, pl.LightningModule):
        pass

    Module().backward(_loss())
    assert [on for on, _ in seen] == [False]


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 3)

    def forward(self, x):
        return _Recorded.apply(self.fc(x))


def test_the_benchmarks_training_steps_run_their_backward_on_the_calling_thread(seen):
    row = measure_throughput(_Net, lambda b, d: torch.randn(b, 6, device=d), name="net", batch_size=4,
                             precision="fp32", device="cpu", infer=False,
                             settings=TimingSettings(warmup=1, iters=2, min_iters=1))
    assert row["status"] == "ok" and seen and all(not on for on, _ in seen)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_backward_runs_on_the_calling_thread(seen):
    """torch's default runs a CUDA backward on a worker thread; inside the context it runs on the caller's."""
    _loss("cuda").backward()
    with calling_thread_backward():
        _loss("cuda").backward()
    (_, default_thread), (_, calling_thread) = seen
    assert default_thread != threading.get_ident() and calling_thread == threading.get_ident()

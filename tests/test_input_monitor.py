"""InputWaitMonitor: the share of training time spent waiting for batches, and its warning (on a simulated clock)."""
import logging
from types import SimpleNamespace

import pytest

from namodels.tasks import input_monitor
from namodels.tasks.input_monitor import InputWaitMonitor


class _Clock:
    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now

    def advance(self, seconds):
        self.now += seconds


class _Module:
    def __init__(self):
        self.logged = []

    def log(self, name, value, **kwargs):
        self.logged.append((name, value))


def _run(monkeypatch, monitor, batches, load_s, step_s, transfer_s=0.0, pipeline="cpu", launcher="main"):
    """Simulated loop: wait ``load_s`` for a batch, stamp the hand-over, ``transfer_s`` of transfer, ``step_s``."""
    clock = _Clock()
    monkeypatch.setattr(input_monitor, "time", clock)
    dm = SimpleNamespace(batch_fetched_at=None, cfg={"num_workers": 3, "gpu": {"workers": 6, "launcher": launcher}},
                         pipeline=lambda: pipeline)
    trainer = SimpleNamespace(datamodule=dm, current_epoch=0)
    module = _Module()
    monitor.on_train_epoch_start(trainer, module)
    for i in range(batches):
        clock.advance(load_s)
        dm.batch_fetched_at = clock.now
        clock.advance(transfer_s)
        monitor.on_train_batch_start(trainer, module, None, i)
        clock.advance(step_s)
        monitor.on_train_batch_end(trainer, module, None, None, i)
    return module


def test_an_input_bound_loop_is_reported_once_per_epoch(monkeypatch, caplog):
    monitor = InputWaitMonitor(threshold=0.2, every_n_batches=5)
    with caplog.at_level(logging.WARNING):
        module = _run(monkeypatch, monitor, 11, load_s=0.010, step_s=0.005)
    fractions = [v for name, v in module.logged if name == "train/input_wait"]
    # the first window starts at the first batch's start: 4 waits in 4 x 15 ms + 5 ms; then 5 in 75 ms
    assert fractions == pytest.approx([0.040 / 0.065, 0.050 / 0.075])
    warnings = [r for r in caplog.records if "input-bound" in r.getMessage()]
    assert len(warnings) == 1 and "data.num_workers=3" in warnings[0].getMessage()


@pytest.mark.parametrize("launcher, advice", [("main", "more file-reading loader workers (data.gpu.workers)"),
                                              ("workers", "more GPU loader processes (data.gpu.workers)")])
def test_an_input_bound_gpu_pipeline_is_told_its_own_worker_setting(monkeypatch, caplog, launcher, advice):
    monitor = InputWaitMonitor(threshold=0.2, every_n_batches=5)
    with caplog.at_level(logging.WARNING):
        _run(monkeypatch, monitor, 6, load_s=0.010, step_s=0.005, pipeline="gpu", launcher=launcher)
    (warning,) = [r.getMessage() for r in caplog.records if "input-bound" in r.getMessage()]
    assert f"data.gpu.launcher={launcher}, data.gpu.workers=6" in warning and advice in warning
    assert "data.pipeline=gpu)" not in warning  # it runs already


def test_transfer_after_the_hand_over_is_not_an_input_wait(monkeypatch, caplog):
    monitor = InputWaitMonitor(threshold=0.2, every_n_batches=5)
    with caplog.at_level(logging.WARNING):
        module = _run(monkeypatch, monitor, 6, load_s=0.0, step_s=0.005, transfer_s=0.010)
    assert [v for name, v in module.logged if name == "train/input_wait"] == [0.0]
    assert not [r for r in caplog.records if "input-bound" in r.getMessage()]


@pytest.mark.parametrize("kwargs", [dict(threshold=0), dict(threshold=1.5), dict(every_n_batches=0)])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        InputWaitMonitor(**kwargs)

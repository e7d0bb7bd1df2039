"""The end-of-run summary prints accuracies as percentages and losses / errors as plain numbers."""
from namodels.tasks.runner import print_summary


def _summary(metrics, monitor, best):
    return {"task": "t", "model": "m", "data": "d", "epochs": 1, "global_step": 3, "seconds": 1.0,
            "metrics": metrics, "monitor": monitor, "best_score": best, "best_checkpoint": "best.ckpt"}


def test_accuracy_is_a_percentage(capsys):
    print_summary(_summary({"val/top1": 96.94, "val/loss": 0.12, "train/loss": 0.5}, "val/top1", 97.0))
    out = capsys.readouterr().out
    assert "val/top1      96.94%" in out and "best val/top1 97.00%" in out
    assert "val/loss      0.12\n" in out and "train/loss" not in out


def test_mse_is_not_a_percentage(capsys):
    print_summary(_summary({"val/mse": 0.0123, "val/mse_copy_last": 0.0375}, "val/mse", 0.0123))
    out = capsys.readouterr().out
    assert "best val/mse 0.0123 " in out and "%" not in out
    assert "val/mse_copy_last" in out

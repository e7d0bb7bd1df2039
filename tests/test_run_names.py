"""Run names (logs/<task>/<run_name>/version_N) say what distinguishes a run, so that ``ckpt_path=last`` of one
run never resumes another's checkpoint: the video task's objective is part of its runs' names."""
import os

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_name(*overrides):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=os.path.join(ROOT, "configs"), version_base="1.3"):
        return compose("train", overrides=list(overrides)).run_name


def test_video_objectives_get_run_names_of_their_own():
    """README's two video runs: next-frame, then classification with ckpt_path=last.  Under one shared name the
    classification run would resume the next-frame run's last.ckpt ("Unexpected key(s) ... model.head.weight")."""
    next_frame = _run_name("experiment=video_moving_digits")
    classification = _run_name("experiment=video_moving_digits", "task.module.objective=classification",
                               "callbacks.model_checkpoint.monitor=val/top1", "callbacks.model_checkpoint.mode=max")
    assert next_frame == "video_nat_nano-moving_digits-next_frame"
    assert classification == "video_nat_nano-moving_digits-classification"
    # without the experiment too
    assert _run_name("task=video", "model=video_nat_tiny", "data=moving_digits",
                     "task.module.objective=classification") == "video_nat_tiny-moving_digits-classification"


@pytest.mark.parametrize("overrides, expected", [((), "nat_digits-digits"),
                                                 (("experiment=stylenat_skimage",), "stylenat_tiny-skimage")])
def test_other_tasks_keep_model_and_data_names(overrides, expected):
    assert _run_name(*overrides) == expected


def test_readme_video_eval_command_uses_the_run_name():
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert "logs/video/video_nat_nano-moving_digits-next_frame/version_0/checkpoints/" in readme
    assert "logs/video/video_nat_nano-moving_digits/" not in readme

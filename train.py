"""Train a model: ``python train.py [experiment=<name>] [overrides]`` (see configs/train.yaml).

Default: nat_digits on the built-in sklearn digits (CPU, a few minutes).  ImageNet recipes:
``python train.py experiment=nat_mini_in1k data.root=/path/to/imagenet``.
"""
import sys

import hydra
from omegaconf import DictConfig


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg: DictConfig) -> None:
    from namodels.tasks.overrides import reported_config_errors
    from namodels.tasks.runner import fit

    with reported_config_errors(cfg):  # a config error: one line naming the key, no traceback
        fit(cfg)


if __name__ == "__main__":
    from namodels.tasks.overrides import check_overrides

    check_overrides(sys.argv[1:])  # a misspelled trainer key fails with "did you mean", before Hydra
    main()

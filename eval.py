"""Evaluate: ``python eval.py ckpt_path=<file.ckpt>`` or ``python eval.py model.name=<name>
model.pretrained_file=<weights>`` (see configs/eval.yaml; ``task=`` picks what is measured)."""
import sys

import hydra
from omegaconf import DictConfig


@hydra.main(version_base="1.3", config_path="configs", config_name="eval")
def main(cfg: DictConfig) -> None:
    from namodels.tasks.overrides import reported_config_errors
    from namodels.tasks.runner import evaluate

    with reported_config_errors(cfg):  # a config error: one line naming the key, no traceback
        evaluate(cfg)


if __name__ == "__main__":
    from namodels.tasks.overrides import check_overrides

    check_overrides(sys.argv[1:])  # a misspelled trainer key fails with "did you mean", before Hydra
    main()

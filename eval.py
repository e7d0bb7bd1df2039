"""Evaluate: ``python eval.py ckpt_path=<file.ckpt>`` or ``python eval.py model.name=<name>
model.pretrained_file=<weights>`` (see configs/eval.yaml; ``task=`` picks what is measured)."""
import hydra
from omegaconf import DictConfig


@hydra.main(version_base="1.3", config_path="configs", config_name="eval")
def main(cfg: DictConfig) -> None:
    from namodels.tasks.runner import evaluate

    evaluate(cfg)


if __name__ == "__main__":
    main()

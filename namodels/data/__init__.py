"""Data modules and dataset sources (ImageNet folders, tar shards, image folders, digits, synthetic)."""
from .datamodule import ClassificationDataModule, EpochSampler, collate_skipping
from .sources import FORMATS, DatasetLayoutError, LabeledImages, SyntheticImages, build_splits

__all__ = [
    "ClassificationDataModule", "EpochSampler", "collate_skipping",
    "FORMATS", "DatasetLayoutError", "LabeledImages", "SyntheticImages", "build_splits",
]

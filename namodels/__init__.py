"""namodels: vision models on neighborhood-attention kernels (importing it registers the models in timm)."""
__version__ = "0.1.0"

from . import models  # noqa: E402,F401  (registers NAT / DiNAT / DiNAT_s with timm)

"""namodels: vision models on neighborhood-attention kernels (importing it registers the models in timm)."""
__version__ = "0.1.0"

from . import models  # noqa: E402,F401  (registers NAT / DiNAT / DiNAT_s with timm)
from .models import tiny as _tiny  # noqa: E402,F401  (registers nat_digits, the default training model)
from .backend import na_modules, set_backend  # noqa: E402,F401  (the NA backend of a whole model)

"""Models registered in timm on import: NAT / DiNAT (``nat.py``), DiNAT_s (``dinat_s.py``), the causal
video NAT (``video.py``) and StyleNAT (``stylenat.py``)."""
from .dinat_s import DiNAT_s
from .nat import NAT
from .pretrained import PretrainedWeightsUnavailable
from .stylenat import StyleNATDiscriminator, StyleNATGenerator
from .video import VideoNAT

__all__ = ["NAT", "DiNAT_s", "VideoNAT", "StyleNATGenerator", "StyleNATDiscriminator", "PretrainedWeightsUnavailable"]

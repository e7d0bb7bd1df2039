"""Models registered in timm on import: NAT / DiNAT (``nat.py``) and DiNAT_s (``dinat_s.py``)."""
from .dinat_s import DiNAT_s
from .nat import NAT

__all__ = ["NAT", "DiNAT_s"]
from .video import VideoNAT  # noqa: E402  (registers video_nat_* in timm)
from .stylenat import StyleNATDiscriminator, StyleNATGenerator  # noqa: E402

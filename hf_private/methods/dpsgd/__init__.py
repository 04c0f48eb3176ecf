from .config import DPConfig
from .method import DPSGDMethod

__all__ = ["DPConfig", "DPSGDMethod"]

from .config import DPFPConfig
from .method import DPFPMethod

__all__ = ["DPFPConfig", "DPFPMethod"]

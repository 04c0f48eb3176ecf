from .config import BitFitConfig
from .method import BitFitMethod

__all__ = ["BitFitConfig", "BitFitMethod"]

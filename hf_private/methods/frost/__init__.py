from .config import FrostConfig
from .method import FrostMethod

__all__ = ["FrostConfig", "FrostMethod"]

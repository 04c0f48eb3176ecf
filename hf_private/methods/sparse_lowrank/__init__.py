from .config import SparseLowRankConfig
from .method import SparseLowRankMethod

__all__ = ["SparseLowRankConfig", "SparseLowRankMethod"]

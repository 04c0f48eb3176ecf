from .config import DPLoRAConfig
from .method import DPLoRAMethod

__all__ = ["DPLoRAConfig", "DPLoRAMethod"]

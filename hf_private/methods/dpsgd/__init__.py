from .config import DPConfig

__all__ = ["DPConfig"]

from .config import BitFitConfig

__all__ = ["BitFitConfig"]

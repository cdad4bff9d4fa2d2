"""collimate_rl: the name RL trainers import; today the same surface as collimate_core."""

from collimate_core import *  # noqa: F403
from collimate_core import __all__ as _core_all

__all__ = [*_core_all]

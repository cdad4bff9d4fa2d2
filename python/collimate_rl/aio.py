"""collimate_rl.aio: the async SDK surface (collimate_core.aio) under the name RL trainers import."""

from collimate_core.aio import *  # noqa: F403
from collimate_core.aio import __all__ as _aio_all

__all__ = [*_aio_all]

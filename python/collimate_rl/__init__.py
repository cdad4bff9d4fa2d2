"""collimate_rl: the name RL trainers import; today the same surface as collimate_core."""

import sys as _sys

from collimate_core import *  # noqa: F403
from collimate_core import __all__ as _core_all
from collimate_core import integrations as _integrations
from collimate_core.integrations import trl as _trl, verl as _verl

# `collimate_rl.integrations.trl` and `.verl` are collimate_core's modules under this name.
_sys.modules[__name__ + ".integrations"] = _integrations
_sys.modules[__name__ + ".integrations.trl"] = _trl
_sys.modules[__name__ + ".integrations.verl"] = _verl
integrations = _integrations

__all__ = [*_core_all]

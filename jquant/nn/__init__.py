"""Deprecated alias of ``jquant.flax`` (the name the Flax integration had before it was ``jquant.flax``)."""

import warnings

from jquant.flax import *  # noqa: F401,F403
from jquant.flax import __all__  # noqa: F401

warnings.warn("jquant.nn is deprecated: import jquant.flax instead", DeprecationWarning, stacklevel=2)

"""The core layer: thin, Pythonic wrappers over the C core."""
from tract_cli.core.errors import TractError
from tract_cli.core.geometry import Geometry, ModelProfile, load_model
from tract_cli.core.pool import Pool

__all__ = ["Geometry", "ModelProfile", "Pool", "TractError", "load_model"]

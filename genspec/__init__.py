"""genspec: generalized speculative decoding.

Convention used everywhere in the code: ``draft_probs`` are the speculator's (cheap model's)
probabilities, ``target_probs`` the large model's. (The theory paper calls them p and q.)
"""
__version__ = "0.1.0"  # the package version (pyproject.toml reads it from here); CHANGELOG.md lists changes

from genspec.errors import (  # noqa: E402,F401
    ConfigError, ContextLengthError, GenerationError, GenspecError, InputFileError, NumericalError)
from genspec.api import DRAFTERS, Backend, build_drafter, load, load_model  # noqa: E402,F401
from genspec.engine import GenerationConfig, SpeculativeEngine  # noqa: E402,F401
from genspec.models.llamacpp import Kernels  # noqa: E402,F401
from genspec.sampling import SamplingConfig  # noqa: E402,F401

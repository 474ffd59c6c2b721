"""megamoe: Mixture-of-Experts layers, balancing, expert parallelism and upcycling for
Megatron-Core pretraining.

Importing megamoe drops one message of torch's: the CUDA build of torch on a machine without a
GPU logs "No CUDA runtime is found" when `torch.utils.cpp_extension` is imported (megatron-core
imports it). It is a fact of the environment, not a problem, and it would turn every CLI's
one-line error into several lines.
"""
import logging

logging.getLogger("torch.utils.cpp_extension").addFilter(
    lambda record: not record.getMessage().startswith("No CUDA runtime is found"))

from megamoe import dispatch, experts, routing  # noqa: E402,F401  (they fill megamoe.registry)
from megamoe.config import MoEConfig  # noqa: E402
from megamoe.errors import CheckpointError, ConfigError, DataError, MegaMoEError  # noqa: E402

__all__ = ["CheckpointError", "ConfigError", "DataError", "MegaMoEError", "MoEConfig"]

"""megamoe: Mixture-of-Experts layers, balancing, expert parallelism and upcycling for
Megatron-Core pretraining.

Importing megamoe silences two things the environment says that are not problems, and that
would turn every CLI's one-line error into several lines:
- the CUDA build of torch on a machine without a GPU logs "No CUDA runtime is found" when
  `torch.utils.cpp_extension` is imported (megatron-core imports it);
- Python 3.12 raises SyntaxWarnings while compiling megatron-core's own sources (0.19.2 has an
  invalid escape in a docstring) wherever megatron-core was installed without byte-code (pip's
  `--no-compile`, `PIP_NO_COMPILE` in slim containers).
"""
import logging
import warnings

logging.getLogger("torch.utils.cpp_extension").addFilter(
    lambda record: not record.getMessage().startswith("No CUDA runtime is found"))
warnings.filterwarnings("ignore", category=SyntaxWarning, module=r".*[\\/]megatron[\\/]")

from megamoe import dispatch, experts, routing  # noqa: E402,F401  (they fill megamoe.registry)
from megamoe.config import (BalancingConfig, DispatcherConfig, ExpertsConfig,  # noqa: E402
                            MoEConfig, RouterConfig, SharedExpertConfig)
from megamoe.errors import CheckpointError, ConfigError, DataError, MegaMoEError  # noqa: E402
from megamoe.routing import (BaseRouterConfig, SinkhornRouterConfig,  # noqa: E402
                             ThresholdRouterConfig, TopKRouterConfig, TopPRouterConfig)

__all__ = ["BalancingConfig", "BaseRouterConfig", "CheckpointError", "ConfigError", "DataError",
           "DispatcherConfig", "ExpertsConfig", "MegaMoEError", "MoEConfig", "RouterConfig",
           "SharedExpertConfig", "SinkhornRouterConfig", "ThresholdRouterConfig",
           "TopKRouterConfig", "TopPRouterConfig"]

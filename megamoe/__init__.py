"""megamoe: Mixture-of-Experts layers, balancing, expert parallelism and upcycling for
Megatron-Core pretraining."""
from megamoe.config import MoEConfig
from megamoe.errors import CheckpointError, ConfigError, DataError, MegaMoEError

__all__ = ["CheckpointError", "ConfigError", "DataError", "MegaMoEError", "MoEConfig"]

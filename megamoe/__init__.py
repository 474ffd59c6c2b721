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

# The public names, imported on first use (PEP 562): `import megamoe` alone, as every tool and
# helper process does through its submodules, does not import torch.
_PUBLIC = {
    "megamoe.config": ("BalancingConfig", "DispatcherConfig", "ExpertsConfig", "MoEConfig",
                       "RouterConfig", "SharedExpertConfig"),
    "megamoe.errors": ("CheckpointError", "ConfigError", "DataError", "MegaMoEError"),
    "megamoe.routing": ("BaseRouterConfig", "SinkhornRouterConfig", "ThresholdRouterConfig",
                        "TopKRouterConfig", "TopPRouterConfig"),
}
_MODULE_OF = {name: module for module, names in _PUBLIC.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'megamoe' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_MODULE_OF[name]), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

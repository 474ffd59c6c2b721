"""A model chunk as Megatron-Core's `finalize_model_grads` sees it, for tests on one rank."""
from torch import nn


class MegatronChunk(nn.Module):
    """What finalize_model_grads expects of a model chunk on one rank: `.module`, `.config` and
    `finish_grad_sync()` (Megatron's DDP; nothing to reduce with one data-parallel rank)."""

    def __init__(self, module):
        super().__init__()
        self.module, self.config = module, module.config

    def finish_grad_sync(self, force_all_reduce=False):
        pass

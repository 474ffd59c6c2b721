"""Token dispatchers, chosen by `MoEConfig.dispatcher` through the `DISPATCHERS` registry."""
from megamoe.dispatch.alltoall import AllToAllDispatcher
from megamoe.dispatch.permute import Permutation, permute, sort_by_expert, unpermute

DISPATCHERS = {"alltoall": AllToAllDispatcher}

__all__ = ["AllToAllDispatcher", "DISPATCHERS", "Permutation", "permute", "sort_by_expert",
           "unpermute"]

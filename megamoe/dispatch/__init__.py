"""Token dispatchers, chosen by `MoEConfig.dispatcher` through the `DISPATCHERS` registry."""
from megamoe.dispatch.allgather import AllGatherDispatcher
from megamoe.dispatch.alltoall import AllToAllDispatcher
from megamoe.dispatch.permute import Permutation, permute, sort_by_expert, unpermute

DISPATCHERS = {"alltoall": AllToAllDispatcher, "allgather": AllGatherDispatcher}

__all__ = ["AllGatherDispatcher", "AllToAllDispatcher", "DISPATCHERS", "Permutation", "permute",
           "sort_by_expert", "unpermute"]

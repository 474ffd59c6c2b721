"""Token dispatchers, chosen by `MoEConfig.dispatcher.kind` through the `DISPATCHERS` registry
(`megamoe.registry`)."""
from megamoe.dispatch.allgather import AllGatherDispatcher
from megamoe.dispatch.alltoall import AllToAllDispatcher
from megamoe.dispatch.permute import Permutation, permute, sort_by_expert, unpermute
from megamoe.registry import DISPATCHERS

__all__ = ["AllGatherDispatcher", "AllToAllDispatcher", "DISPATCHERS", "Permutation", "permute",
           "sort_by_expert", "unpermute"]

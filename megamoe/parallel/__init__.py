"""Process-group handles (`Comm`): torch.distributed groups, a group of one, the collectives."""
from megamoe.parallel.comm import (CollectiveError, Comm, SingleComm, TorchComm, all_to_all,
                                   as_comm)

__all__ = ["CollectiveError", "Comm", "SingleComm", "TorchComm", "all_to_all", "as_comm"]

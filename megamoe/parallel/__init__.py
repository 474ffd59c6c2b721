"""Process-group handles (`Comm`) and an in-process mock of N expert-parallel ranks."""
from megamoe.parallel.comm import (CollectiveError, Comm, SingleComm, TorchComm, all_to_all,
                                   as_comm)
from megamoe.parallel.mock import MockComm, MockWorld, expert_parallel_replica, run_ranks

__all__ = ["CollectiveError", "Comm", "MockComm", "MockWorld", "SingleComm", "TorchComm",
           "all_to_all", "as_comm", "expert_parallel_replica", "run_ranks"]

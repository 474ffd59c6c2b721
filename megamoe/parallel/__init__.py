"""Process-group handles (`Comm`) and an in-process mock of N expert-parallel ranks."""
from megamoe.parallel.comm import Comm, SingleComm, TorchComm, all_to_all, as_comm
from megamoe.parallel.mock import MockComm, MockWorld, expert_parallel_replica, run_ranks

__all__ = ["Comm", "MockComm", "MockWorld", "SingleComm", "TorchComm", "all_to_all", "as_comm",
           "expert_parallel_replica",
           "run_ranks"]

"""The results queue megamoe gives Megatron's checkpoint writer (megamoe.checkpointing.no_orphans):
write results come back whole, and the manager process that holds the queue never imports torch
(it did, unpickling each result: ~5 s of CPU and ~270 MB in every rank that saved)."""
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

from megamoe.checkpointing import no_orphans


def test_write_results_cross_the_manager_without_torch_in_it():
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    no_orphans.own_write_results_queue()
    queue = filesystem_async._results_queue
    results = {0: [WriteResult(index=MetadataIndex("layer.weight", torch.Size([0, 4])),
                               size_in_bytes=64, storage_data="__0_0.distcp")]}
    queue.put(results)  # what Megatron's writer process does, then the rank's get_nowait
    assert queue.get_nowait() == results
    manager_pid = no_orphans._state["manager"]._process.pid
    mapped = Path(f"/proc/{manager_pid}/maps").read_text()
    assert "libtorch" not in mapped

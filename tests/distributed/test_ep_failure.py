"""A rank that dies or stalls mid-step makes the others fail with a clear error within the
process-group timeout that `setup_megatron` gives Megatron's expert-parallel groups."""
import pytest

import ep_workers
from megamoe.parallel.spawn import spawn_ranks as spawn

GROUP_TIMEOUT_S = 4.0


@pytest.mark.parametrize("mode", ["killed", "stalled"])
def test_peer_failure_raises_collective_error_within_timeout(mode, tmp_path):
    survivor, _ = spawn(2, ep_workers.failure_job, str(tmp_path), timeout_s=120, may_die=(1,),
                        mode=mode, group_timeout_s=GROUP_TIMEOUT_S, result_dir=str(tmp_path))
    assert survivor["type"] == "CollectiveError", survivor
    assert "all_to_all over a group of 2 ranks failed on group rank 0" in survivor["message"]
    assert survivor["elapsed_s"] < GROUP_TIMEOUT_S + 5.0
    if mode == "stalled":  # the group's timeout is what ended the wait
        assert survivor["elapsed_s"] > 0.5 * GROUP_TIMEOUT_S

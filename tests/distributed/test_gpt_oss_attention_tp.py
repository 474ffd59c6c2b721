"""GPT-OSS's attention (sinks sharded with the heads, a sliding window, q/k/v/o biases, YaRN) at
TP=2 with sequence parallelism computes what one process does: the same per-token loss and the
same attention gradients, the sinks' among them (attention_workers.py)."""
import pytest
import torch

import attention_workers
from megamoe.parallel.spawn import spawn_ranks as spawn


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return spawn(2, attention_workers.tp_job, str(tmp_path_factory.mktemp("gpt_oss_tp2")), 300)


def test_tp2_is_one_process(runs):
    for rank, result in enumerate(runs):
        tp2, tp1 = result["tp2"], result["tp1"]
        torch.testing.assert_close(tp2["loss"], tp1["loss"], rtol=1e-5, atol=1e-5)
        assert sorted(tp2["grads"]) == sorted(tp1["grads"])
        sinks = [name for name in tp1["grads"] if name.endswith("softmax_offset")]
        assert len(sinks) == 2 and all(tp1["grads"][name].abs().max() > 0 for name in sinks)
        for name, expected in tp1["grads"].items():
            torch.testing.assert_close(tp2["grads"][name], expected, rtol=1e-4, atol=1e-5,
                                       msg=lambda m: f"rank {rank} {name}: {m}")
        worst = max(float((tp2["grads"][n] - g).abs().max()) for n, g in tp1["grads"].items())
        print(f"\nGPT-OSS attention TP2 vs TP1, rank {rank}: max loss diff "
              f"{float((tp2['loss'] - tp1['loss']).abs().max()):.2e}, max gradient diff "
              f"{worst:.2e}")

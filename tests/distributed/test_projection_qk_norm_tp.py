"""MiniMax-M2's attention (one QK RMSNorm over the whole query and key projections, partial RoPE)
at TP=2 with sequence parallelism computes what one process does: the same per-token loss and
the same attention gradients, the norms' among them (their weight split with the heads, the sum
of squares all-reduced over the tensor ranks; attention_workers.py runs both layouts)."""
import pytest
import torch

import attention_workers
from megamoe.parallel.spawn import spawn_ranks as spawn

S = attention_workers.S
MODEL = {"num_layers": 2, "hidden_size": 24, "num_attention_heads": 4, "num_query_groups": 2,
         "kv_channels": 8, "ffn_hidden_size": 16, "seq_length": S, "first_k_dense": 1,
         "position_embedding": "rope", "rotary_base": 5000000.0, "rotary_percent": 0.5,
         "qk_layernorm": True, "qk_layernorm_scope": "projection",
         "make_vocab_size_divisible_by": 32, "init_method_std": 0.2}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return spawn(2, attention_workers.tp_job, str(tmp_path_factory.mktemp("qk_norm_tp2")), 300,
                 settings=MODEL)


def test_tp2_is_one_process(runs):
    for rank, result in enumerate(runs):
        tp2, tp1 = result["tp2"], result["tp1"]
        torch.testing.assert_close(tp2["loss"], tp1["loss"], rtol=1e-5, atol=1e-5)
        norms = [name for name in tp1["grads"] if name.endswith(("q_layernorm.weight",
                                                                 "k_layernorm.weight"))]
        assert len(norms) == 4 and all(tp1["grads"][name].abs().max() > 0 for name in norms)
        assert [tp1["grads"][name].numel() for name in norms] == [4 * 8, 2 * 8] * 2
        assert sorted(tp2["grads"]) == sorted(tp1["grads"])
        for name, expected in tp1["grads"].items():
            torch.testing.assert_close(tp2["grads"][name], expected, rtol=1e-4, atol=1e-5,
                                       msg=lambda m: f"rank {rank} {name}: {m}")

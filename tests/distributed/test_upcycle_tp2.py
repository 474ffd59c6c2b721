"""Upcycling dense checkpoints written by two gloo processes (TP=2, and PP=2), loaded back by
Megatron-Core's own MoE model at TP=2, EP=2 and PP=1; logits must match the dense model's.

One spawn of two ranks (forked from the session's forkserver) runs `_worker`, which returns the
largest logit difference of each case.
"""
import sys
from pathlib import Path

from megamoe.parallel.spawn import spawn_ranks as spawn

HERE = Path(__file__).resolve().parent
TOL = 1e-4


def test_tp2_and_pp2_dense_checkpoints_upcycle_and_load(tmp_path):
    results = spawn(2, _worker, str(tmp_path / "spawn"), 1000, workdir=str(tmp_path))[0]
    assert set(results) == {"tp2_torch_dist", "tp2_legacy", "ep2_from_tp2_legacy",
                            "pp2_legacy_granular", "pp2_legacy_mixed"}
    for name, diff in results.items():
        assert diff <= TOL, f"{name}: max |logit diff| {diff}"


# ---------------------------------------------------------------- worker (one per rank)

def _worker(rank: int, world_size: int, workdir: str) -> dict[str, float]:
    """{case: max |logit difference|, the same on both ranks}."""
    sys.path[:0] = [str(HERE.parent / "unit"), str(HERE.parent), str(HERE.parents[1])]
    import torch
    import torch.distributed as dist
    from megatron.core.models.gpt import GPTModel
    from megatron.core import parallel_state

    import upcycle_ckpts as ck
    from megamoe.megatron.runtime import setup_megatron, teardown_megatron
    from megamoe.upcycle import UpcycleRecipe, upcycle_checkpoint

    dist.init_process_group("gloo", init_method="env://")
    workdir = Path(workdir)
    results = {}
    ids = ck.tokens(seed=5)

    def max_diff(a, b) -> float:
        diff = torch.tensor(float((a - b).abs().max()))
        dist.all_reduce(diff, op=dist.ReduceOp.MAX)
        return float(diff)

    def upcycle_on_rank0(source, target, **recipe):
        if rank == 0:
            upcycle_checkpoint(source, target, UpcycleRecipe(**recipe), progress=False,
                               log=lambda line: None)
        dist.barrier()
        return target / "release"

    def moe_model(num_layers, settings, **parallel):
        cfg = ck.moe_config(ck.GLU, num_layers, settings, **parallel)
        return ck.build(cfg)

    granular = dict(num_experts=8, topk=2, granularity=2, shared_expert=True)
    granular_settings = dict(num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=64,
                             moe_shared_expert_intermediate_size=128)

    # TP=2: dense model, both formats; MoE loaded at TP=2 (vocab-parallel logit shards compared).
    setup_megatron(tensor_model_parallel_size=2, seed=21)
    cfg = ck.config(ck.GLU, num_layers=2, tensor_model_parallel_size=2)
    dense = ck.build(cfg)
    dense_logits = ck.logits(dense, ids)
    args = ck.megatron_lm_args(cfg)
    dist_root = ck.save_torch_dist(dense, workdir / "tp2_dist", args)
    legacy_root = ck.save_legacy(dense, workdir / "tp2_legacy", args)
    dist.barrier()
    for name, source in (("tp2_torch_dist", dist_root), ("tp2_legacy", legacy_root)):
        out = upcycle_on_rank0(source, workdir / f"moe_{name}", **granular)
        moe = ck.load_dist(moe_model(2, granular_settings, tensor_model_parallel_size=2), out)
        results[name] = max_diff(ck.logits(moe, ids), dense_logits)
    teardown_megatron()

    # EP=2 (TP=1, DP=2): the TP=2 upcycled legacy checkpoint; dense reference from the TP=2
    # torch_dist checkpoint, resharded to TP=1 by Megatron's loader.
    setup_megatron(expert_model_parallel_size=2, seed=21)
    dense = ck.load_dist(ck.build(ck.config(ck.GLU, num_layers=2)),
                         dist_root / "iter_0000007")
    moe = ck.load_dist(moe_model(2, granular_settings, expert_model_parallel_size=2),
                       workdir / "moe_tp2_legacy" / "release")
    assert len(moe.decoder.layers[0].mlp.experts.local_experts) == 4
    results["ep2_from_tp2_legacy"] = max_diff(ck.logits(moe, ids), ck.logits(dense, ids))
    teardown_megatron()

    # PP=2: each rank writes its pipeline stage (legacy files hold stage-local layer indices).
    setup_megatron(pipeline_model_parallel_size=2, seed=22)
    cfg = ck.config(ck.GLU, num_layers=4, pipeline_model_parallel_size=2,
                    pipeline_dtype=torch.float32)
    stage = GPTModel(config=cfg, transformer_layer_spec=ck.layer_spec(cfg), vocab_size=ck.VOCAB,
                     max_sequence_length=ck.SEQ,
                     pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=parallel_state.is_pipeline_last_stage(),
                     share_embeddings_and_output_weights=False,
                     position_embedding_type="learned_absolute")
    args = ck.megatron_lm_args(cfg)
    pp_dist = ck.save_torch_dist(stage, workdir / "pp2_dist", args)
    pp_legacy = ck.save_legacy(stage, workdir / "pp2_legacy", args)
    dist.barrier()
    granular_out = upcycle_on_rank0(pp_legacy, workdir / "moe_pp2", **granular)
    mixed_out = upcycle_on_rank0(pp_legacy, workdir / "moe_pp2_mixed", num_experts=4, topk=2,
                                 moe_layers=(1, 2))
    teardown_megatron()
    setup_megatron(seed=22)
    dense = ck.load_dist(ck.build(ck.config(ck.GLU, num_layers=4)), pp_dist / "iter_0000007")
    reference = ck.logits(dense, ids)
    moe = ck.load_dist(moe_model(4, granular_settings), granular_out)
    results["pp2_legacy_granular"] = max_diff(ck.logits(moe, ids), reference)
    moe = ck.load_dist(moe_model(4, dict(num_moe_experts=4, moe_router_topk=2,
                                         moe_layer_freq=[0, 1, 1, 0])), mixed_out)
    results["pp2_legacy_mixed"] = max_diff(ck.logits(moe, ids), reference)
    teardown_megatron()

    dist.destroy_process_group()
    return results

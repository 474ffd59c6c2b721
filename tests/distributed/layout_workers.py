"""Per-rank jobs of the parallel-layout tests (run through `megamoe.parallel.spawn`).

Every job trains the same tiny GPT-MoE (layer 0 dense, layers 1-3 MoE with a shared expert,
loss-free bias plus aux and z losses; its MLA variant with latent attention and latent MoE
layers under quantile balancing, its MTP variant with multi-token prediction, zero-computation
experts and a hash layer) through the real
trainer (`megamoe.train.loop`) at one or more parallel layouts, one after the other in the same
processes (megatron.core is imported once per process). Every run starts from the seed alone (no `checkpoint.init_from`): the initial
weights are layout-invariant, so a layout changes nothing but how the work is split.

A run's result: the per-step losses (and multi-token-prediction losses, None without MTP) and
gradient norms of metrics.jsonl, the held-out
evaluation of its last step (layouts without pipelining: loss and routing at inference), and
every rank's
expert biases ("layer N", global and 1-based -> tensor) at the end. Its checkpoints (at the end, and at RESUME_AT for
the runs resumes start from) stay in its output folder, where the single-process job later
loads the final weights of every layout.
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import torch.distributed as dist

STEPS = 4
BIAS_KEYS = ("expert_bias", "qb_beta")  # the loss-free bias, quantile balancing's
RESUME_AT = 2  # the runs that resumes start from checkpoint here; every run at its end
RESUME_SOURCES = ("tp2_sp", "pp2", "dp2_ep2", "tp2_pp2_ep2", "vocab_tp1", "mtp_pp2")
# A vocabulary padded differently at TP1 and TP2 (Megatron-Core pads it to a multiple of
# make_vocab_size_divisible_by x the tensor-parallel size): the 512 tokens take 528 rows at TP1
# and 576 at TP2.
VOCAB = {"model": {"make_vocab_size_divisible_by": 48}}

BASE = {
    "model": {"num_layers": 4, "hidden_size": 32, "num_attention_heads": 4,
              "ffn_hidden_size": 64, "seq_length": 32, "first_k_dense": 1,
              "make_vocab_size_divisible_by": 64},
    "moe": {"num_experts": 4, "ffn_hidden_size": 32, "topk": 2,
            "router": {"score_function": "sigmoid"},
            "balancing": {"methods": ["bias", "aux_loss"], "aux_loss_coeff": 1.0e-2,
                          "z_loss_coeff": 1.0e-3, "bias_update_rate": 1.0e-2},
            "shared_expert": {"ffn_hidden_size": 32}},
    "training": {"train_steps": STEPS, "micro_batch_size": 1, "global_batch_size": 4,
                 "grad_clip": 1.0},
    "optimizer": {"lr": 3.0e-3, "min_lr": 3.0e-4, "warmup_steps": 2},
    "checkpoint": {"interval": 0},
    "logging": {"interval": 1, "progress_bar": False, "tensorboard": False},
}

# Routing replay: the reference records its routing (ROUTING_RECORD, in its output folder); runs
# whose 50x faster bias would route otherwise replay it at other layouts (REPLAY_LAYOUTS).
ROUTING_RECORD = "routing"
REPLAY_ROUTER = {"score_function": "sigmoid", "replay": True}
FASTER_BIAS = {**BASE["moe"]["balancing"], "bias_update_rate": 0.5}
REPLAY_LAYOUTS = {  # name -> (processes, parallel section)
    "replay_dp2_ep2": (2, {"expert": 2}),
    "replay_pp2": (2, {"pipeline": 2}),
}

# name -> (processes, parallel section)
LAYOUTS = {
    "tp2_sp": (2, {"tensor": 2}),
    "pp2": (2, {"pipeline": 2}),
    "pp2_vpp2": (2, {"pipeline": 2, "virtual_stages": 2}),
    "pp2_uneven_1_3": (2, {"pipeline": 2, "first_stage_layers": 1, "last_stage_layers": 3}),
    "ep2_tp2": (2, {"expert": 2, "tensor": 2}),
    "dp2_ep2": (2, {"expert": 2}),
    "ep2_pp2": (4, {"expert": 2, "pipeline": 2}),
    "dp4_ep4": (4, {"expert": 4}),
    "tp2_pp2_ep2": (4, {"tensor": 2, "pipeline": 2, "expert": 2}),
}
# Dropout and router jitter on: their draws are layout-invariant across PP, EP and DP (not TP).
RANDOM = {"model": {"hidden_dropout": 0.1, "attention_dropout": 0.1},
          "moe": {"router": {"score_function": "sigmoid", "input_jitter_eps": 1.0e-2}}}
RANDOM_LAYOUTS = {  # name -> (processes, parallel section, training section)
    "random_reference": (1, {}, {}),
    "random_recompute_full": (1, {}, {"recompute": "full"}),
    "random_pp2": (2, {"pipeline": 2}, {}),
    "random_dp2_ep2": (2, {"expert": 2}, {}),
    "random_ep2_pp2_vpp2": (4, {"expert": 2, "pipeline": 2, "virtual_stages": 2}, {}),
}
# The MLA variant: the same model with multi-head latent attention (DeepSeek-V2's, arXiv
# 2405.04434) instead of multi-head attention, trained from its own one-process reference.
# Its MoE layers are those of 2026 too: latent experts (Nemotron 3, 16 wide in the 32-wide model)
# balanced by quantile balancing (its quantile over the tensor-parallel group's tokens, its
# estimates averaged over the data-parallel replicas).
MLA = {"model": {"position_embedding": "rope", "multi_latent_attention": True, "q_lora_rank": 16,
                 "kv_lora_rank": 8, "qk_head_dim": 8, "qk_pos_emb_head_dim": 4, "v_head_dim": 8},
       "moe": {"experts": {"latent_size": 16},
               "balancing": {"methods": "quantile", "quantile_ema": 0.5}}}
MLA_LAYOUTS = {  # name -> (processes, parallel section, training section)
    # Recomputing the up projections changes nothing, so it rides along with TP (where the
    # recomputation replays the sequence-parallel gathers).
    "mla_tp2_sp_recompute_up_proj": (2, {"tensor": 2}, {"recompute": "selective",
                                                        "recompute_modules": ["mla_up_proj"]}),
    "mla_pp2": (2, {"pipeline": 2}, {}),
    "mla_dp2_ep2": (2, {"expert": 2}, {}),
}
# The multi-token-prediction variant (DeepSeek-V3, arXiv 2412.19437, sec. 2.2): one depth, a
# megamoe layer (global layer 5) on the last pipeline stage, RoPE (the last stage's copy of the
# embedding is then the whole input side it needs), trained from its own one-process reference.
# Its MoE layers are also those of 2026: two zero-computation (identity) experts beside the 4 real
# ones, their bias steering the compute budget, and a DeepSeek-V4 hash layer first (global layer 2,
# routed by the token ids every pipeline stage is handed).
MTP_HASH_LAYER = 2
MTP = {"model": {"mtp_layers": 1, "mtp_loss_weight": 0.3, "position_embedding": "rope"},
       "moe": {"experts": {"zero_experts": 2},
               "layer_overrides": {MTP_HASH_LAYER - 1: {
                   "router": {"kind": "hash", "vocab_size": 512, "score_function": "sigmoid"},
                   "balancing": {"methods": "aux_loss"}, "experts": {"zero_experts": 0}}}}}
MTP_LAYOUTS = {  # name -> (processes, parallel section, training section)
    "mtp_tp2_sp": (2, {"tensor": 2}, {}),
    "mtp_pp2": (2, {"pipeline": 2}, {}),
    "mtp_dp2_ep2": (2, {"expert": 2}, {}),
}
RECOMPUTE = {"recompute_full": {"recompute": "full"},
             "recompute_selective_mlp": {"recompute": "selective",
                                         "recompute_modules": ["core_attn", "layernorm", "mlp"]},
             "recompute_selective_moe": {"recompute": "selective", "recompute_modules": ["moe"]}}


def recording(raw: dict) -> dict:
    """`raw` with its routing recorded in ROUTING_RECORD beside its output."""
    raw["moe"]["router"] = dict(REPLAY_ROUTER)
    raw["training"]["routing_record"] = str(Path(raw["output_dir"]) / ROUTING_RECORD)
    return raw


def replaying(raw: dict, recorded: str) -> dict:
    """`raw` with a 50x faster bias, replaying the routing `recorded` (an output folder) wrote."""
    raw["moe"]["router"] = dict(REPLAY_ROUTER)
    raw["moe"]["balancing"] = dict(FASTER_BIAS)
    raw["training"]["routing_replay"] = str(Path(recorded) / ROUTING_RECORD)
    return raw


def config_dict(data: dict, out: str, parallel: dict, training: dict = None,
                sections: dict = None) -> dict:
    """BASE with `parallel`, `training` settings and other `sections` (name -> settings)."""
    raw = json.loads(json.dumps(BASE))
    raw["output_dir"] = out
    raw["data"] = dict(data)
    raw["data"]["split"] = "90,10,0"
    raw["parallel"] = dict(parallel)
    if parallel.get("pipeline", 1) == 1:  # held-out evaluation runs without pipelining
        raw["evaluation"] = {"interval": STEPS, "batches": 1}
    raw["training"].update(training or {})
    for name, settings in (sections or {}).items():
        raw[name].update(settings)
    if Path(out).name in RESUME_SOURCES:
        raw["checkpoint"]["interval"] = RESUME_AT
    return raw


def _init_process_group() -> None:
    """The job's own process group: every layout's setup_megatron reuses it (and its teardown
    leaves it), so one spawn runs several layouts."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="env://")


def train(raw: dict, snapshot: str = None) -> dict:
    """One training run at `raw`'s layout, as `megamoe.train.loop.run` does it, keeping the
    model long enough to read every rank's expert biases; with `snapshot`, the state it starts
    from (as resumed) is first saved there as a checkpoint of this layout. Every rank returns
    the bytes of optimizer state it holds after the run; rank 0 also the logged curves."""
    from megamoe.megatron.runtime import setup_megatron, teardown_megatron
    from megamoe.plan.state import model_state_bytes
    from megamoe.train import loop
    from megamoe.train.checkpoint import save_checkpoint
    from megamoe.train.config import config_from_dict
    from megamoe.train.signals import StopRequest

    start = time.monotonic()
    config = config_from_dict(raw)
    p = config.parallel
    setup_megatron(tensor_model_parallel_size=p.tensor, pipeline_model_parallel_size=p.pipeline,
                   virtual_pipeline_model_parallel_size=p.virtual_stages,
                   expert_model_parallel_size=p.expert, seed=config.training.seed)
    try:
        run = loop._prepare(config, False, False)
        if snapshot is not None:
            save_checkpoint(snapshot, run.state, run.model, run.engine, config)
        try:
            loop._train(run, StopRequest())
        finally:
            run.logger.close()
        optimizer_bytes = model_state_bytes([run.model], run.engine.optimizer)["optimizer"]
        biases = {f"layer {module.layer_number}": bias.detach().clone()
                  for module in run.model.modules()
                  for bias in [getattr(module, "expert_bias", None),
                               getattr(module, "qb_beta", None)] if bias is not None}
    finally:
        teardown_megatron()
    result = {"biases": biases, "optimizer_bytes": optimizer_bytes,
              "seconds": time.monotonic() - start}
    if dist.get_rank() == 0:
        records = [json.loads(line) for line in
                   (Path(config.output_dir) / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in records if "loss" in r and "event" not in r]
        result.update(steps=[r["step"] for r in steps], losses=[r["loss"] for r in steps],
                      grad_norms=[r["grad_norm"] for r in steps],
                      loads=[[r[k] for k in sorted(r) if k.endswith("/load")] for r in steps],
                      mtp_losses=[r.get("mtp/depth1/loss") for r in steps],
                      max_logits=[max((v for k, v in r.items() if k.endswith("/max_logit")),
                                      default=None) for r in steps],
                      heldout={k: v for k, v in steps[-1].items() if k.startswith("heldout")})
    return result


def resume_folder(source: str, step: int, target: str) -> None:
    """A new output folder whose checkpoint folder holds only `source`'s step-`step` checkpoint
    (so a run there resumes from it)."""
    name = f"iter_{step:07d}"
    ckpts = Path(target) / "checkpoints"
    ckpts.mkdir(parents=True)
    shutil.copytree(Path(source) / "checkpoints" / name, ckpts / name)
    (ckpts / "latest_checkpointed_iteration.txt").write_text(str(step))


def job(rank: int, world_size: int, runs: list[dict]) -> dict:
    """Run every entry of `runs` in order: {"name", "raw"} (a config) and optionally
    "resume_from": (output folder, step) to start from that checkpoint instead, and "snapshot"
    (see `train`)."""
    _init_process_group()
    results = {}
    for entry in runs:
        if "resume_from" in entry:
            if rank == 0:
                resume_folder(*entry["resume_from"], entry["raw"]["output_dir"])
            dist.barrier()
        results[entry["name"]] = train(entry["raw"], entry.get("snapshot"))
    return results


# ---- the single-process job: final-weight comparison ----------------------------------------

def final_weights(raw: dict, folder: str) -> dict:
    """Every parameter and buffer of the single-process model loaded from the checkpoint
    folder `folder` (of any layout)."""
    from megamoe.megatron.runtime import setup_megatron, teardown_megatron
    from megamoe.train.checkpoint import load_model_weights
    from megamoe.train.config import config_from_dict
    from megamoe.train.inputs import data_sources
    from megamoe.train.model import build_model, transformer_config

    config = config_from_dict(raw)
    setup_megatron(seed=config.training.seed)
    try:
        tokenizer = data_sources(config)[1]
        tc = transformer_config(config, False, False)
        (model,) = build_model(config, tc, tokenizer.vocab_size)
        load_model_weights(folder, model, config, tokenizer=tokenizer)
        return {k: v.detach().clone() for k, v in model.state_dict().items()
                if not k.endswith("_extra_state")}
    finally:
        teardown_megatron()


def weights_job(rank: int, world_size: int, runs: list[dict], compare: list[dict],
                vocab_loads: dict = None) -> dict:
    """Run `runs` (as `job`), then load the checkpoint folders of each group of `compare`
    (name -> (raw, folder)) into the single-process model and return the largest difference
    of every parameter and buffer from the group's first entry's; and the vocabulary tensors
    (embedding, output layer) of the single-process model loaded from each of `vocab_loads`
    (name -> (raw, folder))."""
    results = job(rank, world_size, runs) if runs else {}
    results["vocab_loads"] = {
        name: {k: v for k, v in final_weights(raw, folder).items()
               if k.endswith(("word_embeddings.weight", "output_layer.weight"))}
        for name, (raw, folder) in (vocab_loads or {}).items()}
    diffs = {}
    for group in compare:
        weights = {name: final_weights(raw, folder) for name, (raw, folder) in group.items()}
        reference_name, *names = weights
        reference = weights[reference_name]
        for name in names:
            assert weights[name].keys() == reference.keys(), name
            diffs[name] = {key: float((weights[name][key] - value).abs().max())
                           for key, value in reference.items()}
        results.setdefault("reference_bias", {k: v for k, v in reference.items()
                                              if k.endswith(BIAS_KEYS)})
    results["weight_diffs"] = diffs
    return results

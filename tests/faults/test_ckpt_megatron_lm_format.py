"""Checkpoints interchangeable with Megatron-LM, tested against what Megatron-LM's
`megatron/training/checkpointing.py` (core_v0.16.1 and main) reads, reproduced here:

- `read_metadata`: the tracker `latest_checkpointed_iteration.txt` holds an int (or `release`);
  `get_checkpoint_name(..., return_base_dir=True)` is `iter_{:07d}`; `find_checkpoint_rank_0` /
  `_get_checkpoint_format` take a folder with `metadata.json` as torch_dist;
- `_load_base_checkpoint`: `dist_checkpointing.load_common_state_dict` for `args`, then
  `dist_checkpointing.load` of `generate_state_dict`'s request, the model under `model`
  (built from the spec as pretrain_gpt.py builds it, with `metadata={'dp_cp_group': ...}`),
  optimizer and rng_state only when `args.no_save_optim` / `args.no_save_rng` are false;
- `load_checkpoint`: `checkpoint_version`, `iteration`, `num_floating_point_operations_so_far`,
  `check_checkpoint_args` (num_layers, hidden_size, num_attention_heads,
  add_position_embedding), `args.consumed_train_samples`, `load_model_state_dict(strict=True)`.

And the other way: a checkpoint written the way Megatron-LM's `save_checkpoint` writes it
(`generate_state_dict`'s keys, Megatron-LM's rng_state ShardedObject, no manifest) resumes a
`python -m megamoe.train` run and serves as `checkpoint.init_from`.
"""
from __future__ import annotations

import json
import sys
import textwrap

from ckpt_fault_helpers import SMALL_RUN, TINY, run, train, trained_run

__all__ = ["trained_run"]  # fixture

_MEGATRON_LM_READER = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import torch
    from megatron.core import dist_checkpointing, parallel_state
    from megamoe.megatron.runtime import setup_megatron
    from megamoe.train.config import load_config
    from megamoe.train.model import build_model, transformer_config
    from megamoe.checkpointing.dcp_reader import DCPReader

    root, config_path, overrides = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    config = load_config(config_path, overrides)
    setup_megatron(seed=config.training.seed)
    # read_metadata + get_checkpoint_name(return_base_dir=True)
    text = (root / "latest_checkpointed_iteration.txt").read_text().strip()
    folder = root / "iter_{:07d}".format(int(text))
    assert json.loads((folder / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    common = dist_checkpointing.load_common_state_dict(str(folder))
    args = common["args"]
    report = {"iteration": common["iteration"], "version": common["checkpoint_version"],
              "flops": common["num_floating_point_operations_so_far"],
              "scheduler": sorted(common["opt_param_scheduler"]),
              "consumed": getattr(args, "consumed_train_samples", 0),
              "tp_pp": [getattr(args, "tensor_model_parallel_size", 1),
                        getattr(args, "pipeline_model_parallel_size", 1)],
              "no_save_optim": getattr(args, "no_save_optim", False),
              "no_save_rng": getattr(args, "no_save_rng", False),
              "checked": {k: getattr(args, k) for k in
                          ("num_layers", "hidden_size", "num_attention_heads")},
              "add_position_embedding": getattr(args, "add_position_embedding", True),
              "position_embedding_type": getattr(args, "position_embedding_type", None),
              "padded_vocab_size": args.padded_vocab_size,
              "max_position_embeddings": args.max_position_embeddings}
    # the model as pretrain_gpt.py builds it from the checkpoint's args and the spec
    tc = transformer_config(config, False, False)
    (model,) = build_model(config, tc, args.padded_vocab_size)
    request = {"model": model.sharded_state_dict(metadata={
        "dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)})}
    state = dist_checkpointing.load(request, str(folder), strict="assume_ok_unexpected")
    model.load_state_dict(state["model"], strict=True)
    reader = DCPReader(folder)
    embedding = "embedding.word_embeddings.weight"
    report["embedding_equal"] = bool(torch.equal(model.state_dict()[embedding],
                                                 reader.read(embedding)))
    report["keys"] = len(state["model"])
    print("REPORT " + json.dumps(report))
""")


def test_megatron_lm_reads_a_megamoe_checkpoint(trained_run):
    done = run([sys.executable, "-c", _MEGATRON_LM_READER, str(trained_run / "checkpoints"),
                str(TINY), *SMALL_RUN])
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.split("REPORT ", 1)[1])
    assert report["iteration"] == 3 and report["version"] == 3.0 and report["flops"] == 0
    assert report["consumed"] == 3 * 8
    assert report["tp_pp"] == [1, 1]
    assert report["no_save_optim"] and report["no_save_rng"]
    assert report["checked"] == {"num_layers": 4, "hidden_size": 128, "num_attention_heads": 4}
    # the tiny config: rotary positions, no learned position table. check_checkpoint_args
    # compares add_position_embedding with the command line's, whose default (True) is what
    # Megatron-LM's own Mixtral example runs with (--position-embedding-type rope only).
    assert report["position_embedding_type"] == "rope"
    assert report["add_position_embedding"] is True
    assert report["max_position_embeddings"] == 128 and report["padded_vocab_size"] % 128 == 0
    assert {"max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style",
            "num_steps"} <= set(report["scheduler"])
    assert report["embedding_equal"] and report["keys"] > 10


_MEGATRON_LM_WRITER = textwrap.dedent("""
    import argparse, random, sys
    from pathlib import Path
    import numpy as np
    import torch
    from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megamoe.megatron.runtime import setup_megatron
    from megamoe.train.checkpoint import load_model_weights
    from megamoe.train.config import load_config
    from megamoe.train.model import build_model, transformer_config

    source, root, config_path, overrides = (Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3],
                                            sys.argv[4:])
    config = load_config(config_path, overrides)
    setup_megatron(seed=config.training.seed)
    tc = transformer_config(config, False, False)
    (model,) = build_model(config, tc, 4096)
    load_model_weights(source, model, config)
    # generate_state_dict + get_rng_state (torch_dist, EP=1) as Megatron-LM's save writes them
    rng = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
           "torch_rng_state": torch.get_rng_state(),
           "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}
    args = argparse.Namespace(num_layers=4, hidden_size=128, num_attention_heads=4,
                              ffn_hidden_size=512, max_position_embeddings=128,
                              tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                              num_experts=8, consumed_train_samples=32, iteration=4)
    state = {"args": args, "checkpoint_version": 3.0, "iteration": 4,
             "model": model.sharded_state_dict(metadata={
                 "dp_cp_group": parallel_state.get_data_parallel_group(
                     with_context_parallel=True)}),
             "opt_param_scheduler": {"max_lr": 3e-3, "num_steps": 4},
             "rng_state": ShardedObject("rng_state", [rng], (1, 1), (0, 0), replica_id=0),
             "num_floating_point_operations_so_far": 123.0}
    folder = root / "iter_0000004"
    folder.mkdir(parents=True)
    dist_checkpointing.save(state, str(folder))
    (root / "latest_checkpointed_iteration.txt").write_text("4")
""")


def test_a_megatron_lm_checkpoint_resumes_and_initialises(corpus_cache, trained_run, tmp_path):
    root = tmp_path / "run" / "checkpoints"
    made = run([sys.executable, "-c", _MEGATRON_LM_WRITER, str(trained_run / "checkpoints"),
                str(root), str(TINY), *SMALL_RUN])
    assert made.returncode == 0, made.stderr[-4000:]
    resumed = train(corpus_cache, tmp_path / "run", "training.train_steps=5")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "(step 4, 32 samples consumed)" in resumed.stdout
    assert "Megatron-LM checkpoint" in resumed.stderr and "no megamoe_manifest" in resumed.stderr
    steps = [json.loads(line)["step"] for line in
             (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [5]
    started = train(corpus_cache, tmp_path / "fresh", "training.train_steps=1",
                    f"checkpoint.init_from={root}")
    assert started.returncode == 0, started.stderr[-4000:]
    assert "starting from the weights of" in started.stdout

"""Everything megamoe reads and writes as a checkpoint, in one package (on `megamoe.megatron`'s
version table, below the trainer and the converters).

- `layout`: Megatron-LM's directory layout (the tracker file, `iter_N` and `release` folders).
- `sharded_keys`: Megatron-Core's sharded keys and objects of a GPT's layers.
- `torch_files`, `safe_dcp`: `torch.save` data and DCP metadata loaded weights_only with
  Megatron-LM's metadata types on an explicit allow-list; Megatron-Core's
  `dist_checkpointing.load` with every pickle restricted.
- `manifest`, `no_orphans`: per-file checksums; the writer helper process that dies with its rank.
- `readers`: the `READERS` registry (torch_dist `dist_source`, legacy per-rank `legacy_source`,
  Hugging Face safetensors `hf_source` with `hf_arch` and `safetensors_io`, Megatron-DeepSpeed
  `deepspeed_source`), each behind the layer-by-layer interface of `source`; `dcp_reader` and
  `dcp_writer` stream DCP checkpoints one layer at a time.
"""

"""Checkpoint reading and integrity shared by training and upcycling.

- `torch_files`: `torch.save` data (common.pt, legacy per-rank files, sharded objects) loaded
  weights_only with Megatron-LM's metadata types on an explicit allow-list.
- `safe_dcp`: DCP `.metadata` and Megatron-Core's `dist_checkpointing.load` with every pickle
  restricted.
"""

"""Interoperability with the checkpoints people have (converters on top of `megamoe.checkpointing`'s
readers and writer).

- `hf_dense`: a dense Hugging Face model into a dense Megatron-Core checkpoint.
- `hf_import`: released Hugging Face MoE models (every architecture with a two-way table in
  `megamoe.checkpointing.hf`) into megamoe checkpoints (tools/import_hf.py).
- `hf_export`: megamoe MoE checkpoints written as Hugging Face models of those architectures,
  through the same tables (tools/export_hf.py); `hf_config` their config.json.
- `deepspeed_import`, `deepspeed_moe`: Megatron-DeepSpeed MoE checkpoints into megamoe's, checked
  against DeepSpeed's own MoE layer (tools/import_deepspeed_moe.py).
"""

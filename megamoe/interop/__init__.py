"""Interoperability with the checkpoints people have (converters on top of `megamoe.checkpointing`'s
readers and writer).

- `hf_dense`: a dense Hugging Face model into a dense Megatron-Core checkpoint.
- `hf_import`: released Hugging Face MoE models (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3)
  into megamoe checkpoints (tools/import_hf.py).
- `hf_export`: megamoe MoE checkpoints written as Hugging Face Mixtral, Qwen2-MoE, Qwen3-MoE or
  DeepSeek-V3 models (tools/export_hf.py).
- `deepspeed_import`, `deepspeed_moe`: Megatron-DeepSpeed MoE checkpoints into megamoe's, checked
  against DeepSpeed's own MoE layer (tools/import_deepspeed_moe.py).
"""

"""Interoperability with the checkpoints people have (converters on top of `megamoe.checkpointing`'s
readers and writer).

- `hf_dense`: a dense Hugging Face model into a dense Megatron-Core checkpoint.
- `hf_export`: megamoe MoE checkpoints written as Hugging Face Mixtral, Qwen2-MoE or Qwen3-MoE
  models (tools/export_hf.py).
- `deepspeed_import`, `deepspeed_moe`: Megatron-DeepSpeed MoE checkpoints into megamoe's, checked
  against DeepSpeed's own MoE layer (tools/import_deepspeed_moe.py).
"""

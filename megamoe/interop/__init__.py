"""Interoperability with the checkpoints people have.

- `hf_arch`, `hf_source`, `safetensors_io`: dense Hugging Face models (Llama, Mistral, Qwen2,
  Qwen3) read layer by layer as an upcycling source (tools/upcycle_ckpt.py --load HF_DIR).
- `hf_export`: megamoe MoE checkpoints written as Hugging Face Mixtral, Qwen2-MoE or Qwen3-MoE
  models (tools/export_hf.py).
- `logits`: Hugging Face (transformers) logits against a megamoe checkpoint's, for `--verify`.
"""

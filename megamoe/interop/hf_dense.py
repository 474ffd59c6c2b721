"""Plain dense conversion: a Hugging Face model (Llama, Mistral, Qwen2, Qwen3) into a dense
Megatron-Core torch_dist checkpoint, for continuing dense pretraining with Megatron-LM first.

The same layer-by-layer stream as the upcycler (megamoe.checkpointing.hf_source ->
megamoe.checkpointing.dcp_writer), stacked keys, and Megatron-LM's `args` in the common state (so
`--use-checkpoint-args` and a later `tools/upcycle_ckpt.py --load OUT --verify` find the head
counts, RoPE and norm settings). `verify` compares the Hugging Face model's logits with
Megatron-Core's own dense GPTModel (local spec, CPU, fp32) loaded from the output.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Callable, Optional

from megamoe.atomic import atomic_directory
from megamoe.checkpointing.dcp_writer import StreamingCheckpointWriter
from megamoe.checkpointing.hf_arch import megatron_lm_rotary_base
from megamoe.checkpointing.hf_source import HFSource
from megamoe.checkpointing.layout import RELEASE, TRACKER
from megamoe.checkpointing.manifest import write_manifest
from megamoe.checkpointing.readers import open_checkpoint
from megamoe.checkpointing.sharded_keys import KeyLayout, whole_tensor
from megamoe.paths import refuse_overlap
from megamoe.upcycle.convert import VERIFY_TOLERANCE
from megamoe.upcycle.hf_files import carry_hf_files, hf_origin, tokenizer_line
from megamoe.upcycle.hf_logits import require_within
from megamoe.upcycle.moe_layer import dense_layer_items


def megatron_lm_args(source: HFSource) -> argparse.Namespace:
    """Megatron-LM's arguments of the converted dense model."""
    a = source.arch
    return argparse.Namespace(
        num_layers=a.num_layers, hidden_size=a.hidden_size, ffn_hidden_size=a.intermediate_size,
        num_attention_heads=a.num_attention_heads, num_query_groups=a.num_key_value_heads,
        group_query_attention=a.num_key_value_heads != a.num_attention_heads,
        kv_channels=a.head_dim, max_position_embeddings=a.max_position_embeddings,
        position_embedding_type="rope", rotary_base=megatron_lm_rotary_base(a.rope_theta), rotary_percent=1.0,
        use_rope_scaling=a.rope_scaling_factor is not None,
        rope_scaling_factor=a.rope_scaling_factor or 8.0, normalization="RMSNorm",
        norm_epsilon=a.rms_norm_eps, swiglu=True, add_bias_linear=False,
        add_qkv_bias=a.qkv_bias, qk_layernorm=a.qk_norm,
        untie_embeddings_and_output_weights=not a.tie_word_embeddings,
        padded_vocab_size=a.vocab_size)


def megatron_lm_flags(args: argparse.Namespace) -> str:
    """The Megatron-LM command-line flags of the converted model."""
    flags = [f"--num-layers {args.num_layers}", f"--hidden-size {args.hidden_size}",
             f"--ffn-hidden-size {args.ffn_hidden_size}",
             f"--num-attention-heads {args.num_attention_heads}",
             f"--kv-channels {args.kv_channels}", "--position-embedding-type rope",
             f"--rotary-base {args.rotary_base}", "--normalization RMSNorm",
             f"--norm-epsilon {args.norm_epsilon}", "--swiglu", "--disable-bias-linear"]
    if args.group_query_attention:
        flags += ["--group-query-attention", f"--num-query-groups {args.num_query_groups}"]
    if args.use_rope_scaling:
        flags += ["--use-rope-scaling", f"--rope-scaling-factor {args.rope_scaling_factor}"]
    flags += ["--add-qkv-bias"] if args.add_qkv_bias else []
    flags += ["--qk-layernorm"] if args.qk_layernorm else []
    flags += ["--untie-embeddings-and-output-weights"] if args.untie_embeddings_and_output_weights \
        else []
    return " ".join(flags)


def convert_hf_dense(load, save, overwrite: bool = False, verify: bool = False,
                     log: Callable[[str], None] = print,
                     owner: str = "upcycle_ckpt") -> Optional[float]:
    """Write the Hugging Face model at `load` as a dense Megatron-Core checkpoint at `save`
    (Megatron-LM layout: tracker + `release/`, marked as the tool `owner`'s); returns the
    verify figure when asked."""
    load = Path(load)
    refuse_overlap(save, [load])
    source = open_checkpoint(load, "hf_safetensors")
    origin = hf_origin(load, save, f"tools/{owner}.py", source.description, source.arch,
                       {"tool": "megamoe.interop.hf_dense", "source": str(load.resolve())})
    layout = KeyLayout("stacked", source.num_layers)
    start = time.perf_counter()
    with atomic_directory(save, overwrite=overwrite, owner=owner) as tmp:
        checkpoint_dir = tmp / RELEASE
        checkpoint_dir.mkdir()
        writer = StreamingCheckpointWriter(checkpoint_dir)
        for index in range(source.num_layers):
            writer.write_part(*dense_layer_items(layout, index, source.layer(index)))
        writer.write_part([whole_tensor(key, t) for key, t in source.non_layer_tensors()])
        args = megatron_lm_args(source)
        carried = carry_hf_files(origin, checkpoint_dir)
        writer.finish({"checkpoint_version": 3.0, "iteration": 0, "args": args, **carried})
        write_manifest(checkpoint_dir)
        (tmp / TRACKER).write_text(RELEASE)
        log(f"converted {source.description} to a dense Megatron-Core checkpoint: "
            f"{writer.bytes_written / 2**20:.1f} MiB in {time.perf_counter() - start:.1f} s")
        log(tokenizer_line(origin, "Megatron-LM's --tokenizer-model takes it"))
        log(f"train with Megatron-LM: {megatron_lm_flags(args)}")
        diff = _verify(source, checkpoint_dir, log) if verify else None
    return diff


def _verify(source: HFSource, checkpoint_dir: Path, log: Callable[[str], None]) -> float:
    from megatron.core import parallel_state

    from megamoe.upcycle.hf_logits import hf_logits, load_hf_model, sample_tokens
    from megamoe.megatron.runtime import setup_megatron, teardown_megatron
    from megamoe.upcycle.arch import dense_arch
    from megamoe.checkpointing.dist_source import DistSource
    from megamoe.upcycle.verify import build_reference_gpt, gpt_logits, load_dist_weights

    hf = load_hf_model(source.directory)
    tokens = sample_tokens(hf.config.vocab_size)
    reference = hf_logits(hf, tokens)
    del hf
    output = DistSource(checkpoint_dir)
    a = source.arch
    record = {"hidden_size": a.hidden_size, "dense_ffn_hidden_size": a.intermediate_size,
              "gated": True, "activation": "swiglu"}
    arch = dense_arch(output, record, {})  # every setting from the args written above
    own_state = not parallel_state.model_parallel_is_initialized()
    if own_state:
        setup_megatron()
    try:
        model = build_reference_gpt(arch, None)
        load_dist_weights(model, checkpoint_dir, "stacked")
        diff = float((reference - gpt_logits(model, tokens)).abs().max())
    finally:
        if own_state:
            teardown_megatron()
    log(f"verify: max |logit diff| Hugging Face vs Megatron-Core dense = {diff:.3e} "
        f"(bar {VERIFY_TOLERANCE:.0e})")
    require_within(diff, VERIFY_TOLERANCE, "logit")
    return diff

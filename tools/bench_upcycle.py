"""Benchmark the upcycler on a ~1B-parameter dense checkpoint.

    python tools/bench_upcycle.py --workdir /scratch/bench [--source megatron|hf] [--experts 8]
                                  [--results bench.json]

1. Builds a dense model (fp32, random init; default 18 layers, hidden 2048, SwiGLU FFN 5632,
   vocab 32000: about 1.06B parameters), unless `--workdir` already holds it, in its own child
   process: `--source megatron` (default) a Megatron-Core GPTModel saved with
   `dist_checkpointing.save` (torch_dist); `--source hf` a Hugging Face Llama (transformers,
   grouped-query attention with 4 KV heads) saved as 1 GB safetensors shards.
2. Runs `tools/upcycle_ckpt.py` on it in a child process (default: 8 experts, top-2, plain copy)
   and reads that process's peak RSS from the kernel (`wait4` rusage, ru_maxrss). The kernel
   counts the parent's resident memory at fork time into a child's ru_maxrss, so this process
   stays small: it never imports torch.
3. Reports wall time (whole process, and the conversion itself from the converter's per-part
   metrics), output size, MB/s written and peak RSS, checks the bar
   peak RSS < output size / 2, writes the figures as JSON (`--results`) and the per-layer metrics
   the converter wrote (`upcycle_metrics.jsonl`) stay next to them. The output checkpoint is
   deleted afterwards unless `--keep`.

Exit code 1 if the bar is missed.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "upcycle_ckpt.py"


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def make_dense_checkpoint(directory: Path, layers: int, hidden: int, ffn: int, heads: int,
                          vocab: int) -> int:
    """Save a random-init fp32 dense GPT with Megatron-Core; returns its parameter count."""
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    import torch
    import torch.nn.functional as F
    from megatron.core import dist_checkpointing
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megamoe.megatron.cpu import cpu_transformer_config
    from megamoe.megatron.runtime import setup_megatron, teardown_megatron

    setup_megatron(seed=1)
    try:
        config = cpu_transformer_config(num_layers=layers, hidden_size=hidden,
                                        num_attention_heads=heads, ffn_hidden_size=ffn,
                                        gated_linear_unit=True, activation_func=F.silu,
                                        normalization="RMSNorm")
        with torch.no_grad():
            model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(
                normalization="RMSNorm"), vocab_size=vocab, max_sequence_length=4096,
                pre_process=True, post_process=True, position_embedding_type="rope",
                share_embeddings_and_output_weights=False)
        params = sum(p.numel() for p in model.parameters())
        tmp = directory.with_name(directory.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        args = argparse.Namespace(num_attention_heads=heads, swiglu=True, num_layers=layers)
        dist_checkpointing.save({"model": model.sharded_state_dict(), "args": args,
                                 "iteration": 1, "checkpoint_version": 3.0}, str(tmp))
        os.replace(tmp, directory)
        (directory / "params.txt").write_text(str(params))
        return params
    finally:
        teardown_megatron()


def make_hf_checkpoint(directory: Path, layers: int, hidden: int, ffn: int, heads: int,
                       vocab: int) -> int:
    """Save a random-init fp32 Hugging Face Llama; returns its parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=4, rope_theta=500000.0, tie_word_embeddings=False)
    torch.manual_seed(1)
    model = LlamaForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp), max_shard_size="1GB")
    os.replace(tmp, directory)
    (directory / "params.txt").write_text(str(params))
    return params


def run_converter(dense: Path, output: Path, experts: int, topk: int,
                  granularity: int) -> tuple[float, int, int]:
    """(wall seconds, peak RSS bytes, exit code) of one converter process."""
    command = [sys.executable, str(TOOL), "--load", str(dense), "--save", str(output),
               "--num-experts", str(experts), "--topk", str(topk), "--granularity",
               str(granularity), "--overwrite"]
    start = time.perf_counter()
    proc = subprocess.Popen(command)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    return seconds, usage.ru_maxrss * 1024, os.waitstatus_to_exitcode(status)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", required=True, type=Path)
    p.add_argument("--source", choices=("megatron", "hf"), default="megatron",
                   help="dense checkpoint format: Megatron torch_dist or Hugging Face")
    p.add_argument("--layers", type=int, default=18)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=5632)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--granularity", type=int, default=1)
    p.add_argument("--results", type=Path, default=None, help="write the figures as JSON here")
    p.add_argument("--keep", action="store_true", help="keep the MoE output checkpoint")
    p.add_argument("--make-dense-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    dense = args.workdir / ("dense" if args.source == "megatron" else "dense_hf")
    if args.make_dense_only:
        make = make_dense_checkpoint if args.source == "megatron" else make_hf_checkpoint
        make(dense, args.layers, args.hidden, args.ffn, args.heads, args.vocab)
        return 0
    if not (dense / "params.txt").exists():
        print(f"building the dense checkpoint in {dense} ...", flush=True)
        start = time.perf_counter()
        subprocess.run([sys.executable, __file__, "--make-dense-only", *(argv or sys.argv[1:])],
                       check=True)
        print(f"  done in {time.perf_counter() - start:.0f} s", flush=True)
    params = int((dense / "params.txt").read_text())
    output = args.workdir / "moe"
    seconds, peak_rss, code = run_converter(dense, output, args.experts, args.topk,
                                            args.granularity)
    if code != 0:
        print(f"error: the converter exited with code {code}", file=sys.stderr)
        return 2
    out_bytes = directory_bytes(output)
    parts = [json.loads(line) for line in (output / "upcycle_metrics.jsonl").read_text()
             .splitlines()]
    convert_seconds = sum(part["seconds"] for part in parts)
    figures = {
        "source": args.source, "dense_parameters": params, "dense_bytes": directory_bytes(dense),
        "experts": args.experts, "topk": args.topk, "granularity": args.granularity,
        "wall_seconds": round(seconds, 2), "convert_seconds": round(convert_seconds, 2),
        "output_bytes": out_bytes, "mb_per_s_written": round(out_bytes / 1e6 / seconds, 1),
        "mb_per_s_during_conversion": round(out_bytes / 1e6 / convert_seconds, 1),
        "peak_rss_bytes": peak_rss, "peak_rss_over_output": round(peak_rss / out_bytes, 4),
        "bar_peak_rss_below_half_output": peak_rss < out_bytes / 2,
        "cpu_count": os.cpu_count(),
    }
    print(json.dumps(figures, indent=2))
    if args.results:
        args.results.write_text(json.dumps(figures, indent=2) + "\n")
        shutil.copy(output / "upcycle_metrics.jsonl",
                    args.results.with_name(args.results.stem + "_layers.jsonl"))
    if not args.keep:
        shutil.rmtree(output)
    return 0 if figures["bar_peak_rss_below_half_output"] else 1


if __name__ == "__main__":
    sys.exit(main())

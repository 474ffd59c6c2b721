"""Benchmark the upcycler, or the Hugging Face MoE importer, on a ~1B-parameter checkpoint.

    python tools/bench_upcycle.py --workdir /scratch/bench [--source megatron|hf|hf_moe]
                                  [--experts N] [--results bench.json]

1. Builds the source checkpoint (fp32, random init), unless `--workdir` already holds it, in its
   own child process:
   - `--source megatron` (default): a dense Megatron-Core GPTModel (default 18 layers, hidden
     2048, SwiGLU FFN 5632, vocab 32000: about 1.06B parameters) saved with
     `dist_checkpointing.save` (torch_dist);
   - `--source hf`: the same dense shape as a Hugging Face Llama (transformers, grouped-query
     attention with 4 KV heads) saved as 1 GB safetensors shards;
   - `--source hf_moe`: a DeepSeek-V3-shaped Hugging Face MoE model (transformers; default
     9 layers of which the first is dense (FFN 5632), hidden 2048, 16 heads of multi-head latent
     attention with q/kv ranks 768/512, 64 routed experts of FFN 256 in 8 groups (4 chosen,
     top-8), one shared expert, a non-zero correction bias, vocab 32000: about 1.09B
     parameters) saved as 1 GB safetensors shards (building it peaks near 7 GB of memory).
2. Converts it in a child process and reads that process's peak RSS from the kernel (`wait4`
   rusage, ru_maxrss): `tools/upcycle_ckpt.py` for the dense sources (default 8 experts, top-2,
   plain copy), `tools/import_hf.py` for `hf_moe` (whose `--experts`/`--topk` shape the source
   model instead). The kernel counts the parent's resident memory at fork time into a child's
   ru_maxrss, so this process stays small: it never imports torch.
3. Reports wall time (whole process, and the conversion itself from the converter's per-part
   metrics), output size, MB/s written and peak RSS, checks the bar
   peak RSS < output size / 2, writes the figures as JSON (`--results`) and the per-layer metrics
   the converter wrote (`upcycle_metrics.jsonl` or `import_metrics.jsonl`) next to them. The
   output checkpoint is deleted afterwards unless `--keep`. `--workdir` is marked as the
   benchmark's (megamoe.ownership): a folder of anyone else's is refused in one line.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from megamoe.atomic import atomic_write_text
from megamoe.bounded import read_bounded
from megamoe.errors import CliArgumentParser, ConfigError, int_at_least, run_cli
from megamoe.ownership import check_file_output, check_folder_output, claim_folder

ROOT = Path(__file__).resolve().parents[1]
TOOL = "bench_upcycle"
HF_SHARD_SIZE = "1GB"
MAX_METRICS_BYTES = 64 << 20  # the converter's per-layer timing lines
DEEPSEEK_V3_SHAPE = dict(q_lora_rank=768, kv_lora_rank=512, qk_nope_head_dim=128,
                         qk_rope_head_dim=64, v_head_dim=128, n_group=8, topk_group=4,
                         n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5)
"""The `--source hf_moe` model's fixed DeepSeek-V3 settings: V3's head dimensions, kv rank, expert
groups and gate scale; its q rank halved (V3: 1536); one dense layer (V3: 3)."""


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def publish(tmp: Path, directory: Path, params: int) -> int:
    """Move a finished checkpoint from `tmp` into place with its parameter count."""
    os.replace(tmp, directory)
    (directory / "params.txt").write_text(str(params))
    return params


def make_megatron_dense(directory: Path, tmp: Path, args: argparse.Namespace) -> int:
    """Save a random-init fp32 dense GPT with Megatron-Core; returns its parameter count."""
    import torch
    import torch.nn.functional as F
    from megatron.core import dist_checkpointing
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megamoe.megatron.cpu import cpu_transformer_config
    from megamoe.megatron.runtime import setup_megatron, teardown_megatron

    setup_megatron(seed=1)
    try:
        config = cpu_transformer_config(num_layers=args.layers, hidden_size=args.hidden,
                                        num_attention_heads=args.heads, ffn_hidden_size=args.ffn,
                                        gated_linear_unit=True, activation_func=F.silu,
                                        normalization="RMSNorm")
        with torch.no_grad():
            model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(
                normalization="RMSNorm"), vocab_size=args.vocab, max_sequence_length=4096,
                pre_process=True, post_process=True, position_embedding_type="rope",
                share_embeddings_and_output_weights=False)
        params = sum(p.numel() for p in model.parameters())
        tmp.mkdir(parents=True)
        saved_args = argparse.Namespace(num_attention_heads=args.heads, swiglu=True,
                                        num_layers=args.layers)
        dist_checkpointing.save({"model": model.sharded_state_dict(), "args": saved_args,
                                 "iteration": 1, "checkpoint_version": 3.0}, str(tmp))
        return publish(tmp, directory, params)
    finally:
        teardown_megatron()


def save_hf(config, directory: Path, tmp: Path) -> int:
    """Build a random-init fp32 transformers model from `config` and save it as safetensors
    shards (a non-zero correction bias where it has one, as a trained DeepSeek-V3 has)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0, 0.1)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(str(tmp), max_shard_size=HF_SHARD_SIZE)
    return publish(tmp, directory, params)


def make_hf_llama(directory: Path, tmp: Path, args: argparse.Namespace) -> int:
    """Save a random-init fp32 Hugging Face Llama; returns its parameter count."""
    from transformers import LlamaConfig

    return save_hf(LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=4,
        rope_theta=500000.0, tie_word_embeddings=False), directory, tmp)


def make_hf_deepseek_v3(directory: Path, tmp: Path, args: argparse.Namespace) -> int:
    """Save a random-init fp32 DeepSeek-V3-shaped Hugging Face MoE model; returns its parameter
    count."""
    from transformers import DeepseekV3Config

    return save_hf(DeepseekV3Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.heads, n_routed_experts=args.experts,
        num_experts_per_tok=args.topk, moe_intermediate_size=args.expert_ffn,
        num_nextn_predict_layers=0, tie_word_embeddings=False, **DEEPSEEK_V3_SHAPE),
        directory, tmp)


def upcycle_args(args: argparse.Namespace) -> list[str]:
    return ["--num-experts", str(args.experts), "--topk", str(args.topk), "--granularity",
            str(args.granularity)]


@dataclass(frozen=True)
class Source:
    """A benchmarked input: how it is built and which tool converts it."""

    directory: str                       # under --workdir
    make: Callable[[Path, Path, argparse.Namespace], int]   # (directory, tmp, args) -> params
    tool: str                            # under tools/
    tool_args: Callable[[argparse.Namespace], list[str]]
    metrics_file: str                    # per-part metrics the tool writes into its output
    defaults: dict                       # for the shape options left unset


DENSE_DEFAULTS = dict(layers=18, experts=8, topk=2)
SOURCES = {
    "megatron": Source("dense", make_megatron_dense, "upcycle_ckpt.py", upcycle_args,
                       "upcycle_metrics.jsonl", DENSE_DEFAULTS),
    "hf": Source("dense_hf", make_hf_llama, "upcycle_ckpt.py", upcycle_args,
                 "upcycle_metrics.jsonl", DENSE_DEFAULTS),
    "hf_moe": Source("moe_hf", make_hf_deepseek_v3, "import_hf.py", lambda args: [],
                     "import_metrics.jsonl", dict(layers=9, experts=64, topk=8)),
}


def build_source(source: Source, directory: Path, args: argparse.Namespace) -> int:
    """Build the source checkpoint into `directory` (through a temporary sibling)."""
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    return source.make(directory, tmp, args)


def run_converter(command: list[str]) -> tuple[float, int, int]:
    """(wall seconds, peak RSS bytes, exit code) of one converter process."""
    start = time.perf_counter()
    proc = subprocess.Popen(command)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    return seconds, usage.ru_maxrss * 1024, os.waitstatus_to_exitcode(status)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = CliArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", required=True, type=Path)
    p.add_argument("--source", choices=tuple(SOURCES), default="megatron",
                   help="megatron: dense torch_dist, upcycled; hf: dense Hugging Face Llama, "
                        "upcycled; hf_moe: DeepSeek-V3-shaped Hugging Face MoE, imported with "
                        "tools/import_hf.py")
    p.add_argument("--layers", type=int_at_least(1), default=None, help="default 18 (hf_moe: 9)")
    p.add_argument("--hidden", type=int_at_least(1), default=2048)
    p.add_argument("--ffn", type=int_at_least(1), default=5632,
                   help="dense FFN (hf_moe: its dense layer)")
    p.add_argument("--heads", type=int_at_least(1), default=16)
    p.add_argument("--vocab", type=int_at_least(1), default=32000)
    p.add_argument("--experts", type=int_at_least(1), default=None,
                   help="experts of the upcycled model, default 8 (hf_moe: routed experts of "
                        "the source, default 64)")
    p.add_argument("--topk", type=int_at_least(1), default=None, help="default 2 (hf_moe: 8)")
    p.add_argument("--granularity", type=int_at_least(1), default=1, help="upcycling only")
    p.add_argument("--expert-ffn", type=int_at_least(1), default=256,
                   help="hf_moe only: expert FFN size")
    p.add_argument("--results", type=Path, default=None, help="write the figures as JSON here")
    p.add_argument("--keep", action="store_true", help="keep the output checkpoint")
    p.add_argument("--build-source-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name, value in SOURCES[args.source].defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.topk > args.experts:  # refused here, not after the source is built
        raise ConfigError(f"--topk {args.topk} exceeds --experts {args.experts}; choose "
                          "topk <= experts")
    check_folder_output(args.workdir, TOOL, "--workdir")
    if args.results is not None:
        for path in (args.results, layers_file(args.results)):
            check_file_output(path, "--results", [args.workdir])
    return args


def layers_file(results: Path) -> Path:
    """Where the converter's per-layer metrics are copied: beside `--results`."""
    return results.with_name(results.stem + "_layers.jsonl")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    source = SOURCES[args.source]
    load = claim_folder(args.workdir, TOOL, "--workdir") / source.directory
    if args.build_source_only:
        build_source(source, load, args)
        return 0
    if not (load / "params.txt").exists():
        print(f"building the source checkpoint in {load} ...", flush=True)
        start = time.perf_counter()
        subprocess.run([sys.executable, __file__, "--build-source-only",
                        *(sys.argv[1:] if argv is None else argv)], check=True)
        print(f"  done in {time.perf_counter() - start:.0f} s", flush=True)
    params = int(read_bounded(load / "params.txt", 64, ConfigError, str(load / "params.txt")))
    output = args.workdir / "moe"
    command = [sys.executable, str(ROOT / "tools" / source.tool), "--load", str(load), "--save",
               str(output), "--overwrite", *source.tool_args(args)]
    seconds, peak_rss, code = run_converter(command)
    if code != 0:
        print(f"error: {source.tool} exited with code {code}", file=sys.stderr)
        return 2
    out_bytes = directory_bytes(output)
    metrics = read_bounded(output / source.metrics_file, MAX_METRICS_BYTES, ConfigError,
                           str(output / source.metrics_file))
    parts = [json.loads(line) for line in metrics.splitlines()]
    convert_seconds = sum(part["seconds"] for part in parts)
    shape = {"experts": args.experts, "topk": args.topk}
    shape.update({"expert_ffn": args.expert_ffn} if args.source == "hf_moe" else
                 {"granularity": args.granularity})
    figures = {
        "source": args.source, "tool": source.tool, "source_parameters": params,
        "source_bytes": directory_bytes(load), **shape,
        "wall_seconds": round(seconds, 2), "convert_seconds": round(convert_seconds, 2),
        "output_bytes": out_bytes, "mb_per_s_written": round(out_bytes / 1e6 / seconds, 1),
        "mb_per_s_during_conversion": round(out_bytes / 1e6 / convert_seconds, 1),
        "peak_rss_bytes": peak_rss, "peak_rss_over_output": round(peak_rss / out_bytes, 4),
        "bar_peak_rss_below_half_output": peak_rss < out_bytes / 2,
        "cpu_count": os.cpu_count(),
    }
    print(json.dumps(figures, indent=2))
    if args.results:
        atomic_write_text(args.results, json.dumps(figures, indent=2) + "\n")
        atomic_write_text(layers_file(args.results), metrics)
    if not args.keep:
        shutil.rmtree(output)
    return 0 if figures["bar_peak_rss_below_half_output"] else 1


if __name__ == "__main__":
    run_cli(main)

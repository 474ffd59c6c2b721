"""Export a megamoe MoE checkpoint as a Hugging Face model of an architecture megamoe has a table
for (megamoe.checkpointing.hf: Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3, GLM-4.5, ...).

    python tools/export_hf.py --load CKPT --save OUT [--arch ARCH] [--tokenizer TOKENIZER]
        [--verify]

CKPT: a megamoe training checkpoint (a run's checkpoint folder, or its checkpoints/ directory)
or the output of tools/upcycle_ckpt.py or tools/import_hf.py. Writes safetensors shards with
their index, the tokenizer the checkpoint records (its `tokenizer/` folder; --tokenizer only
names the same tokenizer elsewhere, another one is refused), and config.json and
generation_config.json: for an imported model the source's own with only the keys training
changed, each named in the output; else generated from the settings (bos/eos ids from the
tokenizer, the context it was trained for, its rope scaling and balance-loss weight). The
default --arch (its choices: `--help`) is the source model's, else the first that expresses the
model; settings the architecture cannot express (sigmoid routing in Mixtral, top-p, dense
layers in Mixtral, attention sinks outside GPT-OSS, ...) are refused in one line.
`--verify` loads OUT with transformers on CPU, checks its logits against megamoe's (max
|difference| <= 1e-4 in fp32) and runs `generate`. Bad input: one line on stderr, exit code 2,
no output left behind. OUT holds only the model's files, ready to upload: the mark that lets
--overwrite replace it (megamoe.ownership) lies beside it, as `.OUT.megamoe-owner`.
"""
from __future__ import annotations

import argparse
import warnings

# megatron-core warns on import that Transformer Engine and Apex are absent: not the user's
# concern here, and it would bury the one-line error of bad input.
warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")

from megamoe.errors import CliArgumentParser, int_at_least, run_cli  # noqa: E402
from megamoe.ownership import check_folder_output  # noqa: E402
from megamoe.interop.hf_export import ARCHS, export_hf  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = CliArgumentParser(description=__doc__.split("\n\n")[0], prog="export_hf.py")
    p.add_argument("--load", required=True, help="megamoe MoE checkpoint")
    p.add_argument("--save", required=True, help="output Hugging Face model directory")
    p.add_argument("--arch", choices=ARCHS, default=None, help="target architecture")
    p.add_argument("--tokenizer", default=None,
                   help="the checkpoint's tokenizer from elsewhere (folder or file; default: "
                        "the one the checkpoint holds)")
    p.add_argument("--max-shard-size-mb", type=int_at_least(1), default=2048,
                   help="safetensors shard size")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --save")
    p.add_argument("--verify", action="store_true",
                   help="compare transformers' logits with megamoe's and run generate")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_folder_output(args.save, "export_hf", "--save", [args.load, args.tokenizer],
                        args.overwrite)
    result = export_hf(args.load, args.save, arch=args.arch, tokenizer=args.tokenizer,
                       overwrite=args.overwrite, verify=args.verify,
                       max_shard_bytes=args.max_shard_size_mb * 2**20)
    print(f"Hugging Face {result.arch} model: {result.output} ({len(result.shards)} shards)")
    if result.max_logit_diff is not None:
        print(f"max |logit diff| megamoe vs transformers: {result.max_logit_diff:.3e}")
    return 0


if __name__ == "__main__":
    run_cli(main)

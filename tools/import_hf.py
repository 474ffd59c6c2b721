"""Import a Hugging Face model (the MoE architectures of megamoe.checkpointing.hf: Mixtral,
Qwen2-MoE, Qwen3-MoE, DeepSeek-V3 and Kimi-K2, GLM-4.5, MiniMax-M2, GPT-OSS; dense Llama, Mistral,
Qwen2, Qwen3) as a megamoe checkpoint, to continue its pretraining at any layout.

    python tools/import_hf.py --load HF_DIR --save OUT [--verify] [--drop-mtp] [--overwrite]
                              [--dtype bf16|fp16|fp32]

HF_DIR: config.json and safetensors (sharded or not), and the model's tokenizer (tokenizer.json or
tokenizer.model, with tokenizer_config.json / special_tokens_map.json / generation_config.json).
OUT: a torch_dist checkpoint in Megatron-LM's layout (`OUT/release/`, holding the tokenizer in
`release/tokenizer/` and the source's config.json and generation_config.json in
`release/hf_source/`) and `OUT/train_config.yaml`: the model, its tokenizer (`data.tokenizer`), its
context length (capped for a CPU) and continued-pretraining settings, each with a comment. Train
it with the command printed (`python -m megamoe.train --config OUT/train_config.yaml`, which
sets `checkpoint.init_from=OUT`: the default corpus tokenized with the model's tokenizer, or
`data.prefixes` made with `tools/preprocess_data.py --tokenizer OUT/release/tokenizer`) and write
it back with `tools/export_hf.py --load RUN/checkpoints --save HF_OUT` (the tokenizer and the
source's config come along). Dense models
are converted as `tools/upcycle_ckpt.py --dense` does. The conversion streams one layer at a time,
with a progress bar (stderr). Quantised releases import as they ship: FP8 block-scaled weights
(DeepSeek-V3, Kimi-K2, MiniMax-M2) and MXFP4 experts (GPT-OSS) are dequantised while they stream,
as the releases' own conversions define it (megamoe.checkpointing.quantized), into `--dtype`
(default: the dtype of the model's unquantised tensors, e.g. its embeddings). `--verify` compares
transformers' logits (fp32, CPU; on the weights as imported, dequantised or cast to --dtype) with
megamoe's (max |difference| <= 1e-4). What megamoe cannot express, and bad input, give one line on
stderr and exit code 2, and leave no output behind.
"""
from __future__ import annotations

import argparse
import warnings

# megatron-core warns on import that Transformer Engine and Apex are absent: not the user's
# concern here, and it would bury the one-line error of bad input.
warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")

from megamoe.checkpointing.quantized import DTYPES  # noqa: E402
from megamoe.errors import CliArgumentParser, run_cli  # noqa: E402
from megamoe.ownership import check_folder_output  # noqa: E402
from megamoe.interop.hf_import import import_hf  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = CliArgumentParser(description=__doc__.split("\n\n")[0], prog="import_hf.py")
    p.add_argument("--load", required=True, help="Hugging Face model directory")
    p.add_argument("--save", required=True, help="output directory (Megatron-LM layout)")
    p.add_argument("--verify", action="store_true",
                   help="compare transformers' logits with megamoe's (max |diff| <= 1e-4)")
    p.add_argument("--drop-mtp", action="store_true",
                   help="import without the multi-token-prediction layers the files hold "
                        "(DeepSeek-V3, Kimi-K2, GLM-4.5, MiniMax-M2; by default they become "
                        "model.mtp_layers); the import names what it dropped")
    p.add_argument("--dtype", choices=sorted(DTYPES),
                   help="precision of the imported weights (default: the dtype of the model's "
                        "unquantised tensors; quantised ones are dequantised into it)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --save")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_folder_output(args.save, "import_hf", "--save", [args.load], args.overwrite)
    diff = import_hf(args.load, args.save, overwrite=args.overwrite, verify=args.verify,
                     drop_mtp=args.drop_mtp, progress=not args.no_progress,
                     dtype=DTYPES[args.dtype] if args.dtype else None)
    print(f"megamoe checkpoint: {args.save}")
    if diff is not None:
        print(f"max |logit diff| transformers vs megamoe: {diff:.3e}")
    return 0


if __name__ == "__main__":
    run_cli(main)

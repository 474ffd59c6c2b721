"""Convert a Megatron-DeepSpeed MoE checkpoint (per-expert files) into megamoe's torch_dist MoE
checkpoint.

    python tools/import_deepspeed_moe.py --load DS_CKPT --save OUT --topk K
                                         [--activation gelu|swiglu] [--verify]

DS_CKPT is DeepSpeed's checkpoint directory (with `latest`) or one tag directory, tensor
parallel size 1. `--verify` checks every MoE layer against DeepSpeed's own
`deepspeed.moe.layer.MoE` on the same weights and inputs (max |difference| <= 1e-5). Bad input:
one line on stderr, exit code 2, no output left behind. See megamoe/interop/deepspeed_moe.py.
"""
from __future__ import annotations

from megamoe.errors import CliArgumentParser, run_cli
from megamoe.ownership import check_folder_output
from megamoe.interop.deepspeed_import import ACTIVATIONS, import_deepspeed


def main(argv: list[str] | None = None) -> int:
    p = CliArgumentParser(description=__doc__.split("\n\n")[0], prog="import_deepspeed_moe.py")
    p.add_argument("--load", required=True, help="DeepSpeed checkpoint directory")
    p.add_argument("--save", required=True, help="output directory (Megatron-LM layout)")
    p.add_argument("--topk", type=int, required=True, help="experts per token of the model")
    p.add_argument("--activation", choices=ACTIVATIONS, default="gelu",
                   help="expert activation (Megatron-DeepSpeed: gelu, or swiglu with --swiglu)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --save")
    p.add_argument("--verify", action="store_true",
                   help="compare with deepspeed.moe.layer.MoE on the same weights and inputs")
    args = p.parse_args(argv)
    check_folder_output(args.save, "import_deepspeed_moe", "--save", [args.load], args.overwrite)
    diff = import_deepspeed(args.load, args.save, args.topk, args.activation,
                            overwrite=args.overwrite, verify=args.verify)
    print(f"megamoe MoE checkpoint: {args.save}")
    if diff is not None:
        print(f"max |output diff| megamoe vs DeepSpeed MoE: {diff:.3e}")
    return 0


if __name__ == "__main__":
    run_cli(main)

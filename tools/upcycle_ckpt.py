"""Upcycle a dense Megatron-Core or Hugging Face checkpoint into an MoE checkpoint.

    python tools/upcycle_ckpt.py --load DENSE --save OUT --num-experts 8 --topk 2 [options]

DENSE is a Hugging Face model directory (Llama, Mistral, Qwen2, Qwen3: config.json and
safetensors, sharded or not; OUT then also holds train_config.yaml, a megamoe training config
for it that names its tokenizer, kept in `OUT/release/tokenizer/` with the source's
config.json for tools/export_hf.py), or a Megatron checkpoint: reads torch_dist or legacy
(`iter_*/mp_rank_*/model_optim_rng.pt`) checkpoints at any TP/PP layout, writes a torch_dist MoE
checkpoint in Megatron-Core's layout (loadable at any EP/TP/PP size) layer by layer, with a
progress bar (stderr), and prints the Megatron-LM flags to train it with.
`--verify` compares dense and MoE logits and prints the max absolute difference. Bad input
gives one line on stderr and exit code 2, and leaves no output behind. See docs/upcycling.md.
"""
from __future__ import annotations

import argparse
import ast
from pathlib import Path

from megamoe.errors import CliArgumentParser, ConfigError, run_cli
from megamoe.ownership import check_folder_output
from megamoe.upcycle import UpcycleRecipe, parse_moe_layers, upcycle_checkpoint
from megamoe.upcycle.convert import TRAIN_CONFIG_FILE
from megamoe.upcycle.recipe import (ACTIVATIONS, KEY_LAYOUTS, ROUTER_INITS, SCORE_FUNCTIONS,
                                    TARGET_SPECS, WEIGHT_SCALINGS)

MEGATRON_LM_FLAGS = {"num_moe_experts": "--num-experts", "moe_router_topk": "--moe-router-topk",
                     "moe_ffn_hidden_size": "--moe-ffn-hidden-size",
                     "moe_layer_freq": "--moe-layer-freq",
                     "moe_router_score_function": "--moe-router-score-function",
                     "moe_router_pre_softmax": "--moe-router-pre-softmax",
                     "moe_shared_expert_intermediate_size": "--moe-shared-expert-intermediate-size",
                     "moe_shared_expert_gate": "--moe-shared-expert-gate"}


def _arch_override(text: str) -> tuple[str, object]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise ConfigError(f"--arch {text!r} is not KEY=VALUE, e.g. num_attention_heads=16")
    try:
        return name, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return name, value


def megatron_lm_flags(settings: dict) -> str:
    """The Megatron-LM command-line flags for a recipe's `megatron_settings`."""
    flags = []
    for name, value in settings.items():
        flag = MEGATRON_LM_FLAGS[name]
        if isinstance(value, bool):
            flags += [flag] if value else []
        elif value is not None:
            flags += [flag, str(value).replace(" ", "")]
    return " ".join(flags)


def build_parser() -> argparse.ArgumentParser:
    p = CliArgumentParser(description=__doc__.split("\n\n")[0], prog="upcycle_ckpt.py")
    p.add_argument("--load", required=True, help="dense checkpoint (root, iter_* or rank dir)")
    p.add_argument("--save", required=True, help="output directory (Megatron-LM layout)")
    p.add_argument("--num-experts", type=int, help="routed experts E (required unless --dense)")
    p.add_argument("--topk", type=int, help="experts per token K (required unless --dense)")
    p.add_argument("--dense", action="store_true",
                   help="Hugging Face input only: convert to a dense Megatron-Core checkpoint "
                        "(no experts), e.g. to continue dense pretraining first")
    p.add_argument("--granularity", type=int, default=1,
                   help="G: experts are 1/G of the dense MLP (granular upcycling); 1 = copies")
    p.add_argument("--router-init", choices=ROUTER_INITS, default="virtual_group")
    p.add_argument("--router-init-std", type=float, default=0.02)
    p.add_argument("--score-function", choices=SCORE_FUNCTIONS, default="softmax")
    p.add_argument("--pre-softmax", action="store_true",
                   help="the MoE model applies softmax before top-K selection")
    p.add_argument("--weight-scaling", choices=WEIGHT_SCALINGS, default="exact")
    p.add_argument("--activation", choices=ACTIVATIONS, default=None,
                   help="dense activation (only the paper scaling rule needs it)")
    p.add_argument("--drop-ratio", type=float, default=0.0,
                   help="drop-upcycling: fraction of each expert's neurons re-initialised")
    p.add_argument("--noise-std", type=float, default=0.0,
                   help="relative std of noise added to every expert matrix")
    p.add_argument("--shared-expert", action="store_true",
                   help="add a shared expert made from the dense MLP")
    p.add_argument("--shared-expert-gate", action="store_true",
                   help="gate the shared expert (sigmoid, zero-initialised), as Qwen2-MoE")
    p.add_argument("--moe-layers", default="all", help="all | every:N | comma list like 0,2,5")
    p.add_argument("--key-layout", choices=KEY_LAYOUTS, default="auto")
    p.add_argument("--target-spec", choices=TARGET_SPECS, default="local")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--overwrite", action="store_true", help="replace an existing --save")
    p.add_argument("--verify", action="store_true",
                   help="compare dense and MoE logits and print the max |difference|")
    p.add_argument("--arch", action="append", default=[], metavar="KEY=VALUE",
                   help="model setting --verify cannot read from the checkpoint, e.g. "
                        "num_attention_heads=16 (repeatable)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_folder_output(args.save, "upcycle_ckpt", "--save", [args.load], args.overwrite)
    if args.dense:
        from megamoe.interop.hf_dense import convert_hf_dense
        from megamoe.checkpointing.hf_source import is_hf_directory

        if not is_hf_directory(Path(args.load)):
            raise ConfigError(f"--dense converts Hugging Face models; {args.load} has no "
                              "config.json")
        diff = convert_hf_dense(args.load, args.save, overwrite=args.overwrite,
                                verify=args.verify)
        print(f"dense checkpoint: {args.save}")
        if diff is not None:
            print(f"max |logit diff| Hugging Face vs dense: {diff:.3e}")
        return 0
    if args.num_experts is None or args.topk is None:
        raise ConfigError("--num-experts and --topk are required (or --dense for a dense "
                          "conversion of a Hugging Face model)")
    recipe = UpcycleRecipe(
        num_experts=args.num_experts, topk=args.topk, granularity=args.granularity,
        router_init=args.router_init, router_init_std=args.router_init_std,
        score_function=args.score_function, pre_softmax=args.pre_softmax,
        weight_scaling=args.weight_scaling, activation=args.activation,
        drop_ratio=args.drop_ratio, noise_std=args.noise_std, shared_expert=args.shared_expert,
        shared_expert_gate=args.shared_expert_gate,
        moe_layers=parse_moe_layers(args.moe_layers), key_layout=args.key_layout,
        target_spec=args.target_spec, seed=args.seed)
    result = upcycle_checkpoint(args.load, args.save, recipe, overwrite=args.overwrite,
                                verify=args.verify,
                                arch_overrides=dict(_arch_override(a) for a in args.arch),
                                progress=not args.no_progress, log=print)
    print(f"MoE checkpoint: {result.output} (torch_dist in {result.checkpoint_dir})")
    print(f"train with: {megatron_lm_flags(result.record['megatron_settings'])}")
    if (result.output / TRAIN_CONFIG_FILE).is_file():
        print(f"train with megamoe: python -m megamoe.train --config "
              f"{result.output / TRAIN_CONFIG_FILE}")
    if result.max_logit_diff is not None:
        print(f"max |logit diff| dense vs MoE: {result.max_logit_diff:.3e}")
    return 0


if __name__ == "__main__":
    run_cli(main)

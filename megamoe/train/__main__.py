"""Pretrain an MoE GPT with Megatron-Core and megamoe layers.

    python -m megamoe.train --config configs/tiny_cpu.yaml [section.key=value ...]
    torchrun --nproc-per-node=2 -m megamoe.train --config configs/tiny_cpu.yaml
    megamoe-train --config configs/tiny_cpu.yaml output_dir=runs/mine   (installed script)

Runs alone or under torchrun / launch/pretrain_moe.sh, on CPU (gloo) or GPUs (NCCL). A run whose
checkpoint folder already holds a checkpoint resumes from it; one that has already reached
`training.train_steps` exits at once. A bad config or override exits with code 2 and one line;
a run that a divergence guard stops (a NaN/Inf loss or gradient norm, a loss spike with
`guards.spike_action=stop` or too many rollbacks) exits with code 3 and one line, having saved
nothing.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings

from megamoe.checkpointing.layout import iteration_of, latest_checkpoint
from megamoe.errors import CheckpointError, CliArgumentParser, run_cli
from megamoe.train.config import load_config


def _parser() -> argparse.ArgumentParser:
    parser = CliArgumentParser(prog="python -m megamoe.train",
                               description=__doc__.split("\n\n")[0],
                               epilog="Overrides: section.key=value, e.g. "
                                      "training.train_steps=20 output_dir=runs/x; see "
                                      "megamoe/train/settings/ for every key.")
    parser.add_argument("--config", required=True, help="the run's YAML config, e.g. "
                        "configs/tiny_cpu.yaml")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="config overrides (values are YAML)")
    return parser


def _main(argv: list[str] | None) -> int:
    args = _parser().parse_args(argv)
    config = load_config(args.config, args.overrides)
    _quiet_megatron()
    try:
        latest = latest_checkpoint(config.checkpoint_dir)
    except CheckpointError:
        if not config.checkpoint.resume_from_verified:
            raise
        latest = None  # the run picks the newest checkpoint that verifies
    if latest is not None and iteration_of(latest) >= config.training.train_steps and \
            _verified(latest, config):
        if os.environ.get("RANK", "0") == "0":
            print(f"{config.output_dir}: already trained {iteration_of(latest)} of "
                  f"{config.training.train_steps} steps ({latest}, verified); nothing to do",
                  flush=True)
        return 0
    import torch

    if not torch.cuda.is_available():
        # Megatron's fused kernels are torch.compile'd: seconds per first call on CPU, no gain.
        os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    from megamoe.train.guards import EXIT_DIVERGED, DivergenceError
    from megamoe.train.loop import run

    try:
        return run(config)
    except DivergenceError as err:
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {err}", file=sys.stderr, flush=True)
        return EXIT_DIVERGED


def _verified(latest, config) -> bool:
    """Whether the finished run's newest checkpoint verifies. If it does not, a one-line
    error names the newest one that does; with `checkpoint.resume_from_verified` the run goes
    on from that one instead (False)."""
    from megamoe.train.checkpoint import checkpoint_problem, require_verified

    if checkpoint_problem(latest) is None:
        return True
    if not config.checkpoint.resume_from_verified:
        require_verified(latest, config.checkpoint_dir)
    return False


def _quiet_megatron() -> None:
    """Megatron's expected warnings on this path (no apex or Transformer Engine, a plugin MLP
    spec) would bury the training output; real errors still surface as exceptions."""
    warnings.filterwarnings("ignore", module=r"megatron\.")
    warnings.filterwarnings("ignore", module=r"torch\.distributed\.checkpoint")
    # torch >= 2.13 deprecates the collectives Megatron-Core's gradient buffers call.
    warnings.filterwarnings("ignore", category=FutureWarning,
                            module=r"torch\.distributed\.c10d_logger")
    logging.getLogger("megatron").setLevel(logging.ERROR)


def main(argv: list[str] | None = None) -> None:
    """Entry point of `python -m megamoe.train` and the `megamoe-train` script."""
    run_cli(_main, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()

"""The quick tier's trainer run: `python -m megamoe.train`'s own entry point, in this process on
one rank, saves, resumes and continues bit-exactly.

The reference is independent of resuming: the same run without an interruption. The full tier's
tests/e2e/test_train.py checks the same across processes and expert-parallel sizes.
"""
from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from megamoe.train.__main__ import _main
from megamoe.train.signals import STOP_SIGNALS

REPO = Path(__file__).resolve().parents[2]
STEPS = 4
RUN = ("--config", str(REPO / "configs" / "tiny_cpu.yaml"), "parallel.expert=1",
       "training.global_batch_size=8", f"training.train_steps={STEPS}",
       "optimizer.warmup_steps=2", "checkpoint.interval=0", "logging.progress_bar=false",
       "logging.tensorboard=false")


def train(cache: Path, out: Path, *overrides: str) -> None:
    """The trainer's entry point in this process; the stop-signal handlers it installs are put
    back as they were."""
    handlers = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    try:
        assert _main([*RUN, f"data.cache_dir={cache}", f"output_dir={out}", *overrides]) == 0
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)


def step_losses(out: Path) -> dict[int, float]:
    records = (json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["loss"] for r in records if "loss" in r}


@pytest.mark.quick(budget_s=60)
def test_a_run_stopped_and_resumed_continues_bit_exactly(corpus_cache, tmp_path):
    train(corpus_cache, tmp_path / "reference")
    resumed = tmp_path / "resumed"
    train(corpus_cache, resumed, f"training.exit_interval={STEPS // 2}")
    saved = sorted(p.name for p in (resumed / "checkpoints").glob("iter_*"))
    assert saved == [f"iter_{STEPS // 2:07d}"]
    train(corpus_cache, resumed)
    reference = step_losses(tmp_path / "reference")
    assert sorted(reference) == list(range(1, STEPS + 1))
    assert step_losses(resumed) == reference  # bit for bit, the resumed steps included
    assert (resumed / "checkpoints" / f"iter_{STEPS:07d}").is_dir()


@pytest.mark.quick(budget_s=30)
def test_a_loss_scale_left_by_an_earlier_model_does_not_break_a_run(corpus_cache, tmp_path):
    """A backward through Megatron's MoEAuxLossAutoScaler outside its schedules (a plain-PyTorch
    experiment earlier in the process) leaves a 0-d scale behind; the schedules' [1]-shaped
    scale no longer copies into it."""
    import torch
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.main_loss_backward_scale = torch.tensor(1.0)
    try:
        train(corpus_cache, tmp_path / "run", "training.train_steps=1")
    finally:
        MoEAuxLossAutoScaler.main_loss_backward_scale = None
    assert sorted(step_losses(tmp_path / "run")) == [1]

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

from megamoe.errors import ConfigError, DataError
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


def step_loads(out: Path) -> dict[int, list]:
    """Per step, every MoE layer's expert loads (from the routing actually used)."""
    records = (json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: [r[k] for k in sorted(r) if k.endswith("/load")]
            for r in records if "loss" in r}


@pytest.mark.quick(budget_s=40)
def test_a_run_replays_a_recorded_routing(corpus_cache, tmp_path):
    """Run A records its routing; run B, whose faster bias would route otherwise (its own
    run, C, shows it), replays A's record: every step's expert loads and losses are A's, bit
    for bit (the bias only selects experts). A record that does not fit the model (a model
    with one MoE layer fewer) is refused in one line."""
    # Two micro-batches of 4 a step.
    common = ("moe.router.replay=true", "training.train_steps=2", "training.micro_batch_size=4")
    record = tmp_path / "record"
    train(corpus_cache, tmp_path / "a", *common, f"training.routing_record={record}")
    assert sorted(p.name for p in (record / "step_0000002").iterdir()) == [
        "microbatch_00000.stage_000.safetensors", "microbatch_00001.stage_000.safetensors"]
    faster = "moe.balancing.bias_update_rate=0.5"
    train(corpus_cache, tmp_path / "b", *common, faster, f"training.routing_replay={record}")
    train(corpus_cache, tmp_path / "c", *common, faster)
    assert step_loads(tmp_path / "b") == step_loads(tmp_path / "a")
    assert step_losses(tmp_path / "b") == step_losses(tmp_path / "a")
    assert step_loads(tmp_path / "c")[2] != step_loads(tmp_path / "a")[2]
    with pytest.raises(DataError, match=r"records MoE layers \[2, 3, 4\] but the model's "
                                        r"are \[3, 4\]"):
        train(corpus_cache, tmp_path / "d", *common, "model.first_k_dense=2",
              f"training.routing_replay={record}")


@pytest.mark.quick(budget_s=20)
def test_a_hash_layer_trains_on_the_batch_token_ids(corpus_cache, tmp_path):
    """The first MoE layer routes by DeepSeek-V4's hash table (the trainer hands every forward
    its token ids); the others by top-k. Recomputing MoE layers is refused in one line."""
    hashed = ("moe.layer_overrides={1: {router: {kind: hash, vocab_size: 4096, "
              "score_function: sqrtsoftplus}, balancing: {methods: none}}}")
    train(corpus_cache, tmp_path / "hash", hashed, "training.train_steps=2")
    records = [json.loads(line) for line in (tmp_path / "hash" / "metrics.jsonl").read_text()
               .splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2]
    with pytest.raises(ConfigError, match="router.kind=hash with recompute_granularity='full'"):
        train(corpus_cache, tmp_path / "recomputed", hashed, "training.recompute=full")

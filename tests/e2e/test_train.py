"""End-to-end tests of `python -m megamoe.train` on CPU: real processes, the default corpus.

References are independent of the code under test: losses of an uninterrupted run (exact resume),
the same run at another expert-parallel size, the dense model an MoE was upcycled from, and the
loss at initialisation (log of the vocabulary size, ~8.3) for "the loss falls".
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from slurm_helpers import PRETRAIN_SCRIPT
import warm_launcher

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny_cpu.yaml"
STEPS = 30  # the reference run; resume tests split it in two halves
HALF = STEPS // 2
RUN = (f"training.train_steps={STEPS}", "optimizer.warmup_steps=10", "checkpoint.interval=0")


def _env() -> dict:
    return {**os.environ, "TORCHDYNAMO_DISABLE": "1", "PYTHONUNBUFFERED": "1",
            "WANDB_MODE": "offline", "WANDB_SILENT": "true"}


def _command(nproc: int) -> list[str]:
    if nproc == 1:
        return [sys.executable, "-m", "megamoe.train"]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", "-m", "megamoe.train"]


def train(cache: Path, out: Path, *overrides: str, nproc: int = 2, config: Path = TINY,
          timeout: float = 240) -> subprocess.CompletedProcess:
    """Run the trainer to completion; fail the test with its output unless it exits 0."""
    args = ["--config", str(config), f"output_dir={out}", f"data.cache_dir={cache}",
            "logging.progress_bar=false", "logging.tensorboard=false", *overrides]
    done = warm_launcher.run(_command(nproc) + args, cwd=REPO, env=_env(), capture_output=True,
                             text=True, timeout=timeout)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-3000:]}\n" \
                                 f"{done.stderr[-3000:]}"
    return done


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def losses(out: Path) -> list[float]:
    return [r["loss"] for r in records(out)]


def latest(out: Path) -> str:
    """The folder Megatron-LM's tracker file names (megatron/training/checkpointing.py)."""
    iteration = int((out / "checkpoints" / "latest_checkpointed_iteration.txt").read_text())
    return f"iter_{iteration:07d}"


@pytest.fixture(scope="module")
def reference(corpus_cache, tmp_path_factory) -> Path:
    """The tiny config (EP=2 over 2 processes) for STEPS steps in one go, with every sink on."""
    out = tmp_path_factory.mktemp("reference")
    train(corpus_cache, out, *RUN, "logging.tensorboard=true", "logging.wandb=true",
          "logging.interval=10")
    return out


@pytest.fixture(scope="module")
def first_half(corpus_cache, tmp_path_factory) -> Path:
    """The same run stopped (by training.exit_interval) after HALF steps."""
    out = tmp_path_factory.mktemp("first_half")
    done = train(corpus_cache, out, *RUN, f"training.exit_interval={HALF}")
    assert f"stopping after step {HALF} at training.exit_interval" in done.stdout
    assert latest(out) == f"iter_{HALF:07d}"
    return out


def test_tiny_run_learns_and_logs_everything(reference, corpus_cache):
    history = records(reference)
    assert [r["step"] for r in history] == list(range(1, STEPS + 1))
    first, last = history[0]["loss"], sum(r["loss"] for r in history[-5:]) / 5
    assert abs(first - math.log(4096)) < 0.3          # an untrained model: uniform over 4096
    assert last < first - 1.5, (first, last)
    assert all(r["lr"] <= 3e-3 + 1e-12 and r["tokens_per_s"] > 0 for r in history)
    moe_layers = sorted(k for k in history[-1] if k.endswith("/load"))
    assert moe_layers == [f"moe/layer{n}/load" for n in (2, 3, 4)]  # layer 1 is dense
    for key in moe_layers:
        assert len(history[-1][key]) == 8 and abs(sum(history[-1][key]) - 1) < 1e-5
    assert history[-1]["moe/layer2/experts_per_token"] == 2.0
    assert latest(reference) == f"iter_{STEPS:07d}"
    checkpoint = reference / "checkpoints" / latest(reference)
    # torch_dist data files are named __<rank>_<writer>.distcp: both ranks wrote their experts
    assert {p.name.split("_")[2] for p in checkpoint.glob("__*_*.distcp")} == {"0", "1"}
    # it records the tokenizer it trained with (the default corpus's) and holds a copy of it
    from megamoe.checkpointing.safe_dcp import load_common_state
    from megamoe.train.corpus import default_dataset_dir
    from megamoe.train.tokenizer import load_tokenizer

    corpus = load_tokenizer(default_dataset_dir(corpus_cache) / "text_document.model")
    assert load_common_state(checkpoint)["tokenizer"]["fingerprint"] == corpus.fingerprint
    assert load_tokenizer(checkpoint / "tokenizer").fingerprint == corpus.fingerprint
    assert list((reference / "tensorboard").glob("events.out.tfevents.*"))
    assert list((reference / "wandb").glob("offline-run-*"))
    assert (reference / "config.yaml").is_file()


def test_resume_is_exact(reference, first_half, corpus_cache, tmp_path):
    """HALF steps, stop, resume: the same losses, bit for bit, as the uninterrupted run."""
    shutil.copytree(first_half, tmp_path, dirs_exist_ok=True)
    done = train(corpus_cache, tmp_path, *RUN, f"training.exit_interval={HALF}")
    assert f"iter_{HALF:07d} (step {HALF}, {HALF * 16} samples consumed)" in done.stdout
    assert losses(tmp_path) == losses(reference)
    assert latest(tmp_path) == f"iter_{STEPS:07d}"


def test_resume_at_another_expert_parallel_size(reference, first_half, corpus_cache, tmp_path):
    """A checkpoint saved at EP=2 continues at EP=1 (the same data-parallel batches): the
    losses follow the EP=2 run to float rounding."""
    shutil.copytree(first_half, tmp_path, dirs_exist_ok=True)
    done = train(corpus_cache, tmp_path, *RUN, "parallel.expert=1",
                 f"training.exit_interval={HALF + 5}")
    assert "expert 1" in done.stdout
    resumed, straight = losses(tmp_path)[HALF:], losses(reference)[HALF:HALF + 5]
    assert len(resumed) == 5
    assert max(abs(a - b) for a, b in zip(resumed, straight)) < 1e-4


def _snapshot(out: Path) -> dict:
    """Every file under the run with its size and mtime: 'nothing written' compares these."""
    return {str(p.relative_to(out)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in out.rglob("*") if p.is_file()}


def test_resume_may_change_how_the_model_trains(first_half, corpus_cache, tmp_path):
    """A resumed run with another aux-loss coefficient, bias update rate and dispatcher: each
    change announced once (rank 0 of 2) and recorded in metrics.jsonl from the first step it
    applies to; the run continues from the checkpoint's position."""
    shutil.copytree(first_half, tmp_path, dirs_exist_ok=True)
    done = train(corpus_cache, tmp_path, *RUN, f"training.train_steps={HALF + 2}",
                 "moe.balancing.aux_loss_coeff=0.02", "moe.balancing.bias_update_rate=0.001",
                 "moe.dispatcher.kind=allgather")
    step = HALF + 1
    for line in (f"setting moe.balancing.aux_loss_coeff: 0.01 -> 0.02 (from step {step})",
                 f"setting moe.balancing.bias_update_rate: 0.01 -> 0.001 (from step {step})",
                 f"setting moe.dispatcher.kind: alltoall -> allgather (from step {step})"):
        assert done.stdout.count(line) == 1, done.stdout[-3000:]
    changed = {r["setting"]: (r["step"], r["old"], r["new"]) for r in records(tmp_path)
               if r.get("event") == "setting"}
    assert changed == {"moe.balancing.aux_loss_coeff": (step, 0.01, 0.02),
                       "moe.balancing.bias_update_rate": (step, 0.01, 0.001),
                       "moe.dispatcher.kind": (step, "alltoall", "allgather")}
    steps = [r["step"] for r in records(tmp_path) if "event" not in r]
    assert steps == list(range(1, HALF + 3))


def test_resume_with_another_number_of_experts_is_refused(first_half, corpus_cache, tmp_path):
    """The number of experts shapes the weights: one line naming it, exit 2, nothing written."""
    shutil.copytree(first_half, tmp_path, dirs_exist_ok=True)
    before = _snapshot(tmp_path)
    done = warm_launcher.run(
        _command(1) + ["--config", str(TINY), f"output_dir={tmp_path}",
                       f"data.cache_dir={corpus_cache}", *RUN, "parallel.expert=1",
                       "moe.num_experts=16"],
        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=240)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, done.stderr[-3000:]
    assert "moe.num_experts=8 but the config says 16" in errors[0]
    assert _snapshot(tmp_path) == before


def expert_biases(folder: Path) -> dict:
    """The expert biases a torch_dist checkpoint holds, by key."""
    import torch
    from torch.distributed.checkpoint import load

    from megamoe.checkpointing.safe_dcp import SafeFileSystemReader

    saved = SafeFileSystemReader(folder).read_metadata().state_dict_metadata
    biases = {key: torch.zeros(saved[key].size) for key in saved if key.endswith("expert_bias")}
    load(biases, storage_reader=SafeFileSystemReader(folder), no_dist=True)
    return biases


def test_a_bias_update_schedule_stops_the_bias_from_its_step(corpus_cache, tmp_path):
    """`moe.balancing.bias_update_schedule: [[3, 0.0]]` (DeepSeek-V3's rate to 0 for the last
    tokens): steps 1-2 move the expert biases, steps 3-6 leave them as they were."""
    train(corpus_cache, tmp_path, "training.train_steps=6", "checkpoint.interval=2",
          "checkpoint.keep_last=0", "parallel.expert=1",
          "moe.balancing.bias_update_schedule=[[3, 0.0]]", nproc=1)
    at = {step: expert_biases(tmp_path / "checkpoints" / f"iter_{step:07d}")
          for step in (2, 4, 6)}
    assert len(at[2]) == 3  # the three MoE layers
    for key, bias in at[2].items():
        assert bias.abs().sum() > 0, key  # moved from zeros in steps 1-2
        assert bias.equal(at[4][key]) and bias.equal(at[6][key]), key


def test_upcycled_checkpoint_starts_a_run(corpus_cache, tmp_path):
    """init_from an upcycled dense checkpoint: the MoE's first loss equals the dense model's
    loss on the same batch (upcycled experts with renormalised top-2 gates compute the MLP)."""
    frozen = ("training.train_steps=1", "optimizer.lr=0", "optimizer.min_lr=0",
              "parallel.expert=1")
    dense = tmp_path / "dense"
    train(corpus_cache, dense, *frozen, "model.first_k_dense=4", nproc=1)
    upcycled = tmp_path / "upcycled"
    done = warm_launcher.run([sys.executable, "tools/upcycle_ckpt.py", "--load",
                              str(dense / "checkpoints"), "--save", str(upcycled),
                              "--num-experts", "8", "--topk", "2", "--no-progress"],
                             cwd=REPO, env=_env(), timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    moe = tmp_path / "moe"
    done = train(corpus_cache, moe, *frozen, "model.first_k_dense=0", "moe.ffn_hidden_size=512",
                 "moe.router.score_function=softmax", "moe.balancing.methods=aux_loss",
                 f"checkpoint.init_from={upcycled}", nproc=1)
    assert "starting from the weights of" in done.stdout
    assert abs(losses(moe)[0] - losses(dense)[0]) < 1e-5
    assert "moe/layer1/load" in records(moe)[0]


def test_signal_saves_a_checkpoint_and_exits_zero(corpus_cache, tmp_path):
    """SIGTERM (twice, as SLURM and torchrun both send it) mid-run: the step finishes, a
    checkpoint of it is written and the tracker names it, exit code 0."""
    args = ["--config", str(TINY), f"output_dir={tmp_path}", f"data.cache_dir={corpus_cache}",
            "logging.progress_bar=false", "logging.tensorboard=false", "parallel.expert=1",
            "training.train_steps=1000", "checkpoint.interval=0"]
    proc = subprocess.Popen(_command(1) + args, cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        metrics = tmp_path / "metrics.jsonl"
        deadline = time.monotonic() + 120
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 3):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    steps = len(records(tmp_path))
    assert 3 <= steps < 1000
    assert latest(tmp_path) == f"iter_{steps:07d}"
    assert f"stopping after step {steps} on a signal" in stdout
    assert "received SIGTERM" in stderr


def test_finished_run_exits_at_once(tmp_path):
    """A (requeued) run whose checkpoint already reached train_steps, and verifies, does
    nothing, quickly (the committed 4-step checkpoint of the cross-version fixtures)."""
    shutil.copytree(REPO / "tests" / "fixtures" / "mcore_checkpoints" / "mcore-0.16.1" /
                    "checkpoints", tmp_path / "checkpoints")
    start = time.monotonic()
    done = warm_launcher.run(_command(1) + ["--config", str(TINY), f"output_dir={tmp_path}",
                                            "training.train_steps=4"],
                             cwd=REPO, env=_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "already trained 4 of 4 steps" in done.stdout and "verified" in done.stdout
    assert time.monotonic() - start < 20
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize("args, message", [
    (["training.micro_batch=4"], "unknown config key 'training.micro_batch' in override "
                                 "'training.micro_batch=4'; did you mean "
                                 "'training.micro_batch_size'?"),
    (["lr=1e-3"], "did you mean 'optimizer.lr'?"),
    (["moe.num_expert=4"], "did you mean 'moe.num_experts'?"),
    (["moe.layer_overrides.2.tpk=1"], "did you mean 'moe.layer_overrides.2.topk'?"),
    (["optimizer.lr=fast"], "optimizer.lr='fast' is not a valid float"),
    (["parallel.expert=3"], "num_experts=8 is not divisible by the expert-parallel size 3"),
    (["training.global_batch_size=12"], "global_batch_size=12 is not a multiple of"),
    (["training.train_steps"], "is not key=value"),
])
def test_bad_override_is_one_line_and_exit_2(args, message, tmp_path, capsys):
    from megamoe.train.__main__ import main

    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        main(["--config", str(TINY), f"output_dir={out}", *args])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and message in captured.err, captured.err
    assert not out.exists()


def test_bad_key_in_config_file_names_the_file(tmp_path):
    config = tmp_path / "typo.yaml"
    config.write_text(TINY.read_text().replace("  warmup_steps:", "  warmup_step:"))
    done = warm_launcher.run(_command(1) + ["--config", str(config)], cwd=REPO, env=_env(),
                             capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr == (f"error: unknown config key 'optimizer.warmup_step' in {config}; "
                           "did you mean 'optimizer.warmup_steps'?\n")


def test_plot_tool_writes_pngs(reference, tmp_path):
    import matplotlib.image

    done = warm_launcher.run([sys.executable, "tools/plot_expert_load.py", str(reference), "--out",
                              str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    names = ["expert_load.png", "maxvio.png", "experts_per_token.png", "loss.png"]
    assert done.stdout.split() == [str(tmp_path / n) for n in names]
    for name in names:
        image = matplotlib.image.imread(tmp_path / name)
        assert image.shape[0] > 300 and image.shape[1] > 600
        assert image[..., :3].std() > 0.05  # not a blank canvas
    heat = matplotlib.image.imread(tmp_path / "expert_load.png")
    assert heat.shape[0] > heat.shape[1] * 0.6  # three stacked layer panels


def test_plot_tool_rejects_a_folder_without_metrics(tmp_path):
    done = warm_launcher.run([sys.executable, "tools/plot_expert_load.py", str(tmp_path)], cwd=REPO,
                             capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr == f"error: no metrics file at {tmp_path / 'metrics.jsonl'}; pass a " \
                          "run's output_dir or its metrics.jsonl\n"
    assert not (tmp_path / "plots").exists()


def test_sbatch_two_nodes_trains_then_resumes(cluster, corpus_cache, tmp_path):
    """launch/pretrain_moe.sh on a real two-node Slurm cluster: one trainer per node forms one
    EP=2 run; the first job stops at training.exit_interval with a checkpoint, the same
    submission again resumes from it and finishes."""
    out = tmp_path / "run"
    args = [str(TINY), f"output_dir={out}", f"data.cache_dir={corpus_cache}",
            "training.train_steps=8", "training.exit_interval=4", "optimizer.warmup_steps=2",
            "checkpoint.interval=0", "logging.interval=1", "logging.progress_bar=false",
            "logging.tensorboard=false"]
    env = {"PYTHON": sys.executable, "NPROC_PER_NODE": "1", "TORCHDYNAMO_DISABLE": "1"}
    logs = []
    for job in (1, 2):
        log = tmp_path / f"job{job}.out"
        result = cluster.run_job(PRETRAIN_SCRIPT, *args, cwd=REPO, timeout=240,
                                 sbatch_args=["--nodes=2", f"--output={log}"],
                                 env={**env, "RDZV_PORT": str(warm_launcher.free_port())})
        text = log.read_text()
        assert result.state == "COMPLETED", f"job {job}: {result.state} {result.exit_code}\n{text}"
        logs.append(text)
        ranks = re.findall(r"^(\d): rank (\d)/(\d) on (\S+): data-parallel rank (\d), "
                           r"expert-parallel rank (\d), output (\S+)$", text, re.MULTILINE)
        # one trainer per node (srun task), together the ranks 0 and 1 of one world of 2
        assert sorted(task for task, *_ in ranks) == ["0", "1"], text
        assert sorted(rank for _, rank, *_ in ranks) == ["0", "1"]
        assert {world for _, _, world, *_ in ranks} == {"2"}
        assert {node for *_, node, _, _, _ in ranks} == set(cluster.nodes)
        assert {ep for *_, ep, _ in ranks} == {"0", "1"}
        assert {output for *_, output in ranks} == {str(out)}
        steps = [r["step"] for r in records(out)]
        assert steps == list(range(1, 4 * job + 1))
        assert latest(out) == f"iter_{4 * job:07d}"
        written = out / "checkpoints" / latest(out)
        assert {p.name.split("_")[2] for p in written.glob("__*_*.distcp")} == {"0", "1"}
    assert "stopping after step 4 at training.exit_interval" in logs[0]
    assert f"starting from {out}/checkpoints/iter_0000004 (step 4, 64 samples" in logs[1]
    assert "step 8/8 | loss" in logs[1]

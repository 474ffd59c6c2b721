"""The whole Hugging Face round trip on tiny random models of each architecture: HF dense ->
megamoe MoE (tools/upcycle_ckpt.py) -> a few training steps (`python -m megamoe.train` with the
upcycler's train_config.yaml) -> Hugging Face MoE (tools/export_hf.py) -> transformers' logits
equal the trained megamoe checkpoint's (and differ from the dense model's: training moved the
weights), with the dense model's tokenizer, ids, context and rope scaling; and a released MoE
model imported (tools/import_hf.py), trained by the very command the import prints and exported
without being told its tokenizer."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
from hf_models import save_tiny_hf_model  # noqa: E402
import warm_launcher

REPO = Path(__file__).resolve().parents[2]
BAR = 1e-4
# Dense architecture -> (upcycler flags, export architecture). Mistral's and Qwen3's upcycling
# is checked against transformers in tests/unit/test_interop_hf.py, and a Qwen3-MoE trained and
# exported in tests/distributed/test_hf_import.py: the whole trip runs for two (CI time).
ROUTES = {
    "llama": ([], "mixtral"),
    "qwen2": (["--shared-expert", "--shared-expert-gate", "--moe-layers", "1"], "qwen2_moe"),
}


def _run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "TORCHDYNAMO_DISABLE": "1", "WANDB_MODE": "offline"}
    done = warm_launcher.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True,
                             text=True, timeout=timeout)
    assert done.returncode == 0, f"{args[:2]} exit {done.returncode}\n{done.stderr[-3000:]}"
    return done


@pytest.mark.parametrize("arch", sorted(ROUTES))
def test_hf_dense_to_trained_moe_to_hf(arch, corpus_cache, tmp_path):
    from megamoe.upcycle.hf_logits import hf_logits, load_hf_model, sample_tokens

    from transformers import AutoConfig

    flags, target = ROUTES[arch]
    hf = save_tiny_hf_model(arch, tmp_path / "hf", tokenizer=True)
    moe = tmp_path / "moe"
    _run("tools/upcycle_ckpt.py", "--load", str(hf), "--save", str(moe), "--num-experts", "4",
         "--topk", "2", "--no-progress", *flags)
    run = tmp_path / "run"
    trained = _run("-m", "megamoe.train", "--config", str(moe / "train_config.yaml"),
                   f"output_dir={run}", f"data.cache_dir={corpus_cache}",
                   "training.train_steps=3", "model.seq_length=32",
                   "training.micro_batch_size=2", "training.global_batch_size=2",
                   "optimizer.lr=1e-2", f"checkpoint.init_from={moe}",
                   "logging.progress_bar=false", "logging.tensorboard=false")
    assert " is now moe." not in trained.stderr  # written as the tree: no flat-key notes
    out = tmp_path / "exported"
    done = _run("tools/export_hf.py", "--load", str(run / "checkpoints"), "--save", str(out),
                "--arch", target, "--verify")
    diff = float(done.stdout.split("max |logit diff| megamoe vs transformers:")[1].split()[0])
    assert diff <= BAR
    tokens = sample_tokens(4096)
    moved = (hf_logits(load_hf_model(out), tokens) - hf_logits(load_hf_model(hf), tokens))
    assert float(moved.abs().max()) > 1e-3
    # Trained at 32 tokens, the upcycled model keeps the dense model's context, rope scaling and
    # ids, and ships its tokenizer files (no --tokenizer).
    dense, moe_config = AutoConfig.from_pretrained(hf), AutoConfig.from_pretrained(out)
    for key in ("max_position_embeddings", "rope_parameters", "bos_token_id", "eos_token_id"):
        assert getattr(moe_config, key) == getattr(dense, key), key
    shipped = [p.name for p in hf.iterdir() if p.name.startswith("tokenizer")]
    assert shipped and all((out / name).read_bytes() == (hf / name).read_bytes()
                           for name in shipped)


def test_imported_model_trains_on_its_tokenizer_with_the_printed_command(corpus_cache,
                                                                           tmp_path):
    """A DeepSeek-V3 (tokenizer.json, bos added, pad = eos): the command tools/import_hf.py
    prints trains on the model's own tokenizer; the export, told nothing, is the source model
    again: config.json key by key (dtype aside), tokenizer files byte for byte, generation
    ids, as transformers reads them."""
    import shlex

    from megamoe.checkpointing.safe_dcp import load_common_state
    from megamoe.train.checkpoint import resolve_weights_dir
    from megamoe.train.tokenizer import load_tokenizer

    hf = save_tiny_hf_model("deepseek_v3", tmp_path / "hf", tokenizer=True)
    done = _run("tools/import_hf.py", "--load", str(hf), "--save", str(tmp_path / "moe"),
                "--no-progress")
    command = next(line for line in done.stdout.splitlines() if line.startswith("train with: "))
    argv = shlex.split(command.removeprefix("train with: "))
    assert argv[:3] == ["python", "-m", "megamoe.train"]
    # train_config.yaml sets checkpoint.init_from: the command does not repeat it
    assert not any(arg.startswith("checkpoint.init_from=") for arg in argv)
    run = tmp_path / "run"
    trained = _run(*argv[1:], f"output_dir={run}", f"data.cache_dir={corpus_cache}",
                   "training.train_steps=2", "training.global_batch_size=2",
                   "model.seq_length=64", "logging.progress_bar=false",
                   "logging.tensorboard=false")
    assert " is now moe." not in trained.stderr  # written as the tree: no flat-key notes
    trained = load_common_state(resolve_weights_dir(run / "checkpoints"))["tokenizer"]
    assert trained["fingerprint"] == load_tokenizer(hf).fingerprint
    out = tmp_path / "exported"
    _run("tools/export_hf.py", "--load", str(run / "checkpoints"), "--save", str(out))
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    source, exported = (json.loads((d / "config.json").read_text()) for d in (hf, out))
    assert {k: v for k, v in exported.items() if k != "dtype"} == \
        {k: v for k, v in source.items() if k != "dtype"}
    read_back, read_source = ({k: v for k, v in AutoConfig.from_pretrained(d).to_dict().items()
                               if k != "_name_or_path"} for d in (out, hf))
    assert read_back == read_source
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (hf / name).read_bytes(), name
    ids = ("bos_token_id", "eos_token_id", "pad_token_id")
    assert [getattr(GenerationConfig.from_pretrained(out), key) for key in ids] == \
        [getattr(GenerationConfig.from_pretrained(hf), key) for key in ids]
    text = "Document 3: the gate expert\n naïve"
    assert AutoTokenizer.from_pretrained(out)(text).input_ids == \
        AutoTokenizer.from_pretrained(hf)(text).input_ids

"""Released Hugging Face MoE models in and back out (tools/import_hf.py, tools/export_hf.py), on
tiny random models of each architecture built by transformers (no download): transformers'
logits are the reference at expert-parallel sizes 1 and 2, and for each model trained a few steps
at EP=2 on its own tokenizer (the one each released model ships: tests/hf_models.py) and exported
back; a round trip without training gives bit-identical tensors, the source's config.json key by
key, its tokenizer files byte for byte and its generation ids, and bad input is one line with
exit code 2 and no output."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
import hf_import_workers  # noqa: E402
from megamoe.parallel.spawn import spawn_ranks as spawn  # noqa: E402
from hf_models import MOE_ARCHS, save_tiny_hf_model, saved_tensors  # noqa: E402
import warm_launcher

REPO = Path(__file__).resolve().parents[2]
BAR = 1e-4
TRAIN_STEPS = 3
CORRECTION_BIAS_ARCHS = ("deepseek_v3", "glm4_moe", "minimax_m2")
"""The architectures whose checkpoints hold a routing correction bias (e_score_correction_bias)."""
TRAIN_CONFIG = "train_config.yaml"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                   "special_tokens_map.json")
IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
TEXT = "Document 7: the router balances 12 experts.\n  naïve café 東京 <|endoftext|> done"


def assert_is_the_source_model(hf: Path, out: Path) -> None:
    """The export `out` ships the config.json of the Hugging Face model `hf` key by key (dtype
    aside), its tokenizer files byte for byte and its generation ids, and transformers reads
    the same configuration, generation ids and token ids from both."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    def without_dtype(config: dict) -> dict:
        return {key: value for key, value in config.items()
                if key not in ("dtype", "torch_dtype", "_name_or_path")}

    source, exported = (json.loads((d / "config.json").read_text()) for d in (hf, out))
    assert without_dtype(exported) == without_dtype(source)
    assert without_dtype(AutoConfig.from_pretrained(out).to_dict()) == \
        without_dtype(AutoConfig.from_pretrained(hf).to_dict())
    shipped = [name for name in TOKENIZER_FILES if (hf / name).is_file()]
    assert shipped and [name for name in TOKENIZER_FILES if (out / name).is_file()] == shipped
    for name in shipped:
        assert (out / name).read_bytes() == (hf / name).read_bytes(), name
    source_ids, exported_ids = ([getattr(GenerationConfig.from_pretrained(d), key) for key in IDS]
                                for d in (hf, out))
    assert exported_ids == source_ids
    assert AutoTokenizer.from_pretrained(out)(TEXT).input_ids == \
        AutoTokenizer.from_pretrained(hf)(TEXT).input_ids


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """{architecture: (HF dir, import dir, verify figure)}, imported in this process."""
    from megamoe.interop.hf_import import import_hf

    root = tmp_path_factory.mktemp("hf_import")
    out = {}
    for arch in MOE_ARCHS:
        hf = save_tiny_hf_model(arch, root / arch / "hf", tokenizer=True)
        diff = import_hf(hf, root / arch / "imported", verify=True, progress=False,
                         log=lambda line: None)
        out[arch] = (hf, root / arch / "imported", diff)
    return out


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_import_reproduces_transformers_logits(imported, arch):
    assert imported[arch][2] <= BAR


@pytest.fixture(scope="module")
def expert_parallel(imported, corpus_cache, tmp_path_factory):
    """(logits of every rank, training output root): one spawn of two ranks runs each imported
    model at expert-parallel size 2, then trains it there for a few steps."""
    import yaml

    from megamoe.upcycle.hf_logits import sample_tokens

    root = tmp_path_factory.mktemp("hf_import_ep2")
    jobs = {arch: (str(folder), yaml.safe_load((folder / TRAIN_CONFIG).read_text()))
            for arch, (_, folder, _) in imported.items()}
    training = {"output_dir": str(root / "runs"), "data": {"cache_dir": str(corpus_cache)},
                "training": {"train_steps": TRAIN_STEPS, "micro_batch_size": 2,
                             "global_batch_size": 4},
                "optimizer": {"lr": 1e-2},
                "logging": {"progress_bar": False, "tensorboard": False}}
    results = spawn(2, hf_import_workers.import_job, str(root), 1000, imports=jobs,
                    tokens=sample_tokens(4096), training=training)
    return results, root / "runs"


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_expert_parallel_logits_match_transformers(imported, expert_parallel, arch):
    from megamoe.upcycle.hf_logits import hf_logits, load_hf_model, sample_tokens

    results, _ = expert_parallel
    reference = hf_logits(load_hf_model(imported[arch][0]), sample_tokens(4096))
    for rank in (0, 1):
        diff = float((results[rank][arch][..., :4096] - reference).abs().max())
        assert diff <= BAR, f"{arch} rank {rank}: {diff:.3e}"


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_trained_at_ep2_exports_what_transformers_reproduces(imported, expert_parallel, arch,
                                                             tmp_path):
    """Trained at EP=2 from the import, exported back: transformers' logits equal megamoe's
    (export's --verify), training moved them, and the correction bias of DeepSeek-V3, GLM-4.5
    and MiniMax-M2 kept training from its imported values (the loss-free rule moves each entry
    by 1e-3 a step)."""
    from megamoe.interop.hf_export import export_hf
    from megamoe.upcycle.hf_logits import hf_logits, load_hf_model, sample_tokens

    hf = imported[arch][0]
    _, runs = expert_parallel
    result = export_hf(runs / arch / "checkpoints", tmp_path / "back", arch=arch, verify=True,
                       log=lambda line: None)
    assert result.max_logit_diff <= BAR
    # Trained at the model's context with its balancing: nothing in its config changed, and its
    # tokenizer comes along without --tokenizer.
    assert_is_the_source_model(hf, tmp_path / "back")
    tokens = sample_tokens(4096)
    moved = hf_logits(load_hf_model(tmp_path / "back"), tokens) - hf_logits(load_hf_model(hf),
                                                                         tokens)
    assert float(moved.abs().max()) > 1e-3
    original, trained = saved_tensors(hf), saved_tensors(tmp_path / "back")
    biases = [name for name in original if name.endswith("e_score_correction_bias")]
    assert bool(biases) == (arch in CORRECTION_BIAS_ARCHS)
    for name in biases:
        step = (trained[name] - original[name]).abs()
        assert float(step.max()) <= TRAIN_STEPS * 1e-3 + 1e-6 and float(step.min()) > 0, name


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_round_trip_without_training_is_the_source_model(imported, arch, tmp_path):
    """Import then export (no --arch, no --tokenizer): bit-identical tensors, and the source's
    config.json, tokenizer and generation ids."""
    import torch

    from megamoe.interop.hf_export import export_hf

    hf, folder, _ = imported[arch]
    result = export_hf(folder, tmp_path / "back", log=lambda line: None)
    assert result.arch == arch
    original, back = saved_tensors(hf), saved_tensors(tmp_path / "back")
    assert sorted(original) == sorted(back)
    changed = [name for name in original if not torch.equal(original[name], back[name])]
    assert not changed, changed[:3]
    assert_is_the_source_model(hf, tmp_path / "back")


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_train_config_trains_on_the_models_own_tokenizer(imported, expert_parallel, arch):
    """The import's train_config.yaml names the model's tokenizer, which writes documents as
    transformers' AutoTokenizer does plus its end of sequence, and the run made from it (at
    EP=2) recorded that tokenizer in its checkpoint."""
    import yaml
    from transformers import AutoTokenizer

    from megamoe.checkpointing.safe_dcp import load_common_state
    from megamoe.train.checkpoint import resolve_weights_dir
    from megamoe.train.tokenizer import load_tokenizer

    hf, folder, _ = imported[arch]
    data = yaml.safe_load((folder / TRAIN_CONFIG).read_text())["data"]
    assert Path(data["tokenizer"]) == folder.resolve() / "release" / "tokenizer"
    ours, reference = load_tokenizer(data["tokenizer"]), AutoTokenizer.from_pretrained(hf)
    assert ours.encode_document(TEXT) == reference(TEXT).input_ids + [reference.eos_token_id]
    _, runs = expert_parallel
    common = load_common_state(resolve_weights_dir(runs / arch / "checkpoints"))
    assert common["tokenizer"]["fingerprint"] == ours.fingerprint


def _cli(tool: str, *args: str) -> subprocess.CompletedProcess:
    return warm_launcher.run([sys.executable, f"tools/{tool}", *args], cwd=REPO,
                             capture_output=True, text=True, timeout=300)


def test_refusals_are_one_line_and_leave_nothing(tmp_path):
    cases = {  # architecture, config overrides -> the field the error must name
        "sliding_window": ("mixtral", {"sliding_window": 16}),
        "n_group": ("deepseek_v3", {"n_group": 3}),
        "attention_bias": ("qwen3_moe", {"attention_bias": True}),
        "partial_rotary_factor": ("glm4_moe", {"partial_rotary_factor": 0.3}),  # 9 channels
        "qk_norm_type": ("minimax_m2", {"qk_norm_type": "per_head"}),
    }
    for field, (arch, overrides) in cases.items():
        hf = save_tiny_hf_model(arch, tmp_path / field, **overrides)
        done = _cli("import_hf.py", "--load", str(hf), "--save", str(tmp_path / "out"),
                    "--no-progress")
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and field in lines[0], done.stderr
        assert not (tmp_path / "out").exists()


def test_a_broken_tokenizer_or_another_models_tokenizer_is_refused(imported, tmp_path):
    """Importing a model whose tokenizer.json is not one, and exporting a checkpoint with
    --tokenizer naming another tokenizer than the one it was trained with: one line naming the
    file or both tokenizers, exit code 2, nothing written."""
    import shutil

    hf = tmp_path / "hf"
    shutil.copytree(imported["qwen3_moe"][0], hf)
    (hf / "tokenizer.json").write_text('{"model": 3}')
    done = _cli("import_hf.py", "--load", str(hf), "--save", str(tmp_path / "out"),
                "--no-progress")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "tokenizer.json" in lines[0], done.stderr
    assert not (tmp_path / "out").exists()
    folder, other = imported["qwen3_moe"][1], imported["deepseek_v3"][0]
    done = _cli("export_hf.py", "--load", str(folder), "--save", str(tmp_path / "out"),
                "--tokenizer", str(other))
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert str(other) in lines[0] and "is not the tokenizer" in lines[0], lines[0]
    assert not (tmp_path / "out").exists()


def _deepseek_config(directory: Path, **fields) -> Path:
    """A DeepSeek-V3 config.json only (the config reader needs no weights)."""
    from transformers import AutoConfig

    from hf_models import ARCHS, BASE

    AutoConfig.for_model("deepseek_v3", **{**BASE, **ARCHS["deepseek_v3"], **fields}
                         ).save_pretrained(str(directory))
    return directory


def test_deepseek_routing_and_dense_layers_read_as_transformers_runs_them(tmp_path):
    """Groups scored by their top 2 whatever the top-k (8 groups of 2, 2 chosen, top-2: not
    Megatron's topk/groups_per_token = 1); first_k_dense_replace=0 means every layer MoE, and
    every layer dense is refused."""
    from megamoe.checkpointing.hf import read_hf_moe_model
    from megamoe.errors import CheckpointError

    model = read_hf_moe_model(_deepseek_config(tmp_path / "a", n_routed_experts=16, n_group=8,
                                               topk_group=2, first_k_dense_replace=0))
    router = model.train_sections()["moe"]["router"]
    assert (router["num_groups"], router["groups_per_token"], router["group_score_topk"]) == (
        8, 2, 2)
    assert model.moe.pattern == (True, True)
    with pytest.raises(CheckpointError, match="first_k_dense_replace=2 is not supported"):
        read_hf_moe_model(_deepseek_config(tmp_path / "b", first_k_dense_replace=2))


def test_a_model_of_another_vocabulary_is_refused_not_partly_loaded(imported):
    """DCP alone would load the checkpoint's 4096 embedding rows into a larger model and leave
    the rest random: the load names the tensor and both shapes instead."""
    import yaml

    from megamoe.errors import CheckpointError
    from megamoe.upcycle.hf_logits import megamoe_logits, sample_tokens

    folder = imported["mixtral"][1]
    sections = yaml.safe_load((folder / TRAIN_CONFIG).read_text())
    assert sections["data"]["vocab_size"] == 4096
    with pytest.raises(CheckpointError, match=r"word_embeddings.weight of shape \(4096, 64\), "
                       r"this run's model \(8192, 64\).*data.vocab_size=4096"):
        megamoe_logits(folder / "release", {**sections, "vocab_size": 8192}, sample_tokens(8))

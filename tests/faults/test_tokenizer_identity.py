"""One tokenizer identity through the trainer (issue 45), with real `python -m megamoe.train`
processes: the default corpus tokenized with a configured Hugging Face tokenizer (Qwen's
arrangement: a tokenizer.json with pad = eos), recorded in every checkpoint with a copy of its
files; a resume or an init_from on another tokenizer's data refused in one line (exit 2,
nothing trained or written); Megatron-LM-made data (no identity record) with ids beyond the
vocabulary or without end-of-document tokens refused in one line.

References are independent of the code under test: transformers' AutoTokenizer encoding the
corpus, and data written with Megatron-Core's own IndexedDatasetBuilder."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from ckpt_fault_helpers import assert_one_line_error, train
from tiny_tokenizers import DEEPSEEK_EOS, QWEN_SPECIAL, save_deepseek_like, save_qwen_like

from megamoe.checkpointing.layout import latest_checkpoint
from megamoe.checkpointing.safe_dcp import load_common_state
from megamoe.train.corpus import default_dataset_dir
from megamoe.train.tokenizer import load_tokenizer

STEPS = 3  # ckpt_fault_helpers.SMALL_RUN: a checkpoint after each


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    return {"qwen3_moe": save_qwen_like(root / "qwen"),
            "deepseek_v3": save_deepseek_like(root / "deepseek")}


@pytest.fixture(scope="module")
def qwen_run(corpus_cache, folders, tmp_path_factory) -> tuple[Path, str]:
    """SMALL_RUN on the default corpus with `data.tokenizer` Qwen's tokenizer folder."""
    out = tmp_path_factory.mktemp("qwen_run")
    done = train(corpus_cache, out, f"data.tokenizer={folders['qwen3_moe']}")
    assert done.returncode == 0, done.stderr[-3000:]
    return out, done.stdout


def test_the_default_corpus_is_tokenized_with_the_configured_tokenizer(qwen_run, folders,
                                                                        corpus_cache):
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from transformers import AutoTokenizer

    out, stdout = qwen_run
    tokenizer = load_tokenizer(folders["qwen3_moe"])
    dataset = default_dataset_dir(corpus_cache, tokenizer=tokenizer)
    record = json.loads((dataset / "text_document.tokenizer-identity.json").read_text())
    assert record["fingerprint"] == tokenizer.fingerprint
    reference = AutoTokenizer.from_pretrained(str(folders["qwen3_moe"]))
    eod = reference.convert_tokens_to_ids(QWEN_SPECIAL[0])
    texts = [json.loads(line)["text"] for line in
             (dataset / "corpus.jsonl").read_text(encoding="utf-8").splitlines()]
    written = IndexedDataset(str(dataset / "text_document"))
    assert len(written) == len(texts)
    for i in (0, 1, len(texts) // 2, len(texts) - 1):
        expected = reference(texts[i])["input_ids"] + [eod]
        assert written[i].tolist() == expected, i
    assert tokenizer.describe() in stdout  # the run says which tokenizer its data is
    checkpoint = latest_checkpoint(out / "checkpoints")
    assert checkpoint.name == f"iter_{STEPS:07d}"
    assert load_common_state(checkpoint)["tokenizer"]["fingerprint"] == tokenizer.fingerprint
    copied = checkpoint / "tokenizer"
    assert (copied / "tokenizer.json").read_bytes() == \
        (folders["qwen3_moe"] / "tokenizer.json").read_bytes()
    assert load_tokenizer(copied).fingerprint == tokenizer.fingerprint


def test_resume_on_another_tokenizer_is_refused_and_on_its_own_goes_on(qwen_run, folders,
                                                                       corpus_cache):
    out, _ = qwen_run
    qwen, deepseek = (load_tokenizer(folders[a]) for a in ("qwen3_moe", "deepseek_v3"))
    before = sorted(p.name for p in (out / "checkpoints").iterdir())
    done = train(corpus_cache, out, f"data.tokenizer={folders['deepseek_v3']}",
                 f"training.train_steps={STEPS + 1}")
    assert_one_line_error(done, f"iter_{STEPS:07d}", qwen.describe(), deepseek.describe(),
                          "checkpoint.allow_other_tokenizer=true",
                          f"data.tokenizer={out / 'checkpoints' / f'iter_{STEPS:07d}'}")
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before
    done = train(corpus_cache, out, f"data.tokenizer={folders['qwen3_moe']}",
                 f"training.train_steps={STEPS + 1}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"starting from {out / 'checkpoints' / f'iter_{STEPS:07d}'}" in done.stdout


def test_init_from_on_another_tokenizer_is_refused(qwen_run, folders, corpus_cache, tmp_path):
    """The weights trained on Qwen's ids, started on the default corpus's own tokenizer."""
    out, _ = qwen_run
    fresh = tmp_path / "fresh"
    done = train(corpus_cache, fresh, f"checkpoint.init_from={out / 'checkpoints'}")
    own = load_tokenizer(default_dataset_dir(corpus_cache) / "text_document.model")
    assert_one_line_error(done, own.describe(), load_tokenizer(folders["qwen3_moe"]).describe())
    assert not fresh.exists()


def _megatron_data(prefix: Path, documents: list[list[int]]) -> Path:
    """Data as Megatron-LM's preprocess_data.py writes it (Megatron-Core's builder), with no
    tokenizer identity beside it."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for ids in documents:
        builder.add_document(torch.tensor(ids, dtype=torch.int64), [len(ids)])
    builder.finalize(f"{prefix}.idx")
    return prefix


@pytest.mark.parametrize("damage, message", [
    ("no_eod", "document 0 ends with token"), ("beyond", "outside the tokenizer's")])
def test_megatron_lm_data_is_checked_against_the_tokenizer(damage, message, folders,
                                                           corpus_cache, tmp_path):
    from tokenizers import Tokenizer

    folder = folders["deepseek_v3"]
    backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
    eod = backend.token_to_id(DEEPSEEK_EOS)
    texts = [f"Document {i}: the router sends token {i} to an expert." for i in range(200)]
    documents = [backend.encode(text).ids + [eod] for text in texts]
    if damage == "no_eod":
        documents[0] = documents[0][:-1]
    else:
        documents[7][3] = backend.get_vocab_size() + 5
    prefix = _megatron_data(tmp_path / damage, documents)
    out = tmp_path / "run"
    done = train(corpus_cache, out, f"data.prefixes=[{prefix}]", f"data.tokenizer={folder}")
    assert_one_line_error(done, f"{prefix}.bin", message, "data.tokenizer")
    assert not out.exists()

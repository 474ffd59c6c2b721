"""The trainer's tokenizer identity checks (issue 45), on the tiny tokenizers released models
ship (tests/tiny_tokenizers.py): data made by megamoe must record the configured tokenizer, data
made elsewhere (Megatron's own IndexedDatasetBuilder, as Megatron-LM's preprocess_data.py uses it)
must hold its ids and end documents in its end of document, a checkpoint's record must be
well-formed and the run's, and a pad id equal to the end of document never masks the loss.

References are independent of the code under test: the `tokenizers` library encoding the text
directly, and the token stream the datasets were written from."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
from tiny_tokenizers import (DEEPSEEK_EOS, TEXTS, save_deepseek_like, save_qwen_like,
                             with_config)

from megamoe.errors import CheckpointError, DataError
from megamoe.train.checkpoint_schema import saved_tokenizer
from megamoe.train.checkpoint_tokenizer import (check_checkpoint_tokenizer, tokenizer_record,
                                                write_checkpoint_files)
from megamoe.train.config import load_config
from megamoe.train.data import build_gpt_datasets
from megamoe.train.inputs import check_data_tokenizer
from megamoe.train.tokenizer import load_tokenizer, write_dataset_identity

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny_cpu.yaml"


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict:
    """name -> (folder, loaded tokenizer) of two tokenizers with pad = eos (Qwen, DeepSeek)."""
    root = tmp_path_factory.mktemp("tokenizers")
    folders = {"qwen3_moe": save_qwen_like(root / "qwen"),
               "deepseek_v3": save_deepseek_like(root / "deepseek")}
    return {name: (folder, load_tokenizer(folder)) for name, folder in folders.items()}


def megatron_dataset(prefix: Path, documents: list[list[int]]) -> str:
    """`documents` written with Megatron-Core's own builder, as Megatron-LM's
    preprocess_data.py writes them (one sequence per document)."""
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for ids in documents:
        builder.add_document(torch.tensor(ids, dtype=torch.int64), [len(ids)])
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def encoded(folder: Path, eos: str, end: bool = True) -> list[list[int]]:
    """The texts of TEXTS as the `tokenizers` library encodes them, each followed by
    the id of `eos` (when `end`), as `preprocess_data.py --append-eod` writes them."""
    from tokenizers import Tokenizer

    backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
    eod = backend.token_to_id(eos)
    return [backend.encode(line, add_special_tokens=False).ids + ([eod] if end else [])
            for line in TEXTS]


def test_data_made_elsewhere_is_checked_for_ids_and_document_ends(tokenizers, tmp_path):
    folder, tokenizer = tokenizers["deepseek_v3"]
    documents = encoded(folder, DEEPSEEK_EOS)
    check_data_tokenizer(megatron_dataset(tmp_path / "good", documents), tokenizer)

    unended = documents[:5] + [documents[5][:-1]] + documents[6:]
    prefix = megatron_dataset(tmp_path / "unended", unended)
    with pytest.raises(DataError, match=f"unended.bin: document 5 .*end-of-document id "
                       f"{tokenizer.eod}") as caught:
        check_data_tokenizer(prefix, tokenizer)
    assert "\n" not in str(caught.value) and "data.tokenizer" in str(caught.value)
    prefix = megatron_dataset(tmp_path / "no_eod", encoded(folder, DEEPSEEK_EOS, end=False))
    with pytest.raises(DataError, match="no_eod.bin: document 0 "):
        check_data_tokenizer(prefix, tokenizer)

    beyond = documents[:3] + [documents[3][:-1] + [tokenizer.vocab_size, tokenizer.eod]]
    prefix = megatron_dataset(tmp_path / "beyond", beyond)
    with pytest.raises(DataError, match=f"beyond.bin holds token id {tokenizer.vocab_size} "
                       f".*outside the tokenizer's {tokenizer.vocab_size} ids"):
        check_data_tokenizer(prefix, tokenizer)


def test_data_made_by_megamoe_must_record_the_configured_tokenizer(tokenizers, tmp_path):
    (folder, deepseek), (_, qwen) = tokenizers["deepseek_v3"], tokenizers["qwen3_moe"]
    prefix = megatron_dataset(tmp_path / "data", encoded(folder, DEEPSEEK_EOS))
    write_dataset_identity(prefix, deepseek)
    check_data_tokenizer(prefix, deepseek)
    with pytest.raises(DataError) as caught:
        check_data_tokenizer(prefix, qwen)
    message = str(caught.value)
    for fragment in (deepseek.fingerprint[:12], qwen.fingerprint[:12], str(folder),
                     "set data.tokenizer", "tools/preprocess_data.py --tokenizer"):
        assert fragment in message, message
    assert "\n" not in message


def test_data_without_a_record_says_so(tokenizers, tmp_path):
    folder, tokenizer = tokenizers["deepseek_v3"]
    prefix = megatron_dataset(tmp_path / "made_elsewhere", encoded(folder, DEEPSEEK_EOS))
    assert check_data_tokenizer(prefix, tokenizer) == "no tokenizer record: ids range-checked only"
    write_dataset_identity(prefix, tokenizer)
    assert check_data_tokenizer(prefix, tokenizer) is None


def test_a_pad_token_alone_does_not_make_data_incompatible(tokenizers, tmp_path):
    """The same vocabulary, rules, BOS and end of document with another pad token (Megatron
    never feeds pads to the loss): another fingerprint, the same ids, so the data is accepted."""
    folder, qwen = tokenizers["qwen3_moe"]
    repadded = load_tokenizer(with_config(folder, tmp_path / "other_pad", pad_token="<|im_end|>"))
    assert repadded.pad != qwen.pad and repadded.fingerprint != qwen.fingerprint
    prefix = megatron_dataset(tmp_path / "data", encoded(folder, "<|endoftext|>"))
    write_dataset_identity(prefix, qwen)
    assert check_data_tokenizer(prefix, repadded) is None


def test_a_mismatch_names_the_components_that_differ(tokenizers, tmp_path):
    """Merges trained on other text (same specials, same size): the refusal says "merges"
    and "vocabulary" (the learnt tokens differ too), not the pre-tokenizer or the ends."""
    from tiny_tokenizers import save_qwen_like

    folder, qwen = tokenizers["qwen3_moe"]
    other = load_tokenizer(save_qwen_like(tmp_path / "smaller", vocab_size=300))
    prefix = megatron_dataset(tmp_path / "data", encoded(folder, "<|endoftext|>"))
    write_dataset_identity(prefix, qwen)
    with pytest.raises(DataError) as caught:
        check_data_tokenizer(prefix, other)
    assert "(they differ in vocabulary, merges)" in str(caught.value)
    assert "\n" not in str(caught.value)


def test_a_record_copied_beside_other_data_is_caught(tokenizers, tmp_path):
    folder, tokenizer = tokenizers["deepseek_v3"]
    documents = encoded(folder, DEEPSEEK_EOS)
    recorded = megatron_dataset(tmp_path / "recorded", documents)
    write_dataset_identity(recorded, tokenizer)
    other = megatron_dataset(tmp_path / "other", documents[:7])
    shutil.copy(f"{recorded}.tokenizer-identity.json", f"{other}.tokenizer-identity.json")
    with pytest.raises(DataError, match=r"other\.tokenizer-identity\.json describes other "
                       r"data: its \.idx checksum is not that of .*other\.idx"):
        check_data_tokenizer(other, tokenizer)


@pytest.mark.parametrize("eod_mask_loss", [False, True])
def test_a_pad_equal_to_the_end_of_document_never_masks_it(tokenizers, tmp_path, eod_mask_loss):
    """DeepSeek's pad is its end of document (id 1): every document end keeps its loss and its
    id (Megatron-LM PR #2017), unless eod_mask_loss asks otherwise."""
    folder, tokenizer = tokenizers["deepseek_v3"]
    assert tokenizer.pad == tokenizer.eod == 1
    documents = encoded(folder, DEEPSEEK_EOS)
    prefix = megatron_dataset(tmp_path / "data", documents)
    seq_length = 64
    total = sum(map(len, documents))
    train, _, _ = build_gpt_datasets(
        [prefix], tokenizer, seq_length=seq_length, seed=1, num_samples=(None, None, None),
        index_cache_dir=tmp_path / "index", split="100,0,0", eod_mask_loss=eod_mask_loss)
    assert not any(0 in d for d in documents)  # id 0 (DeepSeek's BOS) is not in the data
    ends = 0
    for i in range(len(train)):
        sample = train[i]
        tokens, labels = sample["tokens"].numpy(), sample["labels"].numpy()
        mask = sample["loss_mask"].numpy()
        # no end of document was taken for padding: Megatron would have replaced it by 0
        assert 0 not in tokens and 0 not in labels
        assert np.array_equal(tokens[1:], labels[:-1])
        ends += int((labels == tokenizer.eod).sum())
        # Megatron's eod_mask_loss masks the positions whose input is an end of document
        expected = (tokens != tokenizer.eod) if eod_mask_loss else np.ones_like(mask, bool)
        assert np.array_equal(mask.astype(bool), expected), (i, tokens, mask)
    # the samples cover the stream (one epoch), so they predict its ends of document
    assert len(train) * seq_length >= total - seq_length and ends > len(documents) // 2


def test_a_checkpoint_records_its_tokenizer_or_nothing(tokenizers, tmp_path):
    _, tokenizer = tokenizers["qwen3_moe"]
    record = tokenizer_record(tokenizer)
    assert saved_tokenizer({"format_version": 1}, tmp_path) is None  # older checkpoints
    assert saved_tokenizer({"tokenizer": record}, tmp_path) == record
    unnamed = {k: v for k, v in record.items() if k != "source"}  # as an import may write it
    assert saved_tokenizer({"tokenizer": unnamed}, tmp_path) == unnamed
    assert record["source"] == str(tokenizer.path)
    assert record["fingerprint"] == tokenizer.fingerprint
    for bad in ("qwen", {**record, "fingerprint": "xyz"}, {**record, "vocab_size": "400"},
                {**record, "eod": record["vocab_size"]}, {**record, "add_bos": 0},
                {**record, "source": 3},
                {k: v for k, v in record.items() if k != "kind"}):
        with pytest.raises(CheckpointError, match="tokenizer record .* malformed .* corrupt"):
            saved_tokenizer({"tokenizer": bad}, tmp_path)


def test_a_checkpoint_of_another_tokenizer_is_refused_unless_allowed(tokenizers, tmp_path,
                                                                     capsys):
    (_, qwen), (_, deepseek) = tokenizers["qwen3_moe"], tokenizers["deepseek_v3"]
    common = {"tokenizer": tokenizer_record(qwen)}
    config = load_config(TINY)
    check_checkpoint_tokenizer(common, tmp_path, qwen, config)
    check_checkpoint_tokenizer({}, tmp_path, deepseek, config)  # records none: nothing to check
    with pytest.raises(CheckpointError) as caught:
        check_checkpoint_tokenizer(common, tmp_path, deepseek, config)
    message = str(caught.value)
    for fragment in (qwen.describe(), deepseek.describe(), "checkpoint.allow_other_tokenizer",
                     "data.tokenizer"):
        assert fragment in message, message
    allowed = load_config(TINY, ["checkpoint.allow_other_tokenizer=true"])
    check_checkpoint_tokenizer(common, tmp_path, deepseek, allowed)
    assert "training it anyway" in capsys.readouterr().err
    assert json.dumps(common)  # the record is plain data, as common states must be


def test_a_checkpoint_folder_gets_the_tokenizer_and_the_source_configs(tokenizers, tmp_path):
    """The tokenizer's files, and hf_source/ from the first origin that has one (the import the
    run started from, else its newest earlier checkpoint)."""
    folder, tokenizer = tokenizers["qwen3_moe"]
    imported, earlier = tmp_path / "import" / "release", tmp_path / "iter_0000001"
    (earlier / "hf_source").mkdir(parents=True)
    (earlier / "hf_source" / "config.json").write_text('{"model_type": "qwen3_moe"}')
    imported.mkdir(parents=True)
    saved = tmp_path / "iter_0000002"
    saved.mkdir()
    write_checkpoint_files(saved, tokenizer, [None, imported, earlier])
    assert (saved / "tokenizer" / "tokenizer.json").read_bytes() == \
        (folder / "tokenizer.json").read_bytes()
    assert load_tokenizer(saved / "tokenizer").fingerprint == tokenizer.fingerprint
    assert (saved / "hf_source" / "config.json").read_text() == '{"model_type": "qwen3_moe"}'
    bare = tmp_path / "bare"
    bare.mkdir()
    write_checkpoint_files(bare, None, [imported])
    assert list(bare.iterdir()) == []


def test_checkpoints_write_the_tokenizer_bytes_loaded_at_start(tokenizers, tmp_path):
    """The source folder edited, then removed, mid-run (as a rotated checkpoint's tokenizer/
    would be): each save still writes the files the run loaded and fingerprinted."""
    source = shutil.copytree(tokenizers["qwen3_moe"][0], tmp_path / "source")
    original = {p.name: p.read_bytes() for p in source.iterdir()}
    tokenizer = load_tokenizer(source)
    (source / "tokenizer.json").write_text("{}")
    first = tmp_path / "iter_0000001"
    first.mkdir()
    write_checkpoint_files(first, tokenizer, [])
    shutil.rmtree(source)
    second = tmp_path / "iter_0000002"
    second.mkdir()
    write_checkpoint_files(second, tokenizer, [])
    for saved in (first, second):
        written = saved / "tokenizer"
        assert (written / "tokenizer.json").read_bytes() == original["tokenizer.json"]
        assert load_tokenizer(written).fingerprint == tokenizer.fingerprint

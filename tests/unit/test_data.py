"""Data pipeline: preprocessing into indexed datasets, the default corpus, and training batches.

References are independent of the code under test: sentencepiece called directly, documents
split by a regular expression, sample indices computed by the sampler's formula, expected
corpus text written out by hand or taken from `inspect.getdoc`.
"""

import inspect
import itertools
import json
import re
import shelve
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm
import torch

from megamoe.errors import ConfigError, DataError, MegaMoEError, run_cli
from megamoe.train import corpus, data
from megamoe.train.data import build_gpt_datasets, iterate_batches
from megamoe.train.data_prep import preprocess
from megamoe.train.tokenizer import SentencePieceTokenizer

from megatron.core.datasets.indexed_dataset import IndexedDataset
from tool_modules import tool_module

VOCAB = 512
SEQ = 32


CLI_MAIN = tool_module("preprocess_data").main

JSON_DOCS = [
    inspect.getdoc(obj)
    for module in (json, re, shelve, inspect)
    for _, obj in sorted(vars(module).items())
    if inspect.isfunction(obj) and inspect.getdoc(obj) and len(inspect.getdoc(obj)) > 30
]
TEXT = (
    "The first paragraph has two lines;\nthis is the second line.\n"
    "\n\n"
    "Unicode survives: naïve café, 東京, emoji \U0001f600.\n"
    "   \n"
    "Indented   spacing\n    and a tab\tstay as written."
)


def reference_text_docs(text):
    return [p for p in re.split(r"\n[ \t]*\n(?:[ \t]*\n)*", text.strip("\n")) if p.strip()]


def run(argv, capsys):
    """Run the CLI in-process; return (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as exit_info:
        run_cli(CLI_MAIN, [str(a) for a in argv] + ["--no-progress"])
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("inputs")
    jsonl = root / "docs.jsonl"
    jsonl.write_text(
        "".join(json.dumps({"text": d, "n": i}) + "\n" for i, d in enumerate(JSON_DOCS))
    )
    txt = root / "notes.txt"
    txt.write_text(TEXT)
    return jsonl, txt


@pytest.fixture(scope="module")
def prepared(inputs, tmp_path_factory):
    prefix = tmp_path_factory.mktemp("prepared") / "corpus"
    summary = preprocess(list(inputs), prefix, vocab_size=VOCAB, progress=False)
    return str(prefix), str(prefix) + ".model", summary


# ---------------------------------------------------------------- preprocessing


def test_indexed_dataset_matches_sentencepiece(prepared):
    prefix, model, summary = prepared
    sp = spm.SentencePieceProcessor(model_file=model)
    docs = JSON_DOCS + reference_text_docs(TEXT)
    ds = IndexedDataset(prefix)
    assert len(ds) == len(docs) == summary.documents
    assert list(ds.document_indices) == list(range(len(docs) + 1))
    for i, doc in enumerate(docs):
        expected = sp.encode(doc) + [sp.eos_id()]
        assert ds[i].tolist() == expected
        assert sp.decode(expected[:-1]) == doc  # lossless: whitespace and unicode kept
    assert summary.tokens == int(ds.sequence_lengths.sum())
    assert sp.get_piece_size() == VOCAB


def test_cli_with_existing_tokenizer(prepared, inputs, tmp_path, capsys):
    _, model, _ = prepared
    prefix = tmp_path / "again"
    code, out, err = run(
        ["--input", inputs[1], "--output-prefix", prefix, "--tokenizer-model", model], capsys
    )
    assert code == 0, err
    docs = reference_text_docs(TEXT)
    assert re.fullmatch(
        rf"wrote .*again\.bin/\.idx: {len(docs)} documents, \d+ tokens in [\d.]+ s .*\n", out
    )
    sp = spm.SentencePieceProcessor(model_file=model)
    ds = IndexedDataset(str(prefix))
    assert [ds[i].tolist() for i in range(len(ds))] == [sp.encode(d) + [sp.eos_id()] for d in docs]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "again.bin", "again.idx", "again.tokenizer-identity.json"]


def test_json_key(tmp_path, prepared, capsys):
    src = tmp_path / "k.jsonl"
    src.write_text(json.dumps({"body": "custom key text"}) + "\n")
    code, _, err = run(
        [
            "--input",
            src,
            "--output-prefix",
            tmp_path / "k",
            "--tokenizer-model",
            prepared[1],
            "--json-key",
            "body",
        ],
        capsys,
    )
    assert code == 0, err
    sp = spm.SentencePieceProcessor(model_file=prepared[1])
    ds = IndexedDataset(str(tmp_path / "k"))  # keep a reference: items view its memory map
    assert ds[0].tolist() == sp.encode("custom key text") + [sp.eos_id()]


BAD_INPUTS = {
    "missing file": (None, "does not exist"),
    "empty corpus": ("\n  \n\n", "empty"),
    "bad json": ('{"text": "fine"}\n\n{"text": oops}\n', r"bad\.jsonl:3: not valid JSON"),
    "missing key": ('{"text": "fine"}\n{"body": "x"}\n', r"bad\.jsonl:2: no string field 'text'"),
}


@pytest.mark.parametrize("train", [True, False], ids=["train-tokenizer", "given-tokenizer"])
@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_exits_2_without_output(case, train, prepared, tmp_path, capsys):
    content, message = BAD_INPUTS[case]
    src = tmp_path / ("bad.jsonl" if "json" in case or "key" in case else "bad.txt")
    if content is not None:
        src.write_text(content)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    tok = (
        ["--train-tokenizer", "--vocab-size", VOCAB]
        if train
        else ["--tokenizer-model", prepared[1]]
    )
    code, _, err = run(["--input", src, "--output-prefix", out_dir / "ds", *tok], capsys)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("error: ") and re.search(message, err), err
    assert list(out_dir.iterdir()) == []


@pytest.mark.parametrize("suffix", [".jsonl", ".txt"])
def test_document_over_the_size_limit_is_refused(suffix, prepared, tmp_path, capsys):
    """--max-document-mb bounds one document (a worker's memory grows with it): a document
    just over 1 MiB is one line naming its file and line, exit 2, nothing written; one just
    under it is tokenized."""
    def source(name: str, words: int) -> Path:
        doc = " ".join(["word"] * words)  # 5 bytes a word, the last without its space
        path = tmp_path / f"{name}{suffix}"
        path.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"text": doc}) + "\n"
                        if suffix == ".jsonl" else f"fine\n\n{doc}\n")
        return path

    limit = 1 << 20
    over, under = source("over", limit // 5 + 1), source("under", (limit - 100) // 5)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    args = ["--tokenizer-model", prepared[1], "--max-document-mb", "1"]
    code, _, err = run(["--input", over, "--output-prefix", out_dir / "ds", *args], capsys)
    line = 2 if suffix == ".jsonl" else 3
    assert code == 2 and err.count("\n") == 1, err
    assert f"over{suffix}:{line}: a document longer than 1,048,576 bytes" in err
    assert "--max-document-mb" in err and list(out_dir.iterdir()) == []
    code, _, err = run(["--input", under, "--output-prefix", out_dir / "ds", *args], capsys)
    assert code == 0, err
    code, _, err = run(["--input", under, "--output-prefix", tmp_path / "big", *args[:-1],
                        "257"], capsys)
    assert code == 2 and "--max-document-mb 257 must be above 0 and at most 256" in err, err


def test_existing_output_needs_overwrite(inputs, prepared, tmp_path, capsys):
    prefix = tmp_path / "ds"
    (tmp_path / "ds.idx").write_text("keep me")
    argv = ["--input", inputs[1], "--output-prefix", prefix, "--tokenizer-model", prepared[1]]
    code, _, err = run(argv, capsys)
    assert code == 2 and err.count("\n") == 1 and "--overwrite" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds.idx"]
    assert (tmp_path / "ds.idx").read_text() == "keep me"
    code, _, err = run(argv + ["--overwrite"], capsys)
    assert code == 0, err
    assert len(IndexedDataset(str(prefix))) == len(reference_text_docs(TEXT))


def test_vocab_too_large_is_a_data_error(inputs, tmp_path):
    with pytest.raises(DataError, match="vocab-size"):
        preprocess([inputs[1]], tmp_path / "x", vocab_size=100_000, progress=False)
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- default corpus


def test_module_text_keeps_docstrings_and_prose_comments():
    source = (
        '"""A module docstring, long enough to be kept by the corpus filter."""\n'
        "import os\n\n"
        "# This prose comment block spans two lines and is long enough\n"
        "# to be kept, because it reads like ordinary English sentences.\n"
        'X = """\n'
        "# this line reads like a prose comment but lives inside a string literal, so skip it\n"
        '"""\n\n'
        "def f():\n"
        '    """Short."""\n'
        "    # x = [1, 2, 3]  ## a code-like comment that the prose filter drops\n"
        "    return 1\n\n"
        "class C:\n"
        '    """A class docstring that is also long enough to pass the filter."""\n'
    ).encode()
    expected = (
        "A module docstring, long enough to be kept by the corpus filter.\n\n"
        "This prose comment block spans two lines and is long enough to be kept, because it reads "
        "like ordinary English sentences.\n\n"
        "A class docstring that is also long enough to pass the filter."
    )
    assert corpus.module_text(source, set()) == expected
    seen = set()
    corpus.module_text(source, seen)
    assert corpus.module_text(source, seen) == ""  # repeated text appears once per corpus


def test_stdlib_module_text_has_the_real_docstrings():
    text = corpus.module_text(Path(shelve.__file__).read_bytes(), set())
    for obj in (shelve, shelve.Shelf, shelve.open, shelve.DbfilenameShelf):
        assert inspect.getdoc(obj) in text


def test_ensure_default_dataset_builds_once(tmp_path, monkeypatch):
    first_docs = list(itertools.islice(corpus.stdlib_documents(), 12))
    monkeypatch.setattr(corpus, "stdlib_documents", lambda: iter(first_docs))
    prefix, model = corpus.ensure_default_dataset(tmp_path, vocab_size=512, progress=False)
    sp = spm.SentencePieceProcessor(model_file=model)
    ds = IndexedDataset(prefix)
    assert len(ds) == len(first_docs)
    import __future__

    assert first_docs[0][0] == "stdlib/__future__.py"
    assert sp.decode(ds[0].tolist()[:-1]).startswith(inspect.getdoc(__future__))
    for i, (_, text) in enumerate(first_docs):
        assert sp.decode(ds[i].tolist()[:-1]) == text
    words = " ".join(text for _, text in first_docs).lower().split()
    assert sum(w in {"the", "of", "and", "to", "is", "a", "in"} for w in words) > 0.1 * len(words)

    def must_not_rebuild(*args, **kwargs):
        raise AssertionError("rebuilt a cached dataset")

    monkeypatch.setattr(corpus, "preprocess", must_not_rebuild)
    assert corpus.ensure_default_dataset(tmp_path, vocab_size=512) == (prefix, model)
    assert sorted(p.name for p in Path(prefix).parent.iterdir()) == [
        ".megamoe-owner",
        "corpus.jsonl",
        "text_document.bin",
        "text_document.idx",
        "text_document.model",
        "text_document.tokenizer-identity.json",
    ]


# ---------------------------------------------------------------- training batches


@pytest.fixture(scope="module")
def train_set(prepared, tmp_path_factory):
    prefix, model, _ = prepared
    train, valid, test = build_gpt_datasets(
        [prefix],
        SentencePieceTokenizer(model),
        seq_length=SEQ,
        seed=7,
        num_samples=(240, None, None),
        index_cache_dir=tmp_path_factory.mktemp("index"),
        split="90,10,0",
    )
    assert test is None and len(valid) > 0
    return train


def test_runs_sharing_an_index_cache_take_turns(prepared, tmp_path):
    """A run builds its indices only while no other run holds the cache folder's lock (two
    sweep jobs on one data set once read each other's half-written index)."""
    import fcntl
    import threading

    prefix, model, _ = prepared
    cache = tmp_path / "index"
    cache.mkdir()
    other_run = open(cache / ".megamoe-build.lock", "a")
    fcntl.flock(other_run, fcntl.LOCK_EX)
    built = threading.Event()

    def build():
        build_gpt_datasets([prefix], SentencePieceTokenizer(model), seq_length=SEQ, seed=7,
                           num_samples=(240, None, None), index_cache_dir=cache, split="90,10,0")
        built.set()

    thread = threading.Thread(target=build)
    thread.start()
    try:
        assert not built.wait(2.0) and not list(cache.rglob("*.npy"))
    finally:
        fcntl.flock(other_run, fcntl.LOCK_UN)
        other_run.close()
    thread.join(120)
    assert built.is_set() and list(cache.rglob("*.npy"))


def _tokens_of(dataset, index):
    return dataset[index]["tokens"]


def _joined(ids):
    return "," + ",".join(map(str, ids)) + ","


def test_samples_are_windows_of_documents(prepared, train_set):
    _, model, _ = prepared
    sp = spm.SentencePieceProcessor(model_file=model)
    docs = [_joined(sp.encode(d)) for d in JSON_DOCS + reference_text_docs(TEXT)]
    eod = sp.eos_id()
    assert len(train_set) >= 240
    for batch in itertools.islice(iterate_batches(train_set, micro_batch_size=4), 20):
        assert batch.tokens.shape == batch.labels.shape == (4, SEQ)
        assert torch.equal(batch.labels[:, :-1], batch.tokens[:, 1:])
        assert torch.equal(batch.position_ids, torch.arange(SEQ).expand(4, SEQ))
        assert torch.equal(batch.loss_mask, torch.ones(4, SEQ))
        for row in range(4):
            segments = [[]]
            for t in batch.tokens[row].tolist() + [batch.labels[row, -1].item()]:
                segments.append([]) if t == eod else segments[-1].append(t)
            first, *middle, last = [_joined(seg) for seg in segments] + (
                [] if len(segments) > 1 else [None]
            )
            if last is None:  # the window lies inside one document
                assert any(first in d for d in docs)
                continue
            assert any(d.endswith(first) for d in docs)
            assert all(m in docs for m in middle)
            assert any(d.startswith(last) for d in docs)


def test_data_parallel_ranks_get_the_sampler_slices(train_set):
    mbs, dp, start = 2, 3, 12
    for rank in range(dp):
        batches = list(
            iterate_batches(
                train_set, micro_batch_size=mbs, dp_rank=rank, dp_size=dp, start_sample=start
            )
        )
        assert len(batches) == (len(train_set) - start) // (mbs * dp)
        for step, batch in enumerate(batches[:5]):
            first = start + step * mbs * dp + rank * mbs
            expected = torch.stack([_tokens_of(train_set, g) for g in range(first, first + mbs)])
            assert torch.equal(batch.tokens, expected)


def test_resume_continues_exactly(train_set):
    full = list(iterate_batches(train_set, micro_batch_size=3, dp_rank=1, dp_size=2))
    resumed = list(
        iterate_batches(train_set, micro_batch_size=3, dp_rank=1, dp_size=2, start_sample=5 * 6)
    )
    assert len(resumed) == len(full) - 5
    for a, b in zip(full[5:], resumed):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_loader_workers_give_the_same_batches(train_set):
    plain = list(itertools.islice(iterate_batches(train_set, micro_batch_size=4), 6))
    workers = list(
        itertools.islice(iterate_batches(train_set, micro_batch_size=4, num_workers=2), 6)
    )
    assert all(torch.equal(a.tokens, b.tokens) for a, b in zip(plain, workers))


def test_rebuild_is_deterministic_and_seeded(prepared, train_set, tmp_path):
    prefix, model, _ = prepared

    def build(seed):
        return build_gpt_datasets(
            [prefix],
            SentencePieceTokenizer(model),
            seq_length=SEQ,
            seed=seed,
            num_samples=(240, None, None),
            index_cache_dir=tmp_path / f"fresh{seed}",
            split="90,10,0",
        )[0]

    same, other = build(7), build(8)
    first = [_tokens_of(train_set, i) for i in range(16)]
    assert all(torch.equal(a, _tokens_of(same, i)) for i, a in enumerate(first))
    assert not all(torch.equal(a, _tokens_of(other, i)) for i, a in enumerate(first))


def test_weighted_blend_and_eod_mask(prepared, tmp_path):
    prefix, model, _ = prepared
    tok = SentencePieceTokenizer(model)
    train, _, _ = build_gpt_datasets(
        [prefix, prefix],
        tok,
        seq_length=SEQ,
        seed=3,
        num_samples=(400, 20, None),
        index_cache_dir=tmp_path,
        split="90,10,0",
        weights=[1, 3],
        eod_mask_loss=True,
    )
    ids = np.array([train[i]["dataset_id"] for i in range(400)])
    assert abs((ids == 0).sum() - 100) <= 1
    for batch in itertools.islice(iterate_batches(train, micro_batch_size=8), 5):
        assert torch.equal(batch.loss_mask == 0, batch.tokens == tok.eod)


def test_dataset_errors(prepared, tmp_path, monkeypatch):
    prefix, model, _ = prepared
    tok = SentencePieceTokenizer(model)
    kwargs = dict(seq_length=SEQ, seed=1, num_samples=(10, None, None), index_cache_dir=tmp_path)
    with pytest.raises(DataError, match="tools/preprocess_data.py"):
        build_gpt_datasets([str(tmp_path / "missing")], tok, **kwargs)
    with pytest.raises(DataError, match="valid split"):
        build_gpt_datasets([prefix], tok, split="999,1,0", **kwargs)
    with pytest.raises(ConfigError, match="split"):
        build_gpt_datasets([prefix], tok, split="train", **kwargs)
    with pytest.raises(ConfigError, match="weights"):
        build_gpt_datasets([prefix], tok, weights=[1, 2], **kwargs)
    monkeypatch.setattr(data.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(MegaMoEError, match="helpers_cpp"):
        build_gpt_datasets([prefix], tok, **kwargs)


def test_iterator_errors(train_set):
    with pytest.raises(DataError, match="start sample"):
        iterate_batches(train_set, micro_batch_size=2, start_sample=len(train_set) + 1)
    with pytest.raises(ConfigError, match="dp_rank"):
        iterate_batches(train_set, micro_batch_size=2, dp_rank=2, dp_size=2)


def test_tokenizer_errors(tmp_path):
    with pytest.raises(DataError, match="cannot read"):
        SentencePieceTokenizer(tmp_path / "none.model")
    (tmp_path / "junk.model").write_bytes(b"not a model")
    with pytest.raises(DataError, match="not a SentencePiece model"):
        SentencePieceTokenizer(tmp_path / "junk.model")

"""Every tokenizer kind a released model ships, through load_tokenizer and tools/preprocess_data.py.

The reference for the ids is transformers' AutoTokenizer on the same folder (what Megatron-LM's
preprocess_data.py --tokenizer-type HuggingFaceTokenizer --append-eod writes), plus the EOS id
looked up by its text; the reference for the index format is Megatron-Core's own
IndexedDatasetBuilder. Tokenizers are built in the test (tests/tiny_tokenizers.py).
"""
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from megamoe.errors import DataError, MegaMoEError, run_cli
from megamoe.train import data_prep
from megamoe.train.data_prep import preprocess
from megamoe.train.tokenizer import (copy_tokenizer, identity, load_tokenizer,
                                     read_dataset_identity)
from megamoe.train.tokenizer import hf as tokenizer_hf
from megatron.core.datasets.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder
from tiny_tokenizers import (DEEPSEEK_BOS, DEEPSEEK_EOS, save_deepseek_like, save_mixtral_like,
                             save_qwen_like, with_config)
from tool_modules import tool_module

ROOT = Path(__file__).resolve().parents[2]
CLI_MAIN = tool_module("preprocess_data").main
DOCS = [
    "The quick brown fox jumps over the lazy dog.",
    "  leading and  double  spaces\n\nand a blank line\n",
    "naïve café 東京 \U0001f600\ttab",
    "special tokens in text: <|endoftext|> </s> <s> " + DEEPSEEK_EOS,
    "",  # no token: left out, as Megatron-LM leaves it out
    "   ",
    "x",
] * 7
EOS_TEXT = {"qwen": "<|endoftext|>", "qwen-json-only": "<|endoftext|>",
            "deepseek": DEEPSEEK_EOS, "mixtral": "</s>"}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    return {"qwen": save_qwen_like(root / "qwen"),
            "qwen-json-only": save_qwen_like(root / "qwen-json-only", config=False),
            "deepseek": save_deepseek_like(root / "deepseek"),
            "mixtral": save_mixtral_like(root / "mixtral")}


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory):
    path = tmp_path_factory.mktemp("inputs") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(DOCS)))
    return path


def run(argv, capsys):
    """Run the CLI in-process; return (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as exit_info:
        run_cli(CLI_MAIN, [str(a) for a in argv] + ["--no-progress"])
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


def reference_documents(folder: Path, eos_text: str) -> list[list[int]]:
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(str(folder))
    eod = auto.convert_tokens_to_ids(eos_text)
    return [auto(d)["input_ids"] + [eod] for d in DOCS if auto(d)["input_ids"]]


@pytest.mark.parametrize("kind", list(EOS_TEXT))
def test_preprocess_writes_autotokenizer_ids_and_eod(kind, tokenizers, jsonl, tmp_path, capsys):
    prefix = tmp_path / "ds"
    code, out, err = run(["--input", jsonl, "--output-prefix", prefix,
                          "--tokenizer", tokenizers[kind], "--workers", 2], capsys)
    assert code == 0, err
    expected = reference_documents(tokenizers[kind], EOS_TEXT[kind])
    ds = IndexedDataset(str(prefix))
    assert [ds[i].tolist() for i in range(len(ds))] == expected
    assert re.fullmatch(rf"wrote .*ds\.bin/\.idx: {len(expected)} documents, "
                        rf"{sum(map(len, expected))} tokens in .*\n", out)
    # Byte for byte what Megatron-Core's builder writes for these documents.
    tok = load_tokenizer(tokenizers[kind])
    builder = IndexedDatasetBuilder(str(tmp_path / "ref.bin"),
                                    dtype=DType.optimal_dtype(tok.vocab_size))
    for doc in expected:
        builder.add_document(np.array(doc), [len(doc)])
    builder.finalize(str(tmp_path / "ref.idx"))
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"ds{suffix}").read_bytes() == (tmp_path / f"ref{suffix}").read_bytes()
    assert read_dataset_identity(prefix) == {
        **identity(tok), "source": tok.path, "components": tok.components,
        "idx_sha256": hashlib.sha256((tmp_path / "ds.idx").read_bytes()).hexdigest()}
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("ds")) == [
        "ds.bin", "ds.idx", "ds.tokenizer-identity.json"]


def test_model_rules(tokenizers):
    """BOS, EOD and pad as each model ships them; pad may equal EOD."""
    qwen, deepseek, mixtral = (load_tokenizer(tokenizers[k]) for k in ("qwen", "deepseek",
                                                                         "mixtral"))
    assert (qwen.kind, qwen.bos, qwen.add_bos, qwen.pad) == ("huggingface", -1, False, qwen.eod)
    vocab = json.loads((tokenizers["deepseek"] / "tokenizer.json").read_text())["added_tokens"]
    ids = {t["content"]: t["id"] for t in vocab}
    assert (deepseek.bos, deepseek.eod, deepseek.pad, deepseek.add_bos) == (
        ids[DEEPSEEK_BOS], ids[DEEPSEEK_EOS], ids[DEEPSEEK_EOS], True)
    assert (mixtral.kind, mixtral.bos, mixtral.eod, mixtral.add_bos) == ("sentencepiece", 1, 2,
                                                                         True)
    text = "hello world"
    assert deepseek.encode_document(text) == [deepseek.bos, *deepseek.tokenize(text), deepseek.eod]
    assert qwen.detokenize(qwen.tokenize(DOCS[2])) == DOCS[2]


def test_lone_tokenizer_json_takes_its_end_of_text_token(tokenizers):
    path = tokenizers["qwen-json-only"] / "tokenizer.json"
    tok = load_tokenizer(path)
    added = json.loads(path.read_text())["added_tokens"]
    assert tok.eod == next(t["id"] for t in added if t["content"] == "<|endoftext|>")
    assert (tok.bos, tok.pad, tok.files) == (-1, -1, {path: path.read_bytes()})


def test_fingerprint_follows_the_vocabulary_not_the_bytes(tokenizers, tmp_path):
    source = load_tokenizer(tokenizers["deepseek"])
    copied = copy_tokenizer(source, tmp_path / "copy")
    assert load_tokenizer(copied).fingerprint == source.fingerprint
    # Same vocabulary written differently: same fingerprint.
    spec = json.loads((tokenizers["deepseek"] / "tokenizer.json").read_text())
    shutil.copytree(tokenizers["deepseek"], tmp_path / "reformatted")
    (tmp_path / "reformatted" / "tokenizer.json").write_text(json.dumps(spec, indent=7))
    assert load_tokenizer(tmp_path / "reformatted").fingerprint == source.fingerprint
    # Two tokens swapping ids, or another end of document: another fingerprint.
    vocab = spec["model"]["vocab"]
    a, b = sorted(k for k in vocab if len(k) == 1)[:2]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    shutil.copytree(tokenizers["deepseek"], tmp_path / "swapped")
    (tmp_path / "swapped" / "tokenizer.json").write_text(json.dumps(spec))
    assert load_tokenizer(tmp_path / "swapped").fingerprint != source.fingerprint
    config = json.loads((tokenizers["qwen"] / "tokenizer_config.json").read_text())
    shutil.copytree(tokenizers["qwen"], tmp_path / "other-eos")
    (tmp_path / "other-eos" / "tokenizer_config.json").write_text(
        json.dumps({**config, "eos_token": "<|im_end|>"}))
    assert load_tokenizer(tmp_path / "other-eos").fingerprint != load_tokenizer(
        tokenizers["qwen"]).fingerprint


def test_copy_keeps_the_tokenizer_class_the_model_type_chooses(tokenizers, tmp_path):
    """transformers picks the tokenizer class by the model folder's config.json model_type
    (a Mixtral folder's tokenizer.model is not read by LlamaTokenizer), and the classes cut
    some text differently: a copy must tokenize as transformers does in the model folder, and
    the same files read as another class must not share its fingerprint."""
    from transformers import AutoTokenizer

    model = tmp_path / "mixtral-model"
    shutil.copytree(tokenizers["mixtral"], model)
    (model / "config.json").write_text(json.dumps({"model_type": "mixtral"}))
    text = "experts.\n  naïve  x\n\n   y"
    reference = AutoTokenizer.from_pretrained(model)(text)["input_ids"]
    source = load_tokenizer(model)
    copied = load_tokenizer(copy_tokenizer(source, tmp_path / "copy"))
    assert copied.encode_document(text) == source.encode_document(text) == reference + [2]
    assert copied.fingerprint == source.fingerprint
    other_class = load_tokenizer(tokenizers["mixtral"])  # no config.json: LlamaTokenizer
    assert other_class.encode_document(text) != source.encode_document(text)
    assert other_class.fingerprint != source.fingerprint


def test_tokenizer_file_linked_out_of_its_folder_is_refused(tokenizers, tmp_path):
    folder = tmp_path / "linked"
    folder.mkdir()
    (folder / "tokenizer.json").symlink_to(tokenizers["qwen"] / "tokenizer.json")
    with pytest.raises(MegaMoEError, match="points outside the folder"):
        load_tokenizer(folder)


def test_blocks_and_workers_keep_the_order(tokenizers, tmp_path, monkeypatch):
    """Many small blocks over 2 processes write the documents in input order, and a bad line
    in a later block is named by its line number."""
    monkeypatch.setattr(data_prep, "BLOCK_BYTES", 200)
    docs = [f"document {i}: " + "word " * (i % 13) for i in range(300)]
    src = tmp_path / "many.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(str(tokenizers["qwen"]))
    summary = preprocess([src], tmp_path / "many", tokenizer_model=tokenizers["qwen"],
                         progress=False, num_threads=2)
    ds = IndexedDataset(str(tmp_path / "many"))
    assert summary.documents == len(ds) == len(docs)
    assert [ds[i].tolist() for i in range(len(ds))] == [
        auto(d)["input_ids"] + [auto.eos_token_id] for d in docs]
    src.write_text(src.read_text().replace(json.dumps({"text": docs[250]}), '{"text": 250'))
    with pytest.raises(DataError, match=r"many\.jsonl:251: not valid JSON"):
        preprocess([src], tmp_path / "bad", tokenizer_model=tokenizers["qwen"], progress=False,
                   num_threads=2)
    assert not list(tmp_path.glob("bad*")) and not list(tmp_path.glob(".bad*"))


def test_a_preprocessing_worker_dies_of_sigterm_under_a_trainers_stop_handlers():
    """A trainer builds its default corpus with its stop handlers installed, which only record a
    SIGTERM; a worker forked then must still die of the SIGTERM its pool ends it with, or the
    pool's end waits for it forever (a rank of the 3.12 leg hung so). A fresh interpreter, so
    the handlers are a trainer's; the worker is forked as the pool forks it."""
    script = textwrap.dedent("""
        import os, signal, time
        import numpy as np
        from megamoe.train import data_prep
        from megamoe.train.signals import StopRequest
        with StopRequest(grace_s=60):
            pid = os.fork()
            if pid == 0:
                data_prep._start_worker(None, np.dtype(np.uint16))
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)
                os._exit(0)
            _, status = os.waitpid(pid, 0)
        print(os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.split() == ["True"], done.stderr[-2000:]


@pytest.mark.slow
def test_a_vocabulary_of_over_a_million_json_values_loads(tmp_path):
    """300,000 ids with their merges saved as pairs: 1.5 million JSON values in 7 MB (Llama 3's
    tokenizer.json, saved by a recent tokenizers, holds 1.1 million). The file's size bounds
    it, not the value count of configs; its ids are the backend's own."""
    from tokenizers import Tokenizer as BackendTokenizer

    folder = tool_module("bench_tokenizer_load").synthetic_bpe(tmp_path / "big", 300_000)
    tokenizer = load_tokenizer(folder)
    backend = BackendTokenizer.from_file(str(folder / "tokenizer.json"))
    assert tokenizer.vocab_size == 300_001
    text = "def main():\n    return 0\n"
    assert tokenizer.tokenize(text) == backend.encode(text).ids


def _set_vocab_id(document: dict, rank: int, new_id: int) -> None:
    """Give the vocabulary's `rank`-th token (in file order) the id `new_id`."""
    token = list(document["model"]["vocab"])[rank]
    document["model"]["vocab"][token] = new_id


HOSTILE_IDS = {
    "huge-id": lambda d: _set_vocab_id(d, 3, 2**28),
    "huge-added-id": lambda d: d["added_tokens"][0].update(id=2**31),
    "twice": lambda d: _set_vocab_id(d, 7, 5),
}


def _edited_tokenizer_json(folder: Path, target: Path, edit) -> Path:
    """A copy of the tokenizer folder whose tokenizer.json `edit` changed in place."""
    shutil.copytree(folder, target)
    document = json.loads((target / "tokenizer.json").read_text())
    edit(document)
    (target / "tokenizer.json").write_text(json.dumps(document))
    return target


def _bad_tokenizers(root: Path, tokenizers) -> dict:
    (root / "empty").mkdir(parents=True)
    (root / "not-a-tokenizer.json").write_text('{"vocab": {"a": 0}}')
    (root / "garbage.model").write_bytes(b"\x00\x01 not a model")
    broken = shutil.copytree(tokenizers["qwen"], root / "broken-config")
    (broken / "tokenizer_config.json").write_text("[1, 2")
    os.mkfifo(root / "fifo")
    with open(root / "huge.json", "wb") as f:
        f.truncate(10 << 30)  # sparse: nothing on disk
    hostile = {name: _edited_tokenizer_json(tokenizers["qwen"], root / name, edit)
               for name, edit in HOSTILE_IDS.items()}
    far_eos = shutil.copytree(tokenizers["qwen-json-only"], root / "far-eos")
    (far_eos / "generation_config.json").write_text(json.dumps({"eos_token_id": 10**9}))
    return {
        "an id of 2^28": (hostile["huge-id"], r"id 268435456, outside \[0, \d+\)"),
        "an added id of 2^31": (hostile["huge-added-id"], r"added_tokens gives '<\|endoftext\|>' "
                                                          r"the id 2147483648"),
        "an id given twice": (hostile["twice"], r"gives the id 5 to both"),
        "an EOS beyond the vocabulary": (far_eos, r"end-of-document \(EOS\) id 1000000000 lies "
                                                  r"outside its vocabulary"),
        "folder without tokenizer": (root / "empty", "holds no tokenizer.json"),
        "json that is no tokenizer": (root / "not-a-tokenizer.json",
                                      "is not a Hugging Face tokenizer.json"),
        "garbage model": (root / "garbage.model", "is not a SentencePiece model"),
        "broken config": (broken, r"tokenizer_config\.json: not valid JSON"),
        "missing": (root / "missing", "cannot read"),
        "fifo": (root / "fifo", "not a regular file"),
        "device": (Path("/dev/zero"), "not a regular file"),
        "10 GB file": (root / "huge.json", "larger than"),
    }


def test_bad_tokenizers_exit_2_without_output(tokenizers, jsonl, tmp_path, capsys):
    cases = _bad_tokenizers(tmp_path / "bad", tokenizers)
    out = tmp_path / "out"
    out.mkdir()
    for case, (path, message) in cases.items():
        code, _, err = run(["--input", jsonl, "--output-prefix", out / "ds", "--tokenizer", path],
                           capsys)
        assert code == 2, case
        assert err.count("\n") == 1 and err.startswith("error: ") and re.search(message, err), (
            case, err)
        assert list(out.iterdir()) == [], case


def _with_split(folder: Path, target: Path, pattern: str) -> Path:
    """A copy of the tokenizer folder whose pre-tokenizer first splits on `pattern`."""
    def edit(document: dict) -> None:
        split = {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated",
                 "invert": False}
        document["pre_tokenizer"] = {"type": "Sequence",
                                     "pretokenizers": [split, document["pre_tokenizer"]]}
    return _edited_tokenizer_json(folder, target, edit)


def test_a_quadratic_regex_on_a_long_word_is_stopped_in_bounded_time(tokenizers, tmp_path,
                                                                       capsys, monkeypatch):
    """`\\S*\\d` on a 100 kB word without a digit (quadratic: about a minute here): the block
    misses its deadline (shortened to 1 s), the workers are ended, one line names the file, its
    bytes and the pattern, and nothing is written."""
    monkeypatch.setattr(data_prep, "ENCODE_BASE_S", 1.0)
    monkeypatch.setattr(data_prep, "ENCODE_MIN_BYTES_PER_S", 1 << 40)
    slow = _with_split(tokenizers["qwen-json-only"], tmp_path / "slow", r"\S*\d")
    src = tmp_path / "long.jsonl"
    src.write_text(json.dumps({"text": "fine 1"}) + "\n" + json.dumps({"text": "a" * 100_000})
                   + "\n")
    (tmp_path / "out").mkdir()
    start = time.monotonic()
    code, _, err = run(["--input", src, "--output-prefix", tmp_path / "out" / "ds",
                        "--tokenizer", slow, "--workers", 2], capsys)
    assert time.monotonic() - start < 30
    assert code == 2 and err.count("\n") == 1, err
    assert re.search(r"long\.jsonl \(bytes 0 to 100,\d+\): tokenizing 100,\d+ bytes took over "
                     r"1 s .*tokenizer \('\\\\S\*\\\\d'\) is super-linear", err), err
    assert list((tmp_path / "out").iterdir()) == []


def test_an_exponential_regex_is_one_line_not_a_panic(tokenizers, tmp_path, capfd,
                                                       monkeypatch):
    """A pattern the regex engine gives up on: while preprocessing (the engine's panic, a
    BaseException, in a worker), and at load when the probe text sets it off."""
    runaway = _with_split(tokenizers["qwen-json-only"], tmp_path / "runaway", r"(x+x+)+y")
    src = tmp_path / "xs.jsonl"
    src.write_text(json.dumps({"text": "x" * 40}) + "\n")
    (tmp_path / "out").mkdir()
    with pytest.raises(SystemExit) as exit_info:
        run_cli(CLI_MAIN, [str(a) for a in ["--input", src, "--output-prefix",
                                            tmp_path / "out" / "ds", "--tokenizer", runaway,
                                            "--workers", 2, "--no-progress"]])
    err = capfd.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1, err
    assert re.search(r"xs\.jsonl \(bytes 0 to 53\): the tokenizer gave up on this text "
                     r"\(.*retry-limit-in-match.*\): .*'\(x\+x\+\)\+y'", err), err
    assert list((tmp_path / "out").iterdir()) == []
    monkeypatch.setattr(tokenizer_hf, "_PROBE", "x" * 40)  # the load-time probe sets it off
    with pytest.raises(DataError, match=r"runaway: its regex engine gave up on a short probe "
                                        r"text .*'\(x\+x\+\)\+y'") as caught:
        load_tokenizer(runaway)
    assert "\n" not in str(caught.value) and capfd.readouterr().err == ""


def test_a_tokenizer_class_transformers_lacks_is_announced(tokenizers, tmp_path, capsys,
                                                            monkeypatch):
    """tokenizer_config.json naming a class whose code only the model carries: transformers
    builds its generic class over tokenizer.json, and a note says so, once, on rank 0."""
    custom = with_config(tokenizers["qwen"], tmp_path / "custom",
                         tokenizer_class="MyOwnTokenizer")
    load_tokenizer(tokenizers["qwen"])
    assert capsys.readouterr().err == ""
    load_tokenizer(custom)
    assert capsys.readouterr().err == (
        f"note: tokenizer {custom}: tokenizer_config.json names the class 'MyOwnTokenizer', "
        "whose code is not part of transformers; megamoe runs no code from model files and "
        "tokenizes with transformers' TokenizersBackend over tokenizer.json\n")
    monkeypatch.setenv("RANK", "1")
    load_tokenizer(custom)
    assert capsys.readouterr().err == ""


def test_jsonl_line_without_the_key_exits_2(tokenizers, tmp_path, capsys):
    src = tmp_path / "nokey.jsonl"
    src.write_text('{"text": "fine"}\n{"body": "x"}\n')
    (tmp_path / "out").mkdir()
    code, _, err = run(["--input", src, "--output-prefix", tmp_path / "out" / "ds",
                        "--tokenizer", tokenizers["deepseek"], "--workers", 2], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert re.search(r"nokey\.jsonl:2: no string field 'text'", err)
    assert list((tmp_path / "out").iterdir()) == []


def test_overlong_record_is_refused_in_bounded_memory(tokenizers, tmp_path, monkeypatch):
    monkeypatch.setattr(data_prep, "BLOCK_BYTES", 64)
    monkeypatch.setattr(data_prep, "MAX_RECORD_BYTES", 1000)
    src = tmp_path / "long.jsonl"
    src.write_text('{"text": "ok"}\n' + json.dumps({"text": "y" * 5000}) + "\n")
    with pytest.raises(DataError, match=r"long\.jsonl:2: a line longer than 1,000 bytes"):
        preprocess([src], tmp_path / "ds", tokenizer_model=tokenizers["qwen"], progress=False,
                   num_threads=1, max_document_bytes=1000)


@pytest.mark.slow
def test_dev_zero_tokenizer_is_refused_within_a_few_mib(jsonl, tmp_path):
    """Peak memory of the whole command over what its imports took (issue 46, item 3)."""
    script = textwrap.dedent(f"""
        import resource, sys
        sys.path.insert(0, {str(ROOT / "tools")!r})
        import preprocess_data
        from megamoe.errors import run_cli
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
            run_cli(preprocess_data.main, ["--input", {str(jsonl)!r}, "--output-prefix",
                    {str(tmp_path / "ds")!r}, "--tokenizer", "/dev/zero", "--no-progress"])
        except SystemExit as exit:
            after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            print(exit.code, (after - before) // 1024)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    code, grown_mib = map(int, done.stdout.split())
    assert code == 2 and "not a regular file" in done.stderr
    assert grown_mib <= 4, grown_mib
    assert list(tmp_path.iterdir()) == []

"""Load time and memory of a Hugging Face tokenizer against the size of its tokenizer.json.

    python tools/bench_tokenizer_load.py [--entries 50000,200000,800000] [--tokenizer DIR ...]
                                         [--json results.json]

For each size in `--entries` a byte-level BPE tokenizer.json with that many vocabulary entries
(and as many merges less 256, each joining the two halves of a learnt token, as trained ones do)
is written to a temporary folder beside a tokenizer_config.json, and each `--tokenizer` folder
given is taken as it is. Each is loaded by `megamoe.train.tokenizer.load_tokenizer` in a fresh
interpreter that has already imported what loading needs, which prints the seconds the load
took and the growth of its peak resident memory; the table gives them against the file's size
(seconds per MB, memory per byte of tokenizer.json).
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from megamoe.atomic import atomic_write_text
from megamoe.errors import CliArgumentParser, ConfigError, run_cli
from megamoe.ownership import check_file_output

# Run in the fresh interpreter: the imports first, then one load, timed and measured.
_MEASURE = """
import json, resource, sys, time
from megamoe.train.tokenizer import load_tokenizer
import transformers, tokenizers
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
load_tokenizer(sys.argv[1])
seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"seconds": seconds, "peak_growth_bytes": (peak - before) * 1024}))
"""


def synthetic_bpe(folder: Path, entries: int) -> Path:
    """A byte-level BPE tokenizer of `entries` vocabulary entries in `folder`: the 256 byte
    symbols, then tokens each made of two earlier ones (the merge that learnt it)."""
    from tokenizers import pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: i for i, symbol in enumerate(sorted(alphabet))}
    tokens = list(vocab)
    merges = []
    left = 0
    while len(vocab) < entries:
        for right in range(left + 1):
            if len(vocab) >= entries:
                break
            token = tokens[left] + tokens[right]
            if token not in vocab:
                vocab[token] = len(vocab)
                tokens.append(token)
                merges.append([tokens[left], tokens[right]])
        left += 1
    document = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": len(vocab), "content": "<|endoftext|>", "single_word": False,
                          "lstrip": False, "rstrip": False, "normalized": False,
                          "special": True}],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                          "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": merges},
    }
    folder.mkdir(parents=True)
    (folder / "tokenizer.json").write_text(json.dumps(document, ensure_ascii=False))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}))
    return folder


def measure(folder: Path) -> dict:
    """{name, file_mb, seconds, peak_growth_mb} of one load in a fresh interpreter."""
    done = subprocess.run([sys.executable, "-c", _MEASURE, str(folder)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise ConfigError(f"loading {folder} failed: {done.stderr.strip().splitlines()[-1]}")
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    size = (folder / "tokenizer.json").stat().st_size
    return {"name": str(folder), "file_mb": size / 2**20, "seconds": figures["seconds"],
            "peak_growth_mb": figures["peak_growth_bytes"] / 2**20}


def _entries(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) <= 256:
        raise ConfigError(f"--entries {text!r} must be comma-separated counts above 256, "
                          "e.g. 50000,200000")
    return sizes


def main(argv: list[str] | None = None) -> int:
    parser = CliArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--entries", default="50000,200000,800000",
                        help="vocabulary sizes of the synthetic tokenizers")
    parser.add_argument("--tokenizer", action="append", default=[],
                        help="a tokenizer folder of your own (repeatable)")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args(argv)
    sizes = _entries(args.entries)
    folders = [Path(folder) for folder in args.tokenizer]
    for folder in folders:
        if not (folder / "tokenizer.json").is_file():
            raise ConfigError(f"--tokenizer {folder} holds no tokenizer.json; pass a model's "
                              "tokenizer folder")
    if args.json:
        check_file_output(args.json, "--json", folders)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-tokenizer-") as scratch:
        for entries in sizes:
            print(f"writing a {entries:,}-entry tokenizer", flush=True)
            folders.append(synthetic_bpe(Path(scratch) / f"bpe{entries}", entries))
        print(f"{'tokenizer.json':>16} {'load s':>8} {'s/MB':>6} {'peak MB':>9} {'x file':>7}")
        for folder in folders:
            row = measure(folder)
            rows.append(row)
            print(f"{row['file_mb']:13.1f} MB {row['seconds']:8.2f} "
                  f"{row['seconds'] / row['file_mb']:6.2f} {row['peak_growth_mb']:9.0f} "
                  f"{row['peak_growth_mb'] / row['file_mb']:7.1f}  {Path(row['name']).name}",
                  flush=True)
    if args.json:
        atomic_write_text(args.json, json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    run_cli(main)

"""Benchmark tools/preprocess_data.py against Megatron-LM's own tools/preprocess_data.py.

    python tools/bench_preprocess.py --megatron-lm /path/to/Megatron-LM --workdir /tmp/bench \\
        [--input corpus.jsonl | --size-mb 200 --documents pieces|files] \\
        [--tokenizer MODEL_DIR] [--cores 0,1] [--workers 2] [--pythonpath DIR] \\
        [--results bench.json]

1. The corpus: `--input`, or a jsonl of `--size-mb` MB (default 200) made from this Python's
   standard library sources (code, docstrings and comments), written to
   WORKDIR/corpus-DOCUMENTS.jsonl once: `--documents pieces` (the default), one document per
   blank-line separated run of up to ~8 KB; `--documents files`, real sizes: each source file
   whole, then each folder's files joined (a package, a test suite) up to 5 MB a document.
2. The tokenizer: `--tokenizer`, or a Qwen-like one trained once on the first 16 MB of the
   corpus with the `tokenizers` library (byte-level BPE, 32,000 ids, `Qwen2Tokenizer` class,
   EOS = pad = `<|endoftext|>`, no BOS), in WORKDIR/tokenizer.
3. Runs both commands, each in its own process tree pinned to the same `--cores` with the same
   `--workers` and the same tokenizer: megamoe's `--tokenizer DIR`, and Megatron-LM's
   `--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR --append-eod` (plus
   `--tokenizer-hf-include-special-tokens` where its version has the flag, so that both write
   `AutoTokenizer(text).input_ids + [eos]`). Megatron-LM runs with PYTHONPATH set to its
   checkout (and `--pythonpath`, for packages it imports that megamoe does not need, e.g.
   triton and six: install them there with `pip install --target DIR`).
4. Reports, for each: wall time of the whole command (start-up included), tokens/s (tokens
   written, EOD included, over that time), the peak of the summed RSS of the process tree and
   of its summed PSS (RSS counts pages the forked workers share once per process; PSS splits
   them), sampled every 50 ms; the ratio megamoe / Megatron-LM of tokens/s (the bar: >= 1.0),
   and whether the two `.bin` files are byte-identical. `--results` writes them as JSON.

WORKDIR is marked as the benchmark's (megamoe.ownership); a folder of anyone else's is refused
in one line. Exit code 1 if the bar is missed or the token streams differ.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megamoe.atomic import atomic_write_text  # noqa: E402
from megamoe.errors import CliArgumentParser, ConfigError, int_at_least, run_cli  # noqa: E402
from megamoe.ownership import check_file_output, check_folder_output, claim_folder  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TOOL = "bench_preprocess"
DOCUMENT_BYTES = 8192
MAX_DOCUMENT_BYTES = 5 << 20
TOKENIZER_SAMPLE_BYTES = 16 << 20
TOKENIZER_VOCAB = 32000
SAMPLE_SECONDS = 0.05


def _stdlib_texts() -> Iterator[tuple[Path, str]]:
    """(path, text) of each readable source file of this Python's standard library."""
    for source in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        try:
            yield source, source.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue


def _pieces(texts: list[tuple[Path, str]]) -> Iterator[str]:
    """Documents of about DOCUMENT_BYTES: runs of blank-line separated parts of each file."""
    for _, text in texts:
        document: list[str] = []
        for part in text.split("\n\n"):
            document.append(part)
            if sum(map(len, document)) >= DOCUMENT_BYTES:
                yield "\n\n".join(document)
                document = []


def _files(texts: list[tuple[Path, str]]) -> Iterator[str]:
    """Real documents of every size: each source file whole, then each folder's files joined
    (a package, a test suite), cut at MAX_DOCUMENT_BYTES."""
    folders: dict[Path, list[str]] = {}
    for path, text in texts:
        yield text
        folders.setdefault(path.parent, []).append(text)
    for parts in folders.values():
        joined = "\n\n".join(parts)
        for start in range(0, len(joined), MAX_DOCUMENT_BYTES):
            yield joined[start:start + MAX_DOCUMENT_BYTES]


def make_corpus(path: Path, size_mb: int, documents: str) -> None:
    """A jsonl of about `size_mb` MB of documents from the standard library's sources:
    `pieces` of about DOCUMENT_BYTES, or whole `files` and folders (up to 5 MB each)."""
    texts = list(_stdlib_texts())
    cut = {"pieces": _pieces, "files": _files}[documents]
    target = size_mb << 20
    written = 0
    with open(path.with_suffix(".partial"), "w", encoding="utf-8") as out:
        while written < target:
            for text in cut(texts):
                line = json.dumps({"text": text}) + "\n"
                out.write(line)
                written += len(line)
                if written >= target:
                    break
    os.replace(path.with_suffix(".partial"), path)


def make_tokenizer(folder: Path, corpus: Path) -> None:
    """A Qwen-like byte-level BPE tokenizer trained on the start of `corpus`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    def sample():
        read = 0
        with open(corpus, encoding="utf-8") as f:
            for line in f:
                read += len(line)
                yield json.loads(line)["text"]
                if read >= TOKENIZER_SAMPLE_BYTES:
                    return

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, show_progress=False,
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(sample(), trainer)
    partial = folder.with_name(folder.name + ".partial")
    partial.mkdir(exist_ok=True)
    tok.save(str(partial / "tokenizer.json"))
    (partial / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>", "add_bos_token": False}))
    os.replace(partial, folder)


@dataclass
class Run:
    """One command's figures."""

    name: str
    seconds: float
    tokens: int
    peak_rss_mb: float
    peak_pss_mb: float
    exit_code: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def _tree_memory(root: int) -> tuple[int, int]:
    """(summed RSS, summed PSS) in bytes of `root` and its descendants now."""
    import psutil

    try:
        procs = [psutil.Process(root)]
        procs += procs[0].children(recursive=True)
    except psutil.NoSuchProcess:
        return 0, 0
    rss = pss = 0
    for proc in procs:
        try:
            with open(f"/proc/{proc.pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Rss:"):
                        rss += int(line.split()[1]) << 10
                    elif line.startswith("Pss:"):
                        pss += int(line.split()[1]) << 10
        except OSError:
            continue
    return rss, pss


def measure(argv: list[str], env: dict, cores: set[int],
            log: Path) -> tuple[float, int, int, int]:
    """Run `argv` pinned to `cores`; (wall seconds, peak tree RSS, peak tree PSS, exit code)."""
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                preexec_fn=lambda: os.sched_setaffinity(0, cores))
        peak_rss = peak_pss = 0
        while proc.poll() is None:
            rss, pss = _tree_memory(proc.pid)
            peak_rss, peak_pss = max(peak_rss, rss), max(peak_pss, pss)
            time.sleep(SAMPLE_SECONDS)
    return time.perf_counter() - start, peak_rss, peak_pss, proc.returncode


def token_count(idx: Path) -> int:
    """Tokens in an indexed dataset, from its index's sequence lengths."""
    import struct

    import numpy as np

    with open(idx, "rb") as f:
        f.seek(18)
        (count,) = struct.unpack("<Q", f.read(8))
        f.seek(34)
        return int(np.fromfile(f, dtype=np.int32, count=count).sum(dtype=np.int64))


def _same_bytes(a: Path, b: Path) -> bool:
    if a.stat().st_size != b.stat().st_size:
        return False
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while block := fa.read(1 << 24):
            if block != fb.read(1 << 24):
                return False
    return True


def _parser() -> CliArgumentParser:
    p = CliArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--megatron-lm", help="a Megatron-LM checkout (its tools/preprocess_data.py)")
    p.add_argument("--workdir", default="bench_preprocess_work",
                   help="where the corpus, tokenizer and outputs go")
    p.add_argument("--input", help="a jsonl to use instead of the generated corpus")
    p.add_argument("--size-mb", type=int_at_least(1), default=200,
                   help="size of the generated corpus")
    p.add_argument("--documents", choices=("pieces", "files"), default="pieces",
                   help="the generated corpus's documents: pieces of ~8 KB, or whole source "
                        "files and folders (real sizes, up to 5 MB)")
    p.add_argument("--tokenizer", help="a Hugging Face tokenizer folder (default: a trained "
                                       "Qwen-like one)")
    p.add_argument("--cores", default="0,1", help="the CPU cores both commands run on")
    p.add_argument("--workers", type=int_at_least(1), default=2,
                   help="worker processes of both commands")
    p.add_argument("--pythonpath", default="",
                   help="extra import path for Megatron-LM's run (e.g. triton, six)")
    p.add_argument("--results", help="write the figures as JSON to this file")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    inputs = [args.input, args.tokenizer, args.megatron_lm]
    check_folder_output(args.workdir, TOOL, "--workdir", inputs)
    if args.results:
        check_file_output(args.results, "--results", inputs)
    if not args.megatron_lm or not (Path(args.megatron_lm) / "tools" /
                                    "preprocess_data.py").is_file():
        raise ConfigError(f"--megatron-lm {args.megatron_lm} is not a Megatron-LM checkout (no "
                          "tools/preprocess_data.py); pass one")
    try:
        cores = {int(c) for c in args.cores.split(",")}
    except ValueError:
        raise ConfigError(f"--cores {args.cores!r} is not a comma-separated list of core "
                          "numbers") from None
    if not cores <= os.sched_getaffinity(0):
        raise ConfigError(f"--cores {args.cores} are not all available here "
                          f"({sorted(os.sched_getaffinity(0))})")
    work = claim_folder(args.workdir, TOOL, "--workdir", inputs)
    corpus = Path(args.input) if args.input else work / f"corpus-{args.documents}.jsonl"
    if not corpus.is_file():
        print(f"making a {args.size_mb} MB corpus at {corpus}", flush=True)
        make_corpus(corpus, args.size_mb, args.documents)
    tokenizer = Path(args.tokenizer) if args.tokenizer else work / "tokenizer"
    if not tokenizer.is_dir():
        print(f"training a {TOKENIZER_VOCAB}-id tokenizer at {tokenizer}", flush=True)
        make_tokenizer(tokenizer, corpus)
    megatron = Path(args.megatron_lm).resolve()
    workers = str(args.workers)
    ours = [sys.executable, str(ROOT / "tools" / "preprocess_data.py"), "--input", str(corpus),
            "--output-prefix", str(work / "megamoe"), "--tokenizer", str(tokenizer),
            "--workers", workers, "--overwrite", "--no-progress"]
    theirs = [sys.executable, str(megatron / "tools" / "preprocess_data.py"), "--input",
              str(corpus), "--output-prefix", str(work / "megatron"), "--tokenizer-type",
              "HuggingFaceTokenizer", "--tokenizer-model", str(tokenizer), "--append-eod",
              "--workers", workers, "--log-interval", "100000"]
    arguments = megatron / "megatron" / "training" / "arguments.py"
    if "--tokenizer-hf-include-special-tokens" in arguments.read_text():
        theirs.append("--tokenizer-hf-include-special-tokens")
    their_env = {**os.environ,
                 "PYTHONPATH": os.pathsep.join(p for p in (str(megatron), args.pythonpath) if p)}
    runs = []
    corpus_mb = corpus.stat().st_size / 2**20
    for name, argv_, env, prefix in (("megamoe", ours, dict(os.environ), work / "megamoe"),
                                     ("Megatron-LM", theirs, their_env,
                                      work / "megatron_text_document")):
        print(f"running {name}: {' '.join(argv_)}", flush=True)
        seconds, rss, pss, code = measure(argv_, env, cores, work / f"{name}.log")
        tokens = token_count(prefix.with_suffix(".idx")) if code == 0 else 0
        runs.append(Run(name, seconds, tokens, rss / 2**20, pss / 2**20, code))
        print(f"  {name}: exit {code}, {seconds:.1f} s, {tokens:,} tokens, "
              f"{tokens / seconds:,.0f} tokens/s, {corpus_mb / seconds:.2f} MB/s, peak RSS "
              f"{rss / 2**20:,.0f} MB (PSS {pss / 2**20:,.0f} MB)", flush=True)
    ours_run, theirs_run = runs
    if ours_run.exit_code or theirs_run.exit_code:
        print(f"a command failed; see {work}/*.log", file=sys.stderr)
        return 1
    same = _same_bytes(work / "megamoe.bin", work / "megatron_text_document.bin")
    ratio = ours_run.tokens_per_s / theirs_run.tokens_per_s
    print(f"corpus {corpus_mb:,.0f} MB, cores {sorted(cores)}, {args.workers} workers each")
    print(f"tokens/s: megamoe {ours_run.tokens_per_s:,.0f}, Megatron-LM "
          f"{theirs_run.tokens_per_s:,.0f}; ratio {ratio:.2f} (bar >= 1.0); identical .bin: "
          f"{same}")
    if args.results:
        atomic_write_text(args.results, json.dumps({
            "corpus": str(corpus), "corpus_mb": corpus_mb, "tokenizer": str(tokenizer),
            "cores": sorted(cores), "workers": args.workers, "ratio": ratio,
            "identical_bin": same,
            "runs": [{**asdict(r), "tokens_per_s": r.tokens_per_s} for r in runs]}, indent=1))
    return 0 if ratio >= 1.0 and same else 1


if __name__ == "__main__":
    run_cli(main)

"""Tokenize jsonl or plain-text files into a Megatron indexed dataset (PREFIX.bin / PREFIX.idx).

    python tools/preprocess_data.py --input a.jsonl b.txt --output-prefix data/corpus \\
        --train-tokenizer --vocab-size 4096          # also writes data/corpus.model
    python tools/preprocess_data.py --input a.jsonl --output-prefix data/corpus \\
        --tokenizer-model tok.model

`*.jsonl` / `*.json` files hold one JSON object a line (text under --json-key); any other file is
UTF-8 text with one document per blank-line-separated paragraph. Every document ends with EOD.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megamoe.errors import DataError, run_cli  # noqa: E402
from megamoe.train.data_prep import preprocess  # noqa: E402
from megamoe.train.tokenizer import MODEL_TYPES  # noqa: E402


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--input", nargs="+", required=True, help="jsonl or text files")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    parser.add_argument("--json-key", default="text", help="field holding the text in jsonl")
    tok = parser.add_mutually_exclusive_group(required=True)
    tok.add_argument("--tokenizer-model", help="an existing SentencePiece .model file")
    tok.add_argument(
        "--train-tokenizer",
        action="store_true",
        help="train a SentencePiece model on the inputs and save it as PREFIX.model",
    )
    parser.add_argument("--vocab-size", type=int, help="vocabulary size for --train-tokenizer")
    parser.add_argument("--model-type", choices=MODEL_TYPES, default="bpe")
    parser.add_argument("--workers", type=int, help="tokenizer threads (default: all cores)")
    parser.add_argument("--overwrite", action="store_true", help="replace existing outputs")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.train_tokenizer != (args.vocab_size is not None):
        raise DataError("--train-tokenizer and --vocab-size go together; pass both or neither")
    summary = preprocess(
        args.input,
        args.output_prefix,
        tokenizer_model=args.tokenizer_model,
        vocab_size=args.vocab_size,
        model_type=args.model_type,
        json_key=args.json_key,
        overwrite=args.overwrite,
        progress=not args.no_progress,
        num_threads=args.workers,
    )
    print(summary.line())
    return 0


if __name__ == "__main__":
    run_cli(main)

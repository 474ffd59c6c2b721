"""Tokenize jsonl or plain-text files into a Megatron indexed dataset (PREFIX.bin / PREFIX.idx).

    python tools/preprocess_data.py --input a.jsonl --output-prefix data/corpus \\
        --tokenizer MODEL_DIR            # a model's own tokenizer (folder, tokenizer.json, .model)
    python tools/preprocess_data.py --input a.jsonl b.txt --output-prefix data/corpus \\
        --train-tokenizer --vocab-size 4096          # also writes data/corpus.model

`*.jsonl` / `*.json` files hold one JSON object a line (text under --json-key); any other file is
UTF-8 text with one document per blank-line-separated paragraph. Each document is written as the
ids transformers' AutoTokenizer gives it (BOS included when the model adds one) and then the
end-of-document id (the tokenizer's EOS): the stream Megatron-LM's preprocess_data.py
--tokenizer-type HuggingFaceTokenizer --append-eod writes (its core_v0.16 releases leave BOS
out unless given --tokenizer-hf-include-special-tokens; later ones include it). Documents
without any token are left out, as Megatron-LM leaves them out. PREFIX.tokenizer-identity.json
records the tokenizer. --workers processes tokenize in parallel (a progress bar on a terminal
shows MB/s and documents/s); outputs appear only when whole. A document longer than
--max-document-mb (default 8) is refused in one line naming its file and line: tokenizing a
document holds memory in proportion to its length (about 150-220 bytes per byte).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megamoe.errors import CliArgumentParser, DataError, int_at_least, run_cli  # noqa: E402
from megamoe.train.data_prep import MAX_DOCUMENT_BYTES, preprocess  # noqa: E402
from megamoe.train.tokenizer import MODEL_TYPES  # noqa: E402


def _parser() -> argparse.ArgumentParser:
    parser = CliArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--input", nargs="+", required=True, help="jsonl or text files")
    parser.add_argument("--output-prefix", required=True,
                        help="writes PREFIX.bin, PREFIX.idx and PREFIX.tokenizer-identity.json")
    parser.add_argument("--json-key", default="text", help="field holding the text in jsonl")
    tok = parser.add_mutually_exclusive_group(required=True)
    tok.add_argument("--tokenizer", "--tokenizer-model", dest="tokenizer",
                     help="a model folder (tokenizer.json / tokenizer.model and their configs), "
                          "a tokenizer.json or a SentencePiece .model file")
    tok.add_argument(
        "--train-tokenizer",
        action="store_true",
        help="train a SentencePiece model on the inputs and save it as PREFIX.model",
    )
    parser.add_argument("--vocab-size", type=int, help="vocabulary size for --train-tokenizer")
    parser.add_argument("--model-type", choices=MODEL_TYPES, default="bpe")
    parser.add_argument("--workers", type=int_at_least(1),
                        help="tokenizer processes (default: the cores this process may use)")
    parser.add_argument("--max-document-mb", type=int_at_least(1),
                        default=MAX_DOCUMENT_BYTES >> 20,
                        help="refuse a document longer than this many MiB (default "
                             f"{MAX_DOCUMENT_BYTES >> 20}): a worker's memory grows with the "
                             "longest document")
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
        tokenizer_model=args.tokenizer,
        vocab_size=args.vocab_size,
        model_type=args.model_type,
        json_key=args.json_key,
        overwrite=args.overwrite,
        progress=not args.no_progress,
        num_threads=args.workers,
        max_document_bytes=args.max_document_mb << 20,
    )
    print(summary.line())
    return 0


if __name__ == "__main__":
    run_cli(main)

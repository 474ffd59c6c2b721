"""Tokenizers: every kind a released model ships (a Hugging Face tokenizer.json or model folder,
a SentencePiece model) behind one interface (`base.Tokenizer`), the identity that follows a
tokenizer's ids through datasets, checkpoints and exports, and training megamoe's own
SentencePiece tokenizers."""

from megamoe.train.tokenizer.base import DocumentEncoder, Tokenizer
from megamoe.train.tokenizer.hf import HuggingFaceTokenizer
from megamoe.train.tokenizer.identity import (copy_tokenizer, dataset_identity,
                                              describe_identity, identity, identity_path,
                                              index_checksum, load_tokenizer,
                                              read_dataset_identity,
                                              write_dataset_identity, write_tokenizer_files)
from megamoe.train.tokenizer.spm import MODEL_TYPES, SentencePieceTokenizer, train_sentencepiece

__all__ = ["DocumentEncoder", "HuggingFaceTokenizer", "MODEL_TYPES", "SentencePieceTokenizer",
           "Tokenizer", "copy_tokenizer", "dataset_identity", "describe_identity", "identity",
           "identity_path", "index_checksum", "load_tokenizer", "read_dataset_identity",
           "train_sentencepiece", "write_dataset_identity", "write_tokenizer_files"]

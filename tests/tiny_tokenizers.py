"""Tiny tokenizers shaped like those released models ship, built with the `tokenizers` and
`sentencepiece` libraries in a fraction of a second, for the data and interop tests.

- `save_qwen_like`: byte-level BPE, `tokenizer.json` (+ `tokenizer_config.json` unless
  `config=False`): no BOS, EOS `<|endoftext|>`, pad = EOS (Qwen2/Qwen3, GPT-OSS, GLM style).
- `save_deepseek_like`: byte-level BPE whose `tokenizer.json` post-processor adds BOS, with
  `add_bos_token: true` and pad = EOS `<｜end▁of▁sentence｜>` in its config (DeepSeek-V3).
- `save_mixtral_like`: a SentencePiece `tokenizer.model` (byte fallback, `<unk>` `<s>` `</s>` at
  0-2) with a `LlamaTokenizer` config adding `<s>` (Mixtral, Llama 2).
"""
from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Mixture-of-Experts layers route each token to a few experts.",
    "def main():\n    return 0\n",
    "naïve café, 東京, emoji \U0001f600 and\ttabs  and  spaces",
    "Numbers 12345 and 2026-12-06 in a sentence.",
] * 20
QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
DEEPSEEK_BOS, DEEPSEEK_EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"


def _byte_level_bpe(special: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXTS, trainer)
    return tok


def save_qwen_like(folder: Path, config: bool = True, vocab_size: int = 400) -> Path:
    """A Qwen-like tokenizer in `folder` (see the module docstring)."""
    folder.mkdir(parents=True, exist_ok=True)
    _byte_level_bpe(QWEN_SPECIAL, vocab_size).save(str(folder / "tokenizer.json"))
    if config:
        (folder / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|endoftext|>",
            "pad_token": "<|endoftext|>", "add_bos_token": False, "model_max_length": 4096}))
    return folder


def save_deepseek_like(folder: Path, vocab_size: int = 400) -> Path:
    """A DeepSeek-V3-like tokenizer in `folder` (see the module docstring)."""
    from tokenizers import processors

    folder.mkdir(parents=True, exist_ok=True)
    tok = _byte_level_bpe([DEEPSEEK_BOS, DEEPSEEK_EOS], vocab_size)
    bos = [(DEEPSEEK_BOS, tok.token_to_id(DEEPSEEK_BOS))]
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{DEEPSEEK_BOS} $A", pair=f"{DEEPSEEK_BOS} $A $B",
                                      special_tokens=bos),
    ])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizerFast", "add_bos_token": True, "add_eos_token": False,
        "bos_token": DEEPSEEK_BOS, "eos_token": DEEPSEEK_EOS, "pad_token": DEEPSEEK_EOS,
        "model_max_length": 16384}))
    (folder / "generation_config.json").write_text(json.dumps({
        "bos_token_id": tok.token_to_id(DEEPSEEK_BOS),
        "eos_token_id": tok.token_to_id(DEEPSEEK_EOS)}))
    return folder


def save_mixtral_like(folder: Path, vocab_size: int = 320) -> Path:
    """A Mixtral-like SentencePiece tokenizer in `folder` (see the module docstring)."""
    import sentencepiece as spm

    folder.mkdir(parents=True, exist_ok=True)
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TEXTS), model_writer=model, vocab_size=vocab_size,
        model_type="bpe", unk_id=0, bos_id=1, eos_id=2, pad_id=-1, byte_fallback=True,
        character_coverage=1.0, minloglevel=2)
    (folder / "tokenizer.model").write_bytes(model.getvalue())
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "add_eos_token": False,
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": None,
        "legacy": False}))
    return folder


def with_config(folder: Path, target: Path, **changes) -> Path:
    """A copy of the tokenizer `folder` at `target` whose tokenizer_config.json has `changes`."""
    shutil.copytree(folder, target)
    config = json.loads((target / "tokenizer_config.json").read_text())
    (target / "tokenizer_config.json").write_text(json.dumps({**config, **changes}))
    return target

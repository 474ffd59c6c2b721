"""The `train_config.yaml` a converter (tools/import_hf.py, tools/upcycle_ckpt.py) writes beside
its output: a megamoe training config that continues pretraining the converted model as it is,
on its own tokenizer, with one comment per chosen setting saying why it has its value.

Continued-pretraining defaults (CPU-sized; each comment says what to raise on GPUs): the
learning rate re-warmed then re-decayed by a cosine to a tenth (Ibrahim et al., "Simple and
Scalable Strategies to Continually Pre-train Large Language Models", arXiv 2403.08763; Gupta et
al., arXiv 2308.04014), at a peak an order of magnitude below the usual pretraining peak so the
released weights are moved gently; AdamW (0.9, 0.95), weight decay 0.1 and clipping at 1.0 as
Llama, Mixtral, Qwen and DeepSeek-V3 were trained; the model's own context length, capped at
CPU_CONTEXT_CAP tokens; the balancing the source model was trained with (the caller's notes).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

CPU_CONTEXT_CAP = 512
"""The longest `model.seq_length` the written config starts with (a CPU-sized default)."""
TRAIN_STEPS, WARMUP_STEPS = 100, 10
MICRO_BATCH, GLOBAL_BATCH = 1, 8
LR, MIN_LR = 3e-5, 3e-6


@dataclass(frozen=True)
class ConvertedModel:
    """What the written config is about."""

    tool: str
    """The converter, e.g. `tools/import_hf.py`."""
    description: str
    output: Path
    """The converter's output (absolute): `checkpoint.init_from`."""
    context: Optional[int]
    """The model's context length (config.json max_position_embeddings); None: unknown."""
    vocab_size: Optional[int]
    """The model's embedding rows (config.json vocab_size); None: not written."""
    tokenizer: Optional[Path]
    """The folder of the model's own tokenizer (absolute); None: the model has none."""
    notes: dict[str, dict[str, str]] = field(default_factory=dict)
    """{section: {dotted key: why}} for settings of the given sections the converter chose
    (e.g. {"moe": {"balancing.methods": ...}})."""


def _flow(value: Any) -> str:
    """`value` as one line of YAML."""
    text = yaml.safe_dump(value, default_flow_style=True, width=1 << 30).strip()
    return text[:-len("\n...")].strip() if text.endswith("\n...") else text


def continued_pretraining_settings(model: ConvertedModel) -> dict[str, dict[str, tuple]]:
    """{section: {key: (value, comment)}} of the settings chosen for continued pretraining."""
    if model.context is None:
        seq = (256, "the model's context length is not recorded: a CPU-sized default")
    elif model.context > CPU_CONTEXT_CAP:
        seq = (CPU_CONTEXT_CAP, f"the model's context is {model.context} tokens (config.json "
               f"max_position_embeddings); capped at {CPU_CONTEXT_CAP} for the CPU default: "
               f"raise it on GPUs (up to {model.context})")
    else:
        seq = (model.context, "the model's context (config.json max_position_embeddings)")
    data: dict[str, tuple] = {}
    if model.tokenizer is not None:
        data["tokenizer"] = (str(model.tokenizer), "the model's own tokenizer (copied by the "
                             "converter): the default corpus is tokenized with it, and "
                             "data.prefixes must be made with it (tools/preprocess_data.py "
                             "--tokenizer)")
    if model.vocab_size is not None:
        data["vocab_size"] = (model.vocab_size, "the model's embedding rows (config.json "
                              "vocab_size), at least the tokenizer's ids")
    return {
        "model": {"seq_length": seq},
        "data": data,
        "training": {
            "train_steps": (TRAIN_STEPS, "a short CPU run: set it to your token budget / "
                            "(global_batch_size x seq_length)"),
            "micro_batch_size": (MICRO_BATCH, "sequences per forward/backward on one rank"),
            "global_batch_size": (GLOBAL_BATCH, "sequences per optimizer step; released "
                                  "models stepped on millions of tokens (DeepSeek-V3: 15,360 "
                                  "x 4,096): raise it with the GPUs"),
            "grad_clip": (1.0, "gradient-norm clipping as Llama, Mixtral and DeepSeek-V3 "
                          "trained")},
        "optimizer": {
            "lr": (LR, "continued pretraining: a peak about 10x below the usual pretraining "
                   "peak moves the released weights gently (raise it for a large domain "
                   f"shift, arXiv 2403.08763); at this rate a short smoke run ({WARMUP_STEPS} "
                   "steps: all warm-up) shows no visible loss change: to see it learn in one, "
                   "add optimizer.lr=1e-3 optimizer.warmup_steps=0 (a smoke-test setting, not "
                   "a recipe)"),
            "min_lr": (MIN_LR, "re-decay to a tenth of the peak (arXiv 2403.08763)"),
            "warmup_steps": (WARMUP_STEPS, "re-warm the learning rate from ~0 (arXiv "
                             "2308.04014): keep it near 1% of a long run"),
            "decay_style": ("cosine", "cosine re-decay over the rest of the run"),
            "weight_decay": (0.1, "AdamW weight decay of Llama/Mixtral/Qwen/DeepSeek-V3 "
                             "pretraining"),
            "beta1": (0.9, "AdamW beta1 as in their pretraining"),
            "beta2": (0.95, "AdamW beta2 as in their pretraining")},
        "checkpoint": {
            "init_from": (str(model.output), "start from the converted weights (a resumed run "
                          "continues from its own checkpoints instead)")},
    }


def _setting_lines(key: str, value: Any, notes: dict[str, str], dotted: str,
                   indent: str) -> list[str]:
    """`key: value` as YAML lines at `indent`: a nested section (e.g. `moe.router`) one key a
    line below it, each leaf with its note (`notes[dotted name]`) as a comment."""
    if isinstance(value, dict) and value:
        lines = [f"{indent}{key}:"]
        for inner, inner_value in value.items():
            lines += _setting_lines(inner, inner_value, notes, f"{dotted}.{inner}",
                                    indent + "  ")
        return lines
    line = f"{indent}{key}: {_flow(value)}"
    return [f"{line}  # {notes[dotted]}" if notes.get(dotted) else line]


def train_config_text(sections: dict[str, dict], model: ConvertedModel) -> str:
    """The YAML text: `sections` (the converter's `model`/`moe`/... settings, nested sections
    as the training config's tree, with the notes of `model.notes` as comments) merged with
    `continued_pretraining_settings`, one setting a line."""
    chosen = continued_pretraining_settings(model)
    lines = [f"# Continued pretraining of {model.description}, written by {model.tool}.",
             f"# Train: python -m megamoe.train --config {model.output}/train_config.yaml",
             "# model/moe are the converted architecture (keep them); the other settings were",
             "# chosen for continued pretraining on a CPU, each comment says why."]
    for name in dict.fromkeys([*sections, *chosen]):
        picked = chosen.get(name, {})
        values = {**sections.get(name, {}), **{key: value for key, (value, _) in picked.items()}}
        notes = {**model.notes.get(name, {}),
                 **{key: comment for key, (_, comment) in picked.items()}}
        if not values:
            continue
        lines.append(f"{name}:")
        for key, value in values.items():
            lines += _setting_lines(key, value, notes, key, "  ")
    return "\n".join(lines) + "\n"

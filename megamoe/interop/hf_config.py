"""The `config.json` and `generation_config.json` of an exported Hugging Face model.

`exported_configs` writes them one of two ways:
- **From the source model's own files**, when the checkpoint keeps them (`hf_source/`, written
  by tools/import_hf.py and carried into every checkpoint of a run started from it;
  megamoe.upcycle.hf_files) and the export's architecture is the source's: its config.json with
  only the keys training changed, and its generation_config.json byte for byte. A key changed
  is one where the config generated from the trained settings (`generated_config`, the
  architecture's `write_config`, megamoe.checkpointing.hf) differs from the one generated from
  the source's own settings (read back by its `read_config`), plus the dtype of the written
  tensors, `num_nextn_predict_layers` when the import dropped multi-token-prediction layers,
  and `quantization_config` removed (the written tensors are dequantised); the generator's own
  spelling thus never shows as a change. Each changed key is named.
- **Generated** for a model megamoe made (upcycled, trained from scratch, exported as another
  architecture): bos/eos/pad ids from the recorded tokenizer (a dense Hugging Face source's own
  ids when it was upcycled from one), `max_position_embeddings` the context the model was
  trained for (the dense source's, the run's `seq_length` or YaRN's extended context, whichever
  is longest), its rope scaling (Megatron-Core's Llama 3 rule with its fixed constants, or
  YaRN), and the weight of its balance loss as `router_aux_loss_coef`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from megamoe.bounded import read_bytes_bounded, read_json
from megamoe.checkpointing.hf import ARCHITECTURES, read_hf_moe_model
from megamoe.checkpointing.hf.base import ExportSettings
from megamoe.checkpointing.hf_arch import MAX_CONFIG_BYTES
from megamoe.errors import CheckpointError
from megamoe.paths import inside
from megamoe.train.config import config_from_dict, yarn_settings
from megamoe.upcycle.hf_files import SOURCE_FILES, SOURCE_RECORD

ROPE_KEYS = ("rope_theta", "rope_scaling")
DTYPE_KEYS = ("dtype", "torch_dtype")
ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
DROPPED_KEYS = ("quantization_config",)
"""Keys of the source's config.json the export never writes: its tensors are dequantised."""


@dataclass
class ExportedConfigs:
    config: dict
    """config.json."""
    generation: Optional[bytes]
    """generation_config.json (None: none to write)."""
    origin: str
    """Where config.json came from, for the export's output."""
    changed: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    """Keys that differ from the source's config.json: {key: (source value, exported value)}."""

    def describe(self) -> str:
        """One line for the export's output: where config.json comes from, every changed key."""
        if not self.changed:
            return f"config.json: {self.origin}"
        changes = "; ".join(f"{key} {_short(old)} -> {_short(new)}"
                            for key, (old, new) in self.changed.items())
        return f"config.json: {self.origin}, changed: {changes}"


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


def export_settings(config, pattern: list[bool], vocab_size: int = 0, context: int = 0,
                    mtp_layers: int = 0) -> ExportSettings:
    """What the architecture tables (megamoe.checkpointing.hf) read of a model with the megamoe
    settings `config` (TrainConfig) and layer pattern `pattern`."""
    m, moe = config.model, config.moe_config()
    return ExportSettings(model=m, moe=moe, pattern=tuple(pattern), vocab_size=vocab_size,
                          context=context, mtp_layers=mtp_layers,
                          yarn=yarn_settings(m.yarn) if m.yarn else {},
                          aux_loss_coeff=next(iter(moe.balancing.loss_coeffs.values()), 0.0))


def generated_config(arch: str, config, pattern: list[bool], vocab_size: int, context: int,
                     mtp_layers: int = 0) -> dict:
    """The config.json of a model of architecture `arch` with the megamoe settings `config`
    (TrainConfig), layer pattern `pattern`, `vocab_size` embedding rows and a context of
    `context` tokens (no ids, no dtype: `exported_configs` adds them): the architecture's
    `write_config`."""
    return ARCHITECTURES[arch].write_config(
        export_settings(config, pattern, vocab_size, context, mtp_layers))


def trained_context(model, source_context: Optional[int] = None) -> int:
    """The context a model was trained for: its source's (None: none), the run's seq_length or
    YaRN's extended context (factor x original), whichever is longest."""
    contexts = [model.seq_length, source_context or 0]
    if model.yarn:
        yarn = yarn_settings(model.yarn)
        contexts.append(int(yarn["factor"] * yarn["original_max_position_embeddings"]))
    return max(contexts)


def _source_files(kept: Path) -> tuple[dict, Optional[bytes], dict]:
    """(config.json, generation_config.json bytes or None, the conversion record) in `kept`."""
    source = read_json(inside(kept, SOURCE_FILES[0]), MAX_CONFIG_BYTES, CheckpointError)
    generation = None
    if (kept / SOURCE_FILES[1]).is_file():
        path = inside(kept, SOURCE_FILES[1])
        generation = read_bytes_bounded(path, MAX_CONFIG_BYTES, CheckpointError, str(path))
    record = {}
    if (kept / SOURCE_RECORD).is_file():
        record = read_json(inside(kept, SOURCE_RECORD), MAX_CONFIG_BYTES, CheckpointError)
    if not isinstance(source, dict) or not isinstance(record, dict):
        raise CheckpointError(f"{kept}: {SOURCE_FILES[0]} / {SOURCE_RECORD} hold no JSON object;"
                              " the checkpoint is corrupt")
    return source, generation, record


def _in_source_spelling(changed: dict, source: dict) -> dict:
    """`changed` with rope_theta/rope_scaling folded into `rope_parameters` when the source
    spells its rotary settings that way (transformers 5)."""
    if "rope_parameters" not in source or not any(key in changed for key in ROPE_KEYS):
        return changed
    params = dict(source["rope_parameters"] or {})
    if "rope_theta" in changed:
        params["rope_theta"] = changed["rope_theta"]
    if "rope_scaling" in changed:
        scaling = dict(changed["rope_scaling"] or {})
        scaling["rope_type"] = scaling.pop("type", scaling.get("rope_type", "default"))
        params = {"rope_theta": params.get("rope_theta"), **scaling}
    return {**{k: v for k, v in changed.items() if k not in ROPE_KEYS}, "rope_parameters": params}


def _dtype_key(source: dict) -> str:
    return next((key for key in DTYPE_KEYS if key in source), DTYPE_KEYS[1])


def _from_source(arch: str, config, pattern: list[bool], vocab_size: int, dtype: str,
                 kept: Path, source: dict, generation: Optional[bytes], record: dict
                 ) -> ExportedConfigs:
    """The source's config.json with only the keys training changed (module docstring)."""
    own = read_hf_moe_model(kept)
    own_config = config_from_dict(own.train_sections())
    own_context = own.arch.max_position_embeddings
    mtp = own.mtp_layers
    baseline = generated_config(arch, own_config, list(own.moe.pattern), own.arch.vocab_size,
                                own_context, mtp)
    now = generated_config(arch, config, pattern, vocab_size,
                           trained_context(config.model, own_context),
                           config.model.mtp_layers or
                           (0 if record.get("dropped_mtp_layers") else mtp))
    changed = {key: now.get(key) for key in {**baseline, **now}
               if baseline.get(key) != now.get(key)}
    changed = _in_source_spelling(changed, source)
    dtype_key = _dtype_key(source)
    if source.get(dtype_key) != dtype:
        changed[dtype_key] = dtype
    out = {**source, **changed}
    for key in DROPPED_KEYS:
        if out.pop(key, None) is not None:
            changed[key] = None
    origin = f"the source's ({kept})" + ("" if changed else ", no key changed")
    return ExportedConfigs(out, generation, origin,
                           {key: (source.get(key), value) for key, value in changed.items()})


def _generated(arch: str, config, pattern: list[bool], vocab_size: int, dtype: str,
               ids: dict, dense: Optional[tuple[dict, Optional[bytes]]]) -> ExportedConfigs:
    """A config.json generated from the settings (module docstring); `dense`: the config.json
    and generation_config.json of the Hugging Face model it was made from, if any."""
    source = dense[0] if dense else {}
    context = source.get("max_position_embeddings")
    context = trained_context(config.model, context if isinstance(context, int) else None)
    out = generated_config(arch, config, pattern, vocab_size, context, config.model.mtp_layers)
    for key in ID_KEYS:
        value = source.get(key)
        out[key] = value if value is not None else ids.get(key)
    out[DTYPE_KEYS[1]] = dtype
    generation = dense[1] if dense and dense[1] is not None else _generation_bytes(out)
    origin = (f"generated from the settings, ids and context of the Hugging Face "
              f"{source.get('model_type')} model it was made from" if dense else
              "generated from the settings, ids from the recorded tokenizer")
    return ExportedConfigs(out, generation, origin)


def _generation_bytes(config: dict) -> bytes:
    ids = {key: config[key] for key in ID_KEYS if config.get(key) is not None}
    return (json.dumps(ids, indent=2) + "\n").encode()


def exported_configs(arch: str, config, pattern: list[bool], vocab_size: int, dtype: str,
                     kept: Optional[Path], ids: dict) -> ExportedConfigs:
    """config.json and generation_config.json of the export (module docstring). `config`: the
    trained TrainConfig; `kept`: the checkpoint's `hf_source/` (None: none); `ids`: the
    bos/eos/pad token ids of its tokenizer (ID_KEYS, values None when absent)."""
    if kept is None:
        return _generated(arch, config, pattern, vocab_size, dtype, ids, None)
    source, generation, record = _source_files(kept)
    if source.get("model_type") == arch:
        return _from_source(arch, config, pattern, vocab_size, dtype, kept, source, generation,
                            record)
    return _generated(arch, config, pattern, vocab_size, dtype, ids, (source, generation))

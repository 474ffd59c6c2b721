"""Export a megamoe MoE checkpoint as a Hugging Face model of one of the architectures of
megamoe.checkpointing.hf (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3, ...).

Input: a torch_dist checkpoint written by megamoe (a training checkpoint, whose common state
holds the run's `config`, or tools/upcycle_ckpt.py's / tools/import_hf.py's output, whose common
state holds `megamoe_model`). The architecture is taken from those `model`/`moe` sections; what
the target architecture cannot express is refused in one line before anything is written
(`check_expressible`: the checks every architecture shares, then its own). config.json and
generation_config.json are the source model's own, changed only where training changed them,
when the checkpoint keeps them, else generated (megamoe.interop.hf_config, the architecture's
`write_config`); the tokenizer is the one the checkpoint records
(megamoe.interop.export_tokenizer).

The tensors follow the architecture's table read from the config.json written (its
`read_config`, then `layer_rules`: the very rules the import reads, each transform run the
other way). Tensors are read one layer at a time through DCP (megamoe.checkpointing.dist_source,
any key layout) and written into size-bounded safetensors shards
(megamoe.checkpointing.safetensors_io), so memory holds one layer plus one shard. Every
Megatron tensor of the checkpoint must find its rule and every Hugging Face tensor of the table
must be written (`TensorLedger`), else one line names the tensor.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch

from megamoe.atomic import atomic_directory
from megamoe.checkpointing.hf import ARCHITECTURES
from megamoe.checkpointing.hf.base import (ALL_EXPERTS, FEATURES, MEGATRON_EXPERTS,
                                           Architecture, Block, Rule, TensorLedger)
from megamoe.checkpointing.hf.mtp import mtp_blocks
from megamoe.checkpointing.dist_source import (SKIPPED_PREFIXES, DistSource, join_glu_halves,
                                               split_layer_key)
from megamoe.checkpointing.hf_arch import read_config_json
from megamoe.checkpointing.safetensors_io import ShardedSafetensorsWriter
from megamoe.config import moe_layer_pattern
from megamoe.errors import CheckpointError, ConfigError
from megamoe.interop.export_tokenizer import recorded_tokenizer, token_ids
from megamoe.interop.hf_config import export_settings, exported_configs
from megamoe.paths import refuse_overlap
from megamoe.train.tokenizer import write_tokenizer_files
from megamoe.upcycle.hf_files import kept_source
from megamoe.upcycle.hf_logits import require_within

ARCHS = tuple(ARCHITECTURES)
EMBEDDING = "embedding.word_embeddings.weight"
VERIFY_TOLERANCE = 1e-4


@dataclass
class ExportResult:
    output: Path
    arch: str
    shards: list[str]
    bytes_written: int
    max_logit_diff: Optional[float] = None


def _model_sections(common: dict, folder: Path) -> dict:
    from megamoe.train.checkpoint_shapes import recorded_sections

    sections = recorded_sections(common, folder)
    if isinstance(sections, dict) and isinstance(sections.get("model"), dict) \
            and isinstance(sections.get("moe"), dict):
        return {"model": sections["model"], "moe": sections["moe"]}
    raise CheckpointError(f"{folder} records no megamoe model settings (neither a megamoe "
                          "training checkpoint nor tools/upcycle_ckpt.py output from a Hugging "
                          "Face model); export needs one of those")


def default_arch(config, pattern: list[bool]) -> str:
    """The first registered architecture that expresses this model (none: one line with each
    one's reason)."""
    reasons = []
    for arch in ARCHS:
        try:
            check_expressible(arch, config, pattern)
            return arch
        except ConfigError as err:
            reasons.append(str(err))
    raise ConfigError("no Hugging Face architecture expresses this model: " + " | ".join(reasons))


def check_expressible(arch: str, config, pattern: list[bool]) -> None:
    """Raise a one-line ConfigError for the first setting `arch` cannot express: the checks
    every architecture shares, then the architecture's own."""
    if arch not in ARCHITECTURES:
        raise ConfigError(f"--arch {arch!r} is not one of {list(ARCHS)}")
    table = ARCHITECTURES[arch]
    m, moe = config.model, config.moe_config()
    if config.moe.layer_overrides:
        table.refuse("per-layer MoE overrides (moe.layer_overrides)", "export a uniform MoE model")
    if moe.router.kind != "topk":
        table.refuse(f"router.kind={moe.router.kind!r} (only top-k)",
                     "train with moe.router.kind=topk")
    if moe.dispatcher.capacity_factor is not None:
        table.refuse(f"dispatcher.capacity_factor={moe.dispatcher.capacity_factor} (token "
                     "dropping; Hugging Face MoE blocks are dropless)",
                     "train dropless (moe.dispatcher.capacity_factor=null)")
    if moe.experts.activation not in table.activations or not m.swiglu:
        table.refuse(f"activation {moe.experts.activation!r} (only "
                     f"{', '.join(table.activations)})", "train with SwiGLU")
    if m.normalization != "RMSNorm" or m.position_embedding != "rope":
        table.refuse(f"normalization={m.normalization} / position_embedding="
                     f"{m.position_embedding} (only RMSNorm and RoPE)",
                     "train a Llama-shaped model")
    settings = export_settings(config, pattern)
    for feature, (used, what) in FEATURES.items():
        if used(settings) and feature not in table.features:
            holders = [name for name, other in ARCHITECTURES.items() if feature in other.features]
            table.refuse(what, f"use {' or '.join(holders)}" if holders else
                         "train without it (no architecture megamoe exports holds it)")
    table.check_expressible(settings)


class _Tensors:
    """One block's Megatron tensors by key (`read` gives each, when a rule asks for it), and
    the keys its rules used."""

    def __init__(self, tensors: Iterable[str], where: str, outside: Optional[_Tensors] = None,
                 read: Optional[Callable[[str], torch.Tensor]] = None):
        """tensors: a dict of them, or their keys with `read`; outside: the tensors outside
        the layers, where a copy's original lives."""
        self.tensors = tensors if read is None else dict.fromkeys(tensors)
        self.read = read or tensors.__getitem__
        self.where, self.used = where, set()
        self.outside = outside or self

    def _take(self, key: str) -> torch.Tensor:
        self.used.add(key)
        return self.read(key)

    def find(self, block: Block, rule: Rule, num_experts: int) -> Optional[torch.Tensor]:
        """The Megatron tensor of `rule` (None: the checkpoint has none)."""
        if rule.copy_of:
            outside = self.outside
            return outside.read(rule.megatron) if rule.megatron in outside.tensors else None
        keys = [block.megatron_prefix + key for key in (rule.megatron, *rule.aliases)]
        if rule.expert is None:
            return next((self._take(key) for key in keys if key in self.tensors), None)
        stacked = keys[0]
        if stacked in self.tensors:
            tensor = self._take(stacked)
            return tensor if rule.expert == ALL_EXPERTS else tensor[rule.expert]
        one = stacked.replace(MEGATRON_EXPERTS, MEGATRON_EXPERTS + "{}.", 1).format
        experts = range(num_experts) if rule.expert == ALL_EXPERTS else (rule.expert,)
        if not all(one(e) in self.tensors for e in experts):
            return None
        parts = [self._take(one(e)) for e in experts]
        return torch.stack(parts) if rule.expert == ALL_EXPERTS else parts[0]

    def check_all_used(self) -> None:
        left = sorted(set(self.tensors) - self.used)
        if left:
            raise CheckpointError(f"{self.where}: tensor {left[0]} has no place in the "
                                  f"exported model ({len(left)} such); the checkpoint holds "
                                  "what this architecture cannot write")


def _block_tensors(block: Block, tensors: _Tensors, table: Architecture, num_experts: int,
                   dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    """The Hugging Face tensors of one block, from its Megatron tensors (each rule's inverse
    transform)."""
    out = []
    for rule in block.rules:
        tensor = tensors.find(block, rule, num_experts)
        if rule.nonzero_refusal is not None:
            if tensor is not None and bool(tensor.abs().max() > 0):
                raise ConfigError(rule.nonzero_refusal.format(
                    layer=block.layer, max=float(tensor.abs().max())))
            continue
        if tensor is None and rule.zeros_if_absent:
            parts = [torch.zeros(shape, dtype=rule.dtype or dtype) for shape in rule.shapes]
        elif tensor is None:
            raise CheckpointError(f"{tensors.where} lacks tensor {block.megatron_prefix}"
                                  f"{rule.megatron} that --arch {table.model_type} needs for "
                                  f"{block.hf_prefix}{rule.hf[0]}; the checkpoint is incomplete")
        else:
            parts = rule.transform.to_hf(tensor, rule.shapes)
        if rule.copy_of:  # written twice: two tensors, not one shared by both names
            parts = [part.clone() for part in parts]
        out += [(block.hf_prefix + name, part) for name, part in zip(rule.hf, parts)]
    return out


def _outside_keys(source) -> list[str]:
    """The checkpoint's model tensors outside `decoder.layers.` (embedding, final norm, output
    layer, multi-token-prediction layers)."""
    return [key for key in source.reader.tensors() if split_layer_key(key)[0] is None
            and not key.startswith(SKIPPED_PREFIXES)]


def _read(source, keys: list[str]) -> dict[str, torch.Tensor]:
    """Those tensors, GLU halves saved apart joined."""
    return join_glu_halves({key: source.reader.read(key) for key in keys})


def _embedding(source, folder: Path) -> tuple[int, torch.dtype]:
    """(vocabulary rows, dtype) of the checkpoint's embedding, from its metadata."""
    metadata = source.reader.tensors().get(EMBEDDING)
    if metadata is None:
        raise CheckpointError(f"{folder} has no {EMBEDDING}; it is not a GPT checkpoint")
    return int(metadata.size[0]), metadata.properties.dtype


def _write_blocks(source: DistSource, folder: Path, table: Architecture, model, blocks: list[Block],
                  dtype: torch.dtype, writer: ShardedSafetensorsWriter, save) -> str:
    """Write every block's Hugging Face tensors, one block's Megatron tensors in memory at a
    time; fail naming a Megatron tensor no rule took or a Hugging Face tensor not written.
    Returns the count, one line."""
    ledger = TensorLedger({name: shape for block in blocks
                           for name, shape in block.hf_names().items()},
                          str(save), f"the {table.model_type} model")
    keys = _outside_keys(source)
    prefixes = tuple(block.megatron_prefix for block in blocks if block.megatron_prefix)
    # The embedding and output layer are read when written, never held together.
    outside = _Tensors([k for k in keys if not k.startswith(prefixes)], str(folder),
                       read=source.reader.read)
    if model.arch.tie_word_embeddings:
        outside.used.add("output_layer.weight")
    for block in blocks:
        if block.layer is not None:
            tensors = _Tensors(source.layer(block.layer).tensors,
                               f"{folder} layer {block.layer}", outside)
        elif block.megatron_prefix:
            tensors = _Tensors(_read(source, [k for k in keys
                                              if k.startswith(block.megatron_prefix)]),
                               str(folder), outside)
        else:
            tensors = outside
        for name, tensor in _block_tensors(block, tensors, table, model.moe.num_experts, dtype):
            ledger.mark(name, tuple(tensor.shape))
            writer.add(name, tensor)
        if tensors is not outside:
            tensors.check_all_used()
    outside.check_all_used()
    return ledger.close()


def export_hf(load, save, arch: Optional[str] = None, tokenizer=None, overwrite: bool = False,
              verify: bool = False, max_shard_bytes: int = 2 * 2**30,
              log: Callable[[str], None] = print) -> ExportResult:
    """Write the MoE checkpoint at `load` as a Hugging Face model directory `save` (see the
    module docstring). verify: load it with transformers and compare logits with megamoe's
    (max |difference| <= 1e-4 in fp32), and run `generate`."""
    from megamoe.checkpointing.layout import resolve_weights_dir
    from megamoe.checkpointing.safe_dcp import load_common_state
    from megamoe.train.config import config_from_dict

    refuse_overlap(save, [load, tokenizer])
    folder = resolve_weights_dir(load)
    source = DistSource(folder, moe=True)  # every file checked against its manifest first
    common = load_common_state(folder)
    sections = _model_sections(common, folder)
    config = config_from_dict(sections)
    pattern = moe_layer_pattern(config.model, config.model.first_k_dense)
    kept = kept_source(folder)
    arch = arch or _source_arch(kept) or default_arch(config, pattern)
    check_expressible(arch, config, pattern)
    shipped, record = recorded_tokenizer(folder, common, Path(load), tokenizer)
    if source.num_layers != config.model.num_layers:
        raise CheckpointError(f"{folder} has {source.num_layers} layers but its config says "
                              f"{config.model.num_layers}; the checkpoint is corrupt")
    vocab_size, dtype = _embedding(source, folder)
    configs = exported_configs(arch, config, pattern, vocab_size,
                               str(dtype).removeprefix("torch."), kept,
                               token_ids(shipped, record))
    table = ARCHITECTURES[arch]
    # The table of the config.json written: what the import of the export will expect.
    model = table.read_config(configs.config, Path(save) / "config.json")
    blocks = table.blocks(model) + mtp_blocks(table, model, config.model.mtp_layers)
    # The folder is uploaded to the Hub as it is: its ownership mark lies beside it.
    with atomic_directory(save, overwrite=overwrite, owner="export_hf",
                          outside_mark=True) as tmp:
        writer = ShardedSafetensorsWriter(tmp, max_shard_bytes)
        counted = _write_blocks(source, folder, table, model, blocks, dtype, writer, save)
        shards = writer.finish()
        log(f"exported {folder} as {arch}: {counted}, {len(shards)} shard(s), "
            f"{writer.total_bytes / 2**20:.1f} MiB")
        if shipped is None:
            log(f"warning: {folder} records no tokenizer: the model is written without one "
                "(pass --tokenizer DIR to add it)")
        else:
            names = write_tokenizer_files(shipped, tmp)
            log(f"tokenizer: {shipped.describe()} ({', '.join(names)})")
        (tmp / "config.json").write_text(json.dumps(configs.config, indent=2) + "\n")
        if configs.generation is not None:
            (tmp / "generation_config.json").write_bytes(configs.generation)
        log(configs.describe())
        diff = _verify(tmp, folder, sections, log) if verify else None
    return ExportResult(Path(save), arch, shards, writer.total_bytes, diff)


def _source_arch(kept: Optional[Path]) -> Optional[str]:
    """The source model's architecture when the checkpoint keeps its config and it is one the
    export writes (the default --arch)."""
    if kept is None:
        return None
    kind = read_config_json(kept).get("model_type")
    return kind if kind in ARCHS else None


def _verify(out: Path, folder: Path, sections: dict, log: Callable[[str], None]) -> float:
    from megamoe.upcycle.hf_logits import hf_logits, load_hf_model, megamoe_logits, sample_tokens

    hf = load_hf_model(out)
    tokens = sample_tokens(hf.config.vocab_size)
    reference = hf_logits(hf, tokens)
    hf.generate(tokens[:1, :8].to(hf.device), max_new_tokens=4, do_sample=False)
    ours = megamoe_logits(folder, {**sections, "vocab_size": reference.shape[-1]}, tokens)
    diff = float((reference - ours).abs().max())
    log(f"verify: max |logit diff| megamoe vs transformers = {diff:.3e} (bar "
        f"{VERIFY_TOLERANCE:.0e}); generate ran")
    require_within(diff, VERIFY_TOLERANCE, "logit")
    return diff

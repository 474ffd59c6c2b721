"""Convert a dense Megatron-Core checkpoint into an MoE checkpoint, streaming layer by layer.

Output, in Megatron-LM's layout so `--load OUT` finds it: `OUT/latest_checkpointed_iteration.txt`
("release": the iteration counter restarts and no optimizer state is expected),
`OUT/release/` (the torch_dist checkpoint, with megamoe's checksum manifest),
`OUT/upcycle_recipe.json` (the recipe, also stored
in the checkpoint's common state under `upcycle_recipe`) and `OUT/upcycle_metrics.jsonl` (one
line per written part: seconds, bytes, MB/s). From a Hugging Face model also
`OUT/train_config.yaml` (the `model` and `moe` sections of a megamoe training config that builds
the MoE model, also in the common state under `megamoe_model`, with continued-pretraining
settings on the model's own tokenizer: megamoe.upcycle.train_recipe), and in `OUT/release/` the
tokenizer and the source's config files (megamoe.upcycle.hf_files), which tools/export_hf.py
writes back out. Everything is written to a temporary directory that is renamed to OUT only when
the conversion (and `verify`, if asked) succeeded.

Memory: one dense layer, one expert at a time, and one non-layer tensor (e.g. the embedding).
"""
from __future__ import annotations

import argparse
import copy
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import yaml
from tqdm import tqdm

from megamoe.atomic import atomic_directory
from megamoe.checkpointing.dcp_writer import StreamingCheckpointWriter
from megamoe.checkpointing.layout import CONVERTED_MODEL_KEY, RELEASE, TRACKER
from megamoe.checkpointing.manifest import write_manifest
from megamoe.checkpointing.readers import open_dense_checkpoint
from megamoe.checkpointing.sharded_keys import KeyLayout, whole_tensor
from megamoe.checkpointing.source import DenseSource
from megamoe.errors import CheckpointError, ConfigError
from megamoe.paths import refuse_overlap
from megamoe.upcycle.granular import MLPWeights
from megamoe.upcycle.hf_files import HFOrigin, carry_hf_files, hf_origin, tokenizer_line
from megamoe.upcycle.moe_layer import dense_layer_items, layer_dense_mlp, moe_layer_items
from megamoe.upcycle.recipe import UpcycleRecipe
from megamoe.upcycle.train_recipe import train_config_text

RECIPE_FILE = "upcycle_recipe.json"
METRICS_FILE = "upcycle_metrics.jsonl"
TRAIN_CONFIG_FILE = "train_config.yaml"
VERIFY_TOLERANCE = 1e-4
# An upcycled router starts untrained: it is balanced by the Switch loss (arXiv 2101.03961) as the
# sparse-upcycling recipe trains it (Komatsuzaki et al., arXiv 2212.05055).
UPCYCLED_BALANCING = {"methods": "aux_loss", "aux_loss_coeff": 1e-2}
UPCYCLED_BALANCING_NOTES = {
    "balancing.methods": "the upcycled routers start untrained: the Switch load-balancing "
                         "loss, as sparse upcycling trains them (arXiv 2212.05055)",
    "balancing.aux_loss_coeff": "the Switch Transformer's weight (arXiv 2101.03961)"}
# Megatron-LM argument names of the TransformerConfig fields in `megatron_settings`.
ARG_NAMES = {"num_moe_experts": "num_experts"}


@dataclass
class UpcycleResult:
    output: Path
    """The Megatron-LM checkpoint root (pass it to `--load`)."""
    checkpoint_dir: Path
    """The torch_dist directory (pass it to `dist_checkpointing.load`)."""
    record: dict
    """What `upcycle_recipe.json` holds."""
    bytes_written: int
    seconds: float
    max_logit_diff: Optional[float] = None


def resolve_activation(recipe: UpcycleRecipe, source: DenseSource, gated: bool) -> str:
    """The dense activation: the recipe's, else swiglu for a GLU, else Megatron-LM's args."""
    if recipe.activation is not None:
        return recipe.activation
    if gated:
        return "swiglu"
    if source.args is not None and getattr(source.args, "squared_relu", False):
        return "squared_relu"
    return "gelu"


def _moe_args(args: argparse.Namespace, settings: dict) -> argparse.Namespace:
    """Megatron-LM's saved args with the MoE settings applied."""
    moe_args = copy.copy(args)
    for name, value in settings.items():
        setattr(moe_args, ARG_NAMES.get(name, name), value)
    return moe_args


def upcycle_checkpoint(load, save, recipe: UpcycleRecipe, overwrite: bool = False,
                       verify: bool = False, arch_overrides: Optional[dict] = None,
                       progress: bool = True,
                       log: Callable[[str], None] = print) -> UpcycleResult:
    """Upcycle the dense checkpoint at `load` into an MoE checkpoint at `save` by `recipe`.

    verify: afterwards load the dense and the MoE model (Megatron-Core's own MoE GPTModel) and
    compare logits; for a function-preserving recipe the max |difference| must be <= 1e-4.
    arch_overrides: TransformerConfig fields for `verify` that the checkpoint does not record
    (e.g. {"num_attention_heads": 16}).
    """
    load, save = Path(load), Path(save)
    if verify and recipe.topk % recipe.granularity:
        raise ConfigError(f"--verify checks function preservation, which needs topk={recipe.topk} "
                          f"to be a multiple of granularity={recipe.granularity}")
    refuse_overlap(save, [load])
    source = open_dense_checkpoint(load)
    pattern = recipe.layer_pattern(source.num_layers)
    layout = KeyLayout(recipe.resolved_key_layout(), source.num_layers)
    origin = None
    if source.format == "hf_safetensors":
        origin = hf_origin(source.directory, save, "tools/upcycle_ckpt.py",
                           f"{source.description}, upcycled", source.arch,
                           {"tool": "megamoe.upcycle", "source": str(load.resolve())},
                           {"moe": UPCYCLED_BALANCING_NOTES})
    start = time.perf_counter()
    with atomic_directory(save, overwrite=overwrite, owner="upcycle_ckpt") as tmp:
        log(f"upcycling {source.description}: {sum(pattern)}/{source.num_layers} layers -> "
            f"{recipe.num_experts} experts (G={recipe.granularity}, top-{recipe.topk}), "
            f"{layout.kind} keys")
        checkpoint_dir = tmp / RELEASE
        checkpoint_dir.mkdir()
        writer = StreamingCheckpointWriter(checkpoint_dir)
        metrics, mlp_info = _write_parts(source, pattern, layout, recipe, writer, progress)
        record = _record(recipe, source, load, pattern, layout.kind, mlp_info)
        common = {"checkpoint_version": 3.0, "iteration": 0, "upcycle_recipe": record}
        if source.args is not None:
            common["args"] = _moe_args(source.args, record["megatron_settings"])
        sections = train_sections(source.model_settings, record)
        if origin is not None:
            sections["moe"]["balancing"] = dict(UPCYCLED_BALANCING)
        finish_release(tmp, writer, common, sections, origin)
        (tmp / RECIPE_FILE).write_text(json.dumps(record, indent=2) + "\n")
        (tmp / METRICS_FILE).write_text("".join(json.dumps(m) + "\n" for m in metrics))
        seconds = time.perf_counter() - start
        log(f"wrote {writer.bytes_written / 2**20:.1f} MiB in {seconds:.1f} s "
            f"({writer.bytes_written / 2**20 / max(seconds, 1e-9):.1f} MiB/s)")
        if origin is not None:
            log(tokenizer_line(origin))
        max_diff = _verify(source, checkpoint_dir, record, arch_overrides, log) if verify else None
    return UpcycleResult(save, save / RELEASE, record, writer.bytes_written, seconds,
                         max_diff)


def finish_release(tmp: Path, writer: StreamingCheckpointWriter, common: dict,
                   sections: Optional[dict], origin: Optional[HFOrigin]) -> None:
    """Complete a converter's output in Megatron-LM's layout under `tmp`: from a Hugging Face
    model, its tokenizer and config files in the checkpoint folder (megamoe.upcycle.hf_files)
    and train_config.yaml (megamoe.upcycle.train_recipe: the training config's `model`/`moe`
    sections, also in the common state, with continued-pretraining settings); the common state,
    megamoe's checksum manifest and the tracker."""
    if origin is not None:
        common = {**common, **carry_hf_files(origin, tmp / RELEASE)}
    if sections is not None:
        common = {**common, CONVERTED_MODEL_KEY: sections}
        text = (train_config_text(sections, origin.model) if origin is not None
                else yaml.safe_dump(sections, sort_keys=False))
        (tmp / TRAIN_CONFIG_FILE).write_text(text)
    writer.finish(common)
    write_manifest(tmp / RELEASE)
    (tmp / TRACKER).write_text(RELEASE)


def _write_parts(source: DenseSource, pattern: list[bool], layout: KeyLayout,
                 recipe: UpcycleRecipe, writer: StreamingCheckpointWriter,
                 progress: bool) -> tuple[list[dict], dict]:
    """Write every layer (upcycled where `pattern` says), then the embeddings and output layer.
    Returns per-part metrics and the MoE layers' dense MLP shape."""
    metrics, mlp_info = [], {}
    # Closed before an error leaves, so the one-line error is the last line on stderr.
    with tqdm(total=len(pattern) + 1, desc="upcycle", unit="layer",
              disable=not progress) as bar:
        for index, is_moe in enumerate(pattern):
            start = time.perf_counter()
            dense = source.layer(index)
            if is_moe:
                _check_same_mlp(mlp_info, layer_dense_mlp(dense, index), index)
                activation = resolve_activation(recipe, source, mlp_info["gated"])
                items = moe_layer_items(layout, index, dense, recipe, activation)
            else:
                items = dense_layer_items(layout, index, dense)
            written = writer.write_part(*items)
            del dense, items
            metrics.append(part_metric(f"layer {index}", is_moe, written, start))
            bar.update(1)
        start, written = time.perf_counter(), 0
        for key, tensor in source.non_layer_tensors():
            written += writer.write_part([whole_tensor(key, tensor)])
        written += writer.write_part((), source.non_layer_objects())
        metrics.append(part_metric("embeddings and output layer", False, written, start))
        bar.update(1)
    return metrics, mlp_info


def _check_same_mlp(info: dict, mlp: MLPWeights, layer: int) -> None:
    """Megatron's MoE config has one expert size: every MoE layer's dense MLP must match."""
    shape = {"dense_ffn_hidden_size": mlp.ffn_size, "hidden_size": mlp.fc1.shape[1],
             "gated": mlp.gated}
    if info and info != shape:
        raise ConfigError(f"layer {layer}'s MLP {shape} differs from the earlier MoE layers' "
                          f"{info}; upcycle layers of one MLP shape (see --moe-layers)")
    info.update(shape)


def part_metric(part: str, moe: bool, written: int, start: float) -> dict:
    seconds = time.perf_counter() - start
    return {"part": part, "moe": moe, "seconds": round(seconds, 4), "bytes": written,
            "mb_per_s": round(written / 1e6 / max(seconds, 1e-9), 2)}


def _record(recipe: UpcycleRecipe, source: DenseSource, load: Path, pattern: list[bool],
            key_layout: str, mlp_info: dict) -> dict:
    """The recipe metadata stored with the output."""
    activation = resolve_activation(recipe, source, mlp_info["gated"])
    preserving, reason = recipe.function_preserving(mlp_info["gated"], activation)
    return {
        "tool": "megamoe.upcycle",
        "recipe": recipe.to_dict(),
        "method": ("granular" if recipe.granularity > 1 else "sparse_copy")
        + ("+drop" if recipe.drop_ratio > 0 else ""),
        "source": {"path": str(load.resolve()), "format": source.format,
                   "description": source.description},
        "num_layers": source.num_layers,
        "moe_layer_pattern": [int(moe) for moe in pattern],
        "key_layout": key_layout,
        "activation": activation,
        **mlp_info,
        "megatron_settings": recipe.megatron_settings(source.num_layers,
                                                      mlp_info["dense_ffn_hidden_size"]),
        "function_preserving": preserving,
        "not_function_preserving_because": reason or None,
        "optimizer_state": "not carried; iteration restarts at 0",
    }


def train_sections(model_settings: Optional[dict], record: dict) -> Optional[dict]:
    """The `model` and `moe` sections of a megamoe training config that build the upcycled
    model (None when the source does not tell the whole architecture)."""
    if model_settings is None:
        return None
    mg = record["megatron_settings"]
    model = {**model_settings, "moe_layer_freq": mg["moe_layer_freq"]}
    moe = {"num_experts": mg["num_moe_experts"], "ffn_hidden_size": mg["moe_ffn_hidden_size"],
           "topk": mg["moe_router_topk"],
           "router": {"kind": "topk", "score_function": mg["moe_router_score_function"],
                      "pre_softmax": mg["moe_router_pre_softmax"]},
           "shared_expert": {"ffn_hidden_size": mg["moe_shared_expert_intermediate_size"],
                             "gate": mg.get("moe_shared_expert_gate", False)}}
    return {"model": model, "moe": moe}


def _verify(source: DenseSource, checkpoint_dir: Path, record: dict,
            arch_overrides: Optional[dict], log: Callable[[str], None]) -> float:
    """Compare dense and MoE logits; enforce the bar for function-preserving recipes."""
    if source.format == "hf_safetensors":
        from megamoe.upcycle.hf_logits import hf_vs_megamoe
        diff = hf_vs_megamoe(source.directory, checkpoint_dir,
                             train_sections(source.model_settings, record))
    else:
        from megamoe.upcycle.verify import max_logit_difference
        diff = max_logit_difference(source, checkpoint_dir, record, arch_overrides or {})
    if record["function_preserving"]:
        log(f"verify: max |logit diff| = {diff:.3e} (bar {VERIFY_TOLERANCE:.0e})")
        if not diff <= VERIFY_TOLERANCE:
            raise CheckpointError(f"verification failed: max |logit diff| {diff:.3e} exceeds "
                                  f"{VERIFY_TOLERANCE:.0e} for a function-preserving recipe; "
                                  "no output was written")
    else:
        log(f"verify: max |logit diff| = {diff:.3e} (no bar: "
            f"{record['not_function_preserving_because']})")
    return diff

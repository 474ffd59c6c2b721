"""Megatron-DeepSpeed MoE checkpoints read layer by layer as megamoe layers.

Checkpoint layout (DeepSpeed `engine.save_checkpoint`, Megatron-DeepSpeed GPT, tensor parallel
size 1): `DIR/latest` names the tag; `DIR/TAG/mp_rank_00_model_states.pt` holds everything but
the experts under `module` (the gate is `...layers.{L}.mlp.deepspeed_moe.gate.wg.weight`), and
`DIR/TAG/layer_{m}_expert_{e}_mp_rank_00_model_states.pt` holds expert e (global id) of the m-th
MoE module (`...mlp.deepspeed_moe.experts.deepspeed_experts.{e}.dense_h_to_4h|dense_4h_to_h.*`).
Every file is a torch.save pickle and is loaded only through megamoe's allow-list
(megamoe.checkpointing.torch_files: weights_only, plus argparse.Namespace for Megatron's args).

Megatron-DeepSpeed -> Megatron-Core key names within `language_model.encoder.layers.{L}.`:
`input_layernorm.*` -> `self_attention.linear_qkv.layer_norm_*`, `self_attention.query_key_value.*`
-> `self_attention.linear_qkv.*` (the same per-head [q, k, v] row order), `self_attention.dense` ->
`self_attention.linear_proj`, `post_attention_layernorm.*` -> `mlp.linear_fc1.layer_norm_*`,
`mlp.dense_h_to_4h|dense_4h_to_h` -> `mlp.linear_fc1|fc2` (dense layers), the gate ->
`mlp.router.weight`, expert e's `dense_h_to_4h|dense_4h_to_h` -> expert e's `linear_fc1|fc2`.
Outside the layers: `embedding.word_embeddings|position_embeddings`, `encoder.final_layernorm` ->
`decoder.final_layernorm`, `output_layer`. megamoe's linear layers have no biases, so nonzero
linear biases (other than QKV) are refused.

Routing equivalence: DeepSpeed's top-1 gate is the softmax probability (megamoe `pre_softmax`),
top-2 and top-k gates are renormalised over the chosen experts (megamoe's default softmax after
selection). It is exact for DeepSpeed's dropless mode (`drop_tokens=False`, no Gumbel sampling of
the second expert); with capacity dropping the dropped tokens differ.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from megamoe.checkpointing.sharded_keys import ObjectItem
from megamoe.checkpointing.torch_files import load_torch_file
from megamoe.errors import CheckpointError
from megamoe.paths import inside

MODEL_FILE = "mp_rank_00_model_states.pt"
EXPERT_FILE = re.compile(r"layer_(\d+)_expert_(\d+)_mp_rank_(\d+)_model_states\.pt")
LAYER = re.compile(r"^(?:module\.)?language_model\.encoder\.layers\.(\d+)\.(.+)$")
GATE = "mlp.deepspeed_moe.gate.wg.weight"
EXPERT_KEY = re.compile(r"mlp\.deepspeed_moe\.experts\.deepspeed_experts\.(\d+)\.(dense_h_to_4h|"
                        r"dense_4h_to_h)\.(weight|bias)$")
LAYER_KEYS = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
              "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
              "self_attention.query_key_value.weight": "self_attention.linear_qkv.weight",
              "self_attention.query_key_value.bias": "self_attention.linear_qkv.bias",
              "self_attention.dense.weight": "self_attention.linear_proj.weight",
              "post_attention_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
              "post_attention_layernorm.bias": "mlp.linear_fc1.layer_norm_bias",
              "mlp.dense_h_to_4h.weight": "mlp.linear_fc1.weight",
              "mlp.dense_4h_to_h.weight": "mlp.linear_fc2.weight",
              GATE: "mlp.router.weight"}
ZERO_ONLY = ("self_attention.dense.bias", "mlp.dense_h_to_4h.bias", "mlp.dense_4h_to_h.bias")
NON_LAYER_KEYS = {"language_model.embedding.word_embeddings.weight":
                  "embedding.word_embeddings.weight",
                  "language_model.embedding.position_embeddings.weight":
                  "embedding.position_embeddings.weight",
                  "language_model.encoder.final_layernorm.weight": "decoder.final_layernorm.weight",
                  "language_model.encoder.final_layernorm.bias": "decoder.final_layernorm.bias",
                  "language_model.output_layer.weight": "output_layer.weight"}
FC1, FC2 = "experts.linear_fc1.weight", "experts.linear_fc2.weight"


def _require_zero(tensor: torch.Tensor, name: str) -> None:
    if bool(tensor.abs().max() > 0):
        raise CheckpointError(f"{name} is a nonzero linear bias; megamoe's layers have none "
                              "(Megatron-DeepSpeed --disable-bias-linear models convert)")


def is_deepspeed_checkpoint(path: Path) -> bool:
    """A DeepSpeed checkpoint tag directory, or a folder whose `latest` file names one."""
    return (path / MODEL_FILE).is_file() or (path / "latest").is_file()


def resolve_tag_dir(path: Path) -> Path:
    """The checkpoint tag directory: `path` itself, or the tag `path/latest` names."""
    if not path.is_dir():
        raise CheckpointError(f"DeepSpeed checkpoint {path} does not exist or is not a directory")
    if (path / MODEL_FILE).is_file():
        return path
    latest = path / "latest"
    if latest.is_file():
        tag = inside(path, latest.read_bytes()[:256].decode("utf-8", "replace").strip())
        if (tag / MODEL_FILE).is_file():
            return tag
        raise CheckpointError(f"{latest} names {tag.name}, which has no {MODEL_FILE}")
    raise CheckpointError(f"no DeepSpeed checkpoint at {path}: expected {MODEL_FILE} or a "
                          "'latest' file naming the tag directory")


@dataclass
class DeepSpeedLayer:
    """One transformer layer in Megatron-Core names; experts stacked [E, out, in]."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def is_moe(self) -> bool:
        return "mlp.router.weight" in self.tensors


class DeepSpeedSource:
    """A Megatron-DeepSpeed MoE checkpoint, one layer at a time (see the module docstring)."""

    format = "deepspeed"

    def __init__(self, path: Path):
        self.directory = resolve_tag_dir(path)
        if any(p.name.startswith("mp_rank_01") for p in self.directory.iterdir()):
            raise CheckpointError(f"{self.directory} is tensor-parallel (mp_rank_01_*); only "
                                  "tensor-parallel size 1 DeepSpeed checkpoints convert")
        state = load_torch_file(self.directory / MODEL_FILE)
        module = state.get("module") if isinstance(state, dict) else None
        if not isinstance(module, dict):
            raise CheckpointError(f"{self.directory / MODEL_FILE} has no 'module' state dict; it "
                                  "is not a DeepSpeed model checkpoint")
        self.args = state.get("args")
        self._layers: dict[int, dict[str, torch.Tensor]] = {}
        self._non_layer: dict[str, torch.Tensor] = {}
        for key, tensor in module.items():
            match = LAYER.match(key)
            if match:
                self._layers.setdefault(int(match.group(1)), {})[match.group(2)] = tensor
            elif key.removeprefix("module.") in NON_LAYER_KEYS:
                self._non_layer[NON_LAYER_KEYS[key.removeprefix("module.")]] = tensor
            else:
                raise CheckpointError(f"{self.directory / MODEL_FILE}: unknown key {key}; only "
                                      "Megatron-DeepSpeed GPT checkpoints convert")
        self.num_layers = max(self._layers, default=-1) + 1
        if sorted(self._layers) != list(range(self.num_layers)) or not self.num_layers:
            raise CheckpointError(f"{self.directory}: layers {sorted(self._layers)} are not "
                                  "0..L-1; the checkpoint is incomplete")
        self.moe_layers = [i for i in range(self.num_layers) if GATE in self._layers[i]]
        if not self.moe_layers:
            raise CheckpointError(f"{self.directory} has no DeepSpeed MoE gate "
                                  f"(*.{GATE}); it is not an MoE checkpoint")
        self._expert_files = self._index_expert_files()
        self.num_experts = int(self._layers[self.moe_layers[0]][GATE].shape[0])

    def _index_expert_files(self) -> dict[int, dict[int, Path]]:
        """moe_layer_id -> global expert id -> file."""
        files: dict[int, dict[int, Path]] = {}
        for path in self.directory.iterdir():
            match = EXPERT_FILE.fullmatch(path.name)
            if match:
                files.setdefault(int(match.group(1)), {})[int(match.group(2))] = path
        return files

    def _experts(self, moe_id: int, layer: int, count: int) -> dict[str, torch.Tensor]:
        files = self._expert_files.get(moe_id, {})
        missing = sorted(set(range(count)) - set(files))
        if missing:
            raise CheckpointError(f"{self.directory}: expert files of MoE layer {moe_id} (layer "
                                  f"{layer}) are missing for experts {missing[:4]} "
                                  f"(layer_{moe_id}_expert_<e>_mp_rank_00_model_states.pt)")
        fc1, fc2 = [], []
        for expert in range(count):
            state = load_torch_file(files[expert])
            found = {}
            for key, tensor in (state.items() if isinstance(state, dict) else ()):
                match = EXPERT_KEY.search(key)
                if match and int(match.group(1)) == expert:
                    found[(match.group(2), match.group(3))] = tensor
            for (name, kind), tensor in found.items():
                if kind == "bias":
                    _require_zero(tensor, f"expert {expert} {name}.bias of layer {layer}")
            if ("dense_h_to_4h", "weight") not in found or ("dense_4h_to_h", "weight") not in found:
                raise CheckpointError(f"{files[expert]} lacks expert {expert}'s dense_h_to_4h/"
                                      "dense_4h_to_h weights; the checkpoint is corrupt")
            fc1.append(found[("dense_h_to_4h", "weight")])
            fc2.append(found[("dense_4h_to_h", "weight")])
        return {FC1: torch.stack(fc1), FC2: torch.stack(fc2)}

    def layer(self, index: int) -> DeepSpeedLayer:
        raw = self._layers[index]
        tensors = {}
        for key, tensor in raw.items():
            if key in ZERO_ONLY:
                _require_zero(tensor, f"layer {index} {key}")
            elif key in LAYER_KEYS:
                tensors[LAYER_KEYS[key]] = tensor
            elif not EXPERT_KEY.search(key):
                raise CheckpointError(f"layer {index}: unknown key {key}; only Megatron-DeepSpeed "
                                      "GPT layers convert")
        if index in self.moe_layers:
            experts = self._experts(self.moe_layers.index(index), index,
                                    int(raw[GATE].shape[0]))
            tensors.update({f"mlp.{key}": value for key, value in experts.items()})
        return DeepSpeedLayer(tensors)

    def deepspeed_state(self, index: int) -> dict[str, torch.Tensor]:
        """MoE layer `index` as DeepSpeed's own `MoE` module names it (keys after `mlp.`),
        straight from the checkpoint files, for loading into `deepspeed_moe_layer`."""
        moe_id = self.moe_layers.index(index)
        state = {"deepspeed_moe.gate.wg.weight": self._layers[index][GATE]}
        for path in self._expert_files.get(moe_id, {}).values():
            state.update({key.split(".mlp.", 1)[1]: tensor
                          for key, tensor in load_torch_file(path).items()})
        return state

    def non_layer_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self._non_layer.items()

    def non_layer_objects(self) -> list[ObjectItem]:
        return []

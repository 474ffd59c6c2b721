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
from typing import Iterator, Optional

import torch

from megamoe.bounded import read_bytes_bounded
from megamoe.checkpointing.expected_tensors import Shape, check_shapes, check_tensor
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
        name = read_bytes_bounded(latest, 4096, CheckpointError, f"DeepSpeed tag file {latest}")
        tag = inside(path, name.decode("utf-8", "replace").strip())
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


@dataclass(frozen=True)
class DeclaredModel:
    """The model a DeepSpeed checkpoint declares, which every tensor must fit: its sizes from
    Megatron-DeepSpeed's saved `args` where they are there, else from the tensor that defines
    each (the word embeddings: vocabulary and hidden size; the first MoE layer's gate: the
    experts; the first dense layer's and the first expert's down projection: the FFN sizes),
    and the importer's activation (SwiGLU doubles the up projection's rows)."""

    hidden: Optional[int]
    vocab: Optional[int]
    experts: Optional[int]
    dense_ffn: Optional[int]
    expert_ffn: Optional[int]
    glu: bool

    def describe(self) -> str:
        return (f"the model (hidden {self.hidden}, vocab {self.vocab}, {self.experts} experts, "
                f"FFN {self.expert_ffn}, {'swiglu' if self.glu else 'gelu'})")

    def layer_shapes(self) -> dict[str, Shape]:
        """Megatron-DeepSpeed layer key -> shape (attention widths are not fixed: heads)."""
        H, up = self.hidden, _times(2 if self.glu else 1, self.dense_ffn)
        return {"input_layernorm.weight": (H,), "input_layernorm.bias": (H,),
                "post_attention_layernorm.weight": (H,), "post_attention_layernorm.bias": (H,),
                "self_attention.query_key_value.weight": (None, H),
                "self_attention.query_key_value.bias": (None,),
                "self_attention.dense.weight": (H, None), "self_attention.dense.bias": (H,),
                "mlp.dense_h_to_4h.weight": (up, H), "mlp.dense_h_to_4h.bias": (up,),
                "mlp.dense_4h_to_h.weight": (H, self.dense_ffn), "mlp.dense_4h_to_h.bias": (H,),
                GATE: (self.experts, H)}

    def expert_shapes(self) -> dict[tuple[str, str], Shape]:
        """(linear, weight|bias) -> shape of one expert's MLP."""
        H, F = self.hidden, self.expert_ffn
        up = _times(2 if self.glu else 1, F)
        return {("dense_h_to_4h", "weight"): (up, H), ("dense_h_to_4h", "bias"): (up,),
                ("dense_4h_to_h", "weight"): (H, F), ("dense_4h_to_h", "bias"): (H,)}

    def non_layer_shapes(self) -> dict[str, Shape]:
        """Megatron-Core key -> shape of the tensors outside the layers."""
        H = self.hidden
        return {"embedding.word_embeddings.weight": (self.vocab, H),
                "embedding.position_embeddings.weight": (None, H),
                "decoder.final_layernorm.weight": (H,), "decoder.final_layernorm.bias": (H,),
                "output_layer.weight": (self.vocab, H)}


def _times(factor: int, size: Optional[int]) -> Optional[int]:
    return None if size is None else factor * size


def _dim(tensor: torch.Tensor, dims: int, axis: int) -> Optional[int]:
    """`tensor.shape[axis]` when the tensor has `dims` dimensions (else None: the tensor's own
    shape check refuses it)."""
    return int(tensor.shape[axis]) if tensor.dim() == dims else None


class DeepSpeedSource:
    """A Megatron-DeepSpeed MoE checkpoint, one layer at a time (see the module docstring).

    Every tensor is checked against `DeclaredModel` (`expected_tensors`): the model file's when
    it is opened, each expert file's when its layer is read; `glu`: the experts' activation is
    SwiGLU (the importer's `--activation`)."""

    format = "deepspeed"

    def __init__(self, path: Path, glu: bool = False):
        self.directory = resolve_tag_dir(path)
        if any(p.name.startswith("mp_rank_01") for p in self.directory.iterdir()):
            raise CheckpointError(f"{self.directory} is tensor-parallel (mp_rank_01_*); only "
                                  "tensor-parallel size 1 DeepSpeed checkpoints convert")
        where = str(self.directory / MODEL_FILE)
        state = load_torch_file(self.directory / MODEL_FILE)
        module = state.get("module") if isinstance(state, dict) else None
        if not isinstance(module, dict):
            raise CheckpointError(f"{where} has no 'module' state dict; it is not a DeepSpeed "
                                  "model checkpoint")
        self.args = state.get("args")
        self._layers: dict[int, dict[str, torch.Tensor]] = {}
        self._non_layer: dict[str, torch.Tensor] = {}
        for key, value in module.items():
            tensor = check_tensor(value, str(key), where)
            match = LAYER.match(key)
            if match:
                self._layers.setdefault(int(match.group(1)), {})[match.group(2)] = tensor
            elif key.removeprefix("module.") in NON_LAYER_KEYS:
                self._non_layer[NON_LAYER_KEYS[key.removeprefix("module.")]] = tensor
            else:
                raise CheckpointError(f"{where}: unknown key {key}; only Megatron-DeepSpeed GPT "
                                      "checkpoints convert")
        self.num_layers = max(self._layers, default=-1) + 1
        if sorted(self._layers) != list(range(self.num_layers)) or not self.num_layers:
            raise CheckpointError(f"{self.directory}: layers {sorted(self._layers)} are not "
                                  "0..L-1; the checkpoint is incomplete")
        self.moe_layers = [i for i in range(self.num_layers) if GATE in self._layers[i]]
        if not self.moe_layers:
            raise CheckpointError(f"{self.directory} has no DeepSpeed MoE gate "
                                  f"(*.{GATE}); it is not an MoE checkpoint")
        self._expert_files = self._index_expert_files()
        self.model = self._declared_model(glu)
        self.num_experts = self.model.experts
        self._check_model_file(where)

    # -- the declared model ----------------------------------------------------------------

    def _arg(self, name: str) -> Optional[int]:
        """Megatron-DeepSpeed's saved argument `name` (a positive int), None when absent.
        `--num-experts` is a list (one entry, or one per layer where 1 is a dense layer:
        Megatron-DeepSpeed's ParallelTransformer): its MoE layers must share one count."""
        value = getattr(self.args, name, None)
        where = self.directory / MODEL_FILE
        if name == "num_experts" and isinstance(value, list):
            counts = sorted(set(value) - {1}, key=repr)
            if len(counts) > 1:
                raise CheckpointError(f"{where}: args.num_experts={value!r:.60} gives MoE layers "
                                      "different expert counts; megamoe's model has one count "
                                      "for every MoE layer")
            value = counts[0] if counts else None
        if value is None:
            return None
        if type(value) is not int or value < 1:
            raise CheckpointError(f"{where}: args.{name}={value!r:.40} is not a positive whole "
                                  "number; the checkpoint is corrupt")
        return value

    def _declared_model(self, glu: bool) -> DeclaredModel:
        swiglu = getattr(self.args, "swiglu", None)
        if isinstance(swiglu, bool) and swiglu != glu:
            raise CheckpointError(f"{self.directory / MODEL_FILE}: the checkpoint's args say "
                                  f"swiglu={swiglu}; pass --activation "
                                  f"{'swiglu' if swiglu else 'gelu'}")
        embedding = self._non_layer.get("embedding.word_embeddings.weight")
        if embedding is None:
            raise CheckpointError(f"{self.directory / MODEL_FILE} lacks the word embeddings "
                                  "(language_model.embedding.word_embeddings.weight); the "
                                  "checkpoint is incomplete")
        gate = self._layers[self.moe_layers[0]][GATE]
        dense = [i for i in range(self.num_layers) if i not in self.moe_layers]
        down = self._layers[dense[0]].get("mlp.dense_4h_to_h.weight") if dense else None
        ffn = self._arg("ffn_hidden_size")
        first = None if ffn else \
            self._expert_state(0, self.moe_layers[0], 0)[("dense_4h_to_h", "weight")]
        return DeclaredModel(
            hidden=self._arg("hidden_size") or _dim(embedding, 2, 1),
            vocab=self._arg("padded_vocab_size") or _dim(embedding, 2, 0),
            experts=self._arg("num_experts") or _dim(gate, 2, 0),
            dense_ffn=ffn or (None if down is None else _dim(down, 2, 1)),
            expert_ffn=ffn or (None if first is None else _dim(first, 2, 1)), glu=glu)

    def _check_model_file(self, where: str) -> None:
        """Every tensor of the model file fits the declared model; every layer has an MLP;
        there are expert files for exactly the declared experts of each MoE layer."""
        check_shapes({k: tuple(t.shape) for k, t in self._non_layer.items()},
                     self.model.non_layer_shapes(), where,
                     self.model.describe(), complete=False)
        expected = self.model.layer_shapes()
        for index, raw in self._layers.items():
            unknown = sorted(k for k in raw if k not in expected and not EXPERT_KEY.search(k))
            if unknown:
                raise CheckpointError(f"{where}: layer {index}: unknown key {unknown[0]}; only "
                                      "Megatron-DeepSpeed GPT layers convert")
            if GATE not in raw and not {"mlp.dense_h_to_4h.weight",
                                        "mlp.dense_4h_to_h.weight"} <= set(raw):
                raise CheckpointError(f"{where}: layer {index} has neither an MoE gate nor "
                                      "dense_h_to_4h/dense_4h_to_h weights; the checkpoint is "
                                      "incomplete")
            check_shapes({f"layer {index} {k}": tuple(t.shape) for k, t in raw.items()},
                         {f"layer {index} {k}": v for k, v in expected.items()}, where,
                         self.model.describe(), complete=False)
        extra = sorted(set(self._expert_files) - set(range(len(self.moe_layers))))
        if extra:
            raise CheckpointError(f"{self.directory} holds expert files of MoE layer {extra[0]} "
                                  f"but the model has {len(self.moe_layers)} MoE layers; the "
                                  "checkpoint is corrupt")
        for moe_id, layer in enumerate(self.moe_layers):
            ids = set(self._expert_files.get(moe_id, {}))
            missing = sorted(set(range(self.num_experts)) - ids)
            if missing:
                raise CheckpointError(f"{self.directory}: expert files of MoE layer {moe_id} "
                                      f"(layer {layer}) are missing for experts {missing[:4]} "
                                      f"(layer_{moe_id}_expert_<e>_mp_rank_00_model_states.pt)")
            beyond = sorted(ids - set(range(self.num_experts)))
            if beyond:
                raise CheckpointError(f"{self.directory}: MoE layer {moe_id} (layer {layer}) has "
                                      f"a file for expert {beyond[0]} but the model declares "
                                      f"{self.num_experts} experts; the checkpoint is corrupt")

    # -- reading ---------------------------------------------------------------------------

    def _index_expert_files(self) -> dict[int, dict[int, Path]]:
        """moe_layer_id -> global expert id -> file."""
        files: dict[int, dict[int, Path]] = {}
        for path in self.directory.iterdir():
            match = EXPERT_FILE.fullmatch(path.name)
            if match:
                files.setdefault(int(match.group(1)), {})[int(match.group(2))] = path
        return files

    def _expert_state(self, moe_id: int, layer: int, expert: int
                      ) -> dict[tuple[str, str], torch.Tensor]:
        """(linear, weight|bias) -> tensor of one expert, from its file, each a float tensor of
        its own."""
        path = self._expert_files.get(moe_id, {}).get(expert)
        if path is None:
            raise CheckpointError(f"{self.directory}: expert files of MoE layer {moe_id} (layer "
                                  f"{layer}) are missing for experts [{expert}] "
                                  f"(layer_{moe_id}_expert_<e>_mp_rank_00_model_states.pt)")
        state = load_torch_file(path)
        found = {}
        for key, value in (state.items() if isinstance(state, dict) else ()):
            match = EXPERT_KEY.search(str(key))
            if match and int(match.group(1)) == expert:
                found[(match.group(2), match.group(3))] = check_tensor(value, key, str(path))
        if ("dense_h_to_4h", "weight") not in found or ("dense_4h_to_h", "weight") not in found:
            raise CheckpointError(f"{path} lacks expert {expert}'s dense_h_to_4h/"
                                  "dense_4h_to_h weights; the checkpoint is corrupt")
        return found

    def _expert_weights(self, index: int) -> list[dict[tuple[str, str], torch.Tensor]]:
        """Each expert's tensors of MoE layer `index`, checked against the declared model."""
        moe_id, experts = self.moe_layers.index(index), []
        expected = self.model.expert_shapes()
        for expert in range(self.num_experts):
            found = self._expert_state(moe_id, index, expert)
            name = f"layer {index} expert {expert} "
            check_shapes({name + ".".join(k): tuple(t.shape) for k, t in found.items()},
                         {name + ".".join(k): v for k, v in expected.items()},
                         str(self._expert_files[moe_id][expert]), self.model.describe(),
                         complete=False)
            for (linear, kind), tensor in found.items():
                if kind == "bias":
                    _require_zero(tensor, f"expert {expert} {linear}.bias of layer {index}")
            experts.append(found)
        return experts

    def layer(self, index: int) -> DeepSpeedLayer:
        raw = self._layers[index]
        tensors = {}
        for key, tensor in raw.items():
            if key in ZERO_ONLY:
                _require_zero(tensor, f"layer {index} {key}")
            elif key in LAYER_KEYS:
                tensors[LAYER_KEYS[key]] = tensor
        if index in self.moe_layers:
            experts = self._expert_weights(index)
            tensors[f"mlp.{FC1}"] = torch.stack([e[("dense_h_to_4h", "weight")] for e in experts])
            tensors[f"mlp.{FC2}"] = torch.stack([e[("dense_4h_to_h", "weight")] for e in experts])
        return DeepSpeedLayer(tensors)

    def deepspeed_state(self, index: int) -> dict[str, torch.Tensor]:
        """MoE layer `index` as DeepSpeed's own `MoE` module names it (keys after `mlp.`): the
        checked gate and expert weights (the biases are zero, and DeepSpeed's expert MLP here
        has none), for loading into `deepspeed_moe_layer`."""
        state = {"deepspeed_moe.gate.wg.weight": self._layers[index][GATE]}
        for expert, found in enumerate(self._expert_weights(index)):
            for linear in ("dense_h_to_4h", "dense_4h_to_h"):
                state[f"deepspeed_moe.experts.deepspeed_experts.{expert}.{linear}.weight"] = \
                    found[(linear, "weight")]
        return state

    def non_layer_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self._non_layer.items()

    def non_layer_objects(self) -> list[ObjectItem]:
        return []

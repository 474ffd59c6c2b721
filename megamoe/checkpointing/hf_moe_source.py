"""A Hugging Face MoE model (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3 safetensors) read one
layer at a time as the chunks of a megamoe torch_dist checkpoint, in Megatron-Core's keys.

Mapping of layer l (HF `model.layers.{l}.` -> Megatron `decoder.layers.{l}.`), beyond the
grouped-query attention and dense MLP of `megamoe.checkpointing.hf_source`:
- router: Mixtral `block_sparse_moe.gate.weight`, the others `mlp.gate.weight` ->
  `mlp.router.weight`; DeepSeek-V3 `mlp.gate.e_score_correction_bias` -> `mlp.router.expert_bias`
  (fp32, megamoe's loss-free balancing bias)
- routed expert e: Mixtral `block_sparse_moe.experts.{e}.w1|w3|w2`, the others
  `mlp.experts.{e}.gate_proj|up_proj|down_proj` -> `mlp.experts.experts.linear_fc1` [gate; up]
  and `linear_fc2` at global expert id e, read from the files only when written
- shared expert: Qwen2-MoE `mlp.shared_expert.*` and `mlp.shared_expert_gate.weight`, DeepSeek-V3
  `mlp.shared_experts.*` -> `mlp.shared_experts.linear_fc1|fc2.weight`, `.gate_weight`
- multi-head latent attention (DeepSeek-V3): `self_attn.q_a_proj` -> `self_attention.
  linear_q_down_proj`, `q_a_layernorm` -> `q_layernorm`, `q_b_proj` -> `linear_q_up_proj` (or
  `q_proj` -> `linear_q_proj` without a q rank), `kv_a_proj_with_mqa` -> `linear_kv_down_proj`,
  `kv_a_layernorm` -> `kv_layernorm`, `kv_b_proj` -> `linear_kv_up_proj`, `o_proj` ->
  `linear_proj`; the layer norms `input_layernorm` and `pre_mlp_layernorm`. A source without
  `rope_interleave` has its RoPE rows permuted into DeepSeek's interleaved pairs, the order
  Megatron's MLA rotates.
The files must hold exactly the tensors config.json implies, in its shapes: a bias, an unknown
tensor or a missing one is refused in one line. Layers beyond `num_hidden_layers` are DeepSeek's
multi-token-prediction layers, refused unless dropped explicitly (and then logged).
Memory: one layer's non-expert tensors, plus one expert while it is written; outside the layers,
one tensor at a time.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from megamoe.checkpointing.expected_tensors import check_shapes
from megamoe.checkpointing.hf_moe_arch import HFMoEModel, read_hf_moe_model
from megamoe.checkpointing.hf_source import (HF_LAYER, LINEAR_EXTRA_STATE, NON_LAYER,
                                             POST_ATTENTION_NORM, attention_tensors, glu_fc1,
                                             none_bytes, tensor_shapes)
from megamoe.checkpointing.safetensors_io import SafetensorsReader
from megamoe.checkpointing.sharded_keys import KeyLayout, ObjectItem, TensorChunk
from megamoe.errors import CheckpointError

MLA_NAMES = {"self_attn.q_a_proj.weight": "self_attention.linear_q_down_proj.weight",
             "self_attn.q_a_layernorm.weight": "self_attention.q_layernorm.weight",
             "self_attn.q_b_proj.weight": "self_attention.linear_q_up_proj.weight",
             "self_attn.q_proj.weight": "self_attention.linear_q_proj.weight",
             "self_attn.kv_a_proj_with_mqa.weight": "self_attention.linear_kv_down_proj.weight",
             "self_attn.kv_a_layernorm.weight": "self_attention.kv_layernorm.weight",
             "self_attn.kv_b_proj.weight": "self_attention.linear_kv_up_proj.weight",
             "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
             "input_layernorm.weight": "input_layernorm.weight",
             "post_attention_layernorm.weight": "pre_mlp_layernorm.weight"}
EXPERT_NAMES = {"mixtral": ("w1", "w3", "w2")}
"""Per architecture: an expert's (gate, up, down) module names (default gate/up/down_proj)."""
MLP_NAMES = ("gate_proj", "up_proj", "down_proj")
SHARED_EXTRA_STATE = ("mlp.shared_experts.linear_fc1._extra_state",
                      "mlp.shared_experts.linear_fc2._extra_state")
EXPERT_EXTRA_STATE = ("linear_fc1._extra_state", "linear_fc2._extra_state")


def rope_rows_interleaved(rows: torch.Tensor) -> torch.Tensor:
    """Rows of a RoPE part in rotate-half order [x_0..x_{d/2-1}, y_0..] reordered into
    interleaved pairs [x_0, y_0, x_1, y_1, ...], the order DeepSeek's RoPE (and Megatron's MLA)
    reads."""
    half = rows.shape[0] // 2
    return torch.stack([rows[:half], rows[half:]], dim=1).reshape(rows.shape)


class HFMoESource:
    """A Hugging Face MoE model, layer by layer (see the module docstring)."""

    format = "hf_safetensors"

    def __init__(self, directory: Path, drop_mtp: bool = False):
        self.directory = directory
        self.model: HFMoEModel = read_hf_moe_model(directory)
        self.arch, self.moe = self.model.arch, self.model.moe
        self.reader = SafetensorsReader(directory)
        self.num_layers = self.arch.num_layers
        pattern = self.moe.pattern
        # Megatron-Core stacks the layers' keys only when every layer is alike.
        self.layout = KeyLayout("stacked" if all(pattern) else "per_layer", self.num_layers)
        self.description = (f"Hugging Face {self.arch.model_type} ({self.num_layers} layers, "
                            f"{sum(pattern)} MoE with {self.moe.num_experts} experts, hidden "
                            f"{self.arch.hidden_size}) at {directory}")
        self.moe_prefix = "block_sparse_moe." if self.arch.model_type == "mixtral" else "mlp."
        self.expert_names = EXPERT_NAMES.get(self.arch.model_type, MLP_NAMES)
        self.dropped_mtp = self._check_names(drop_mtp)
        self.dtype = self.reader.read("model.embed_tokens.weight").dtype

    # -- what the files must hold ------------------------------------------------------------

    def _layer_shapes(self, index: int) -> dict[str, tuple[int, ...]]:
        """HF suffix -> shape of every tensor layer `index` must have."""
        a, moe, mla = self.arch, self.moe, self.model.mla
        H, heads = a.hidden_size, a.num_attention_heads
        dense = tensor_shapes(a)
        if mla is None:
            names = ["input_layernorm.weight", "post_attention_layernorm.weight"]
            names += [f"self_attn.{n}_proj.weight" for n in "qkvo"]
            names += [f"self_attn.{n}_proj.bias" for n in "qkv"] if a.qkv_bias else []
            names += [f"self_attn.{n}_norm.weight" for n in "qk"] if a.qk_norm else []
            shapes = {name: dense[name] for name in names}
        else:
            qk = mla.qk_head_dim + mla.qk_pos_emb_head_dim
            shapes = {"input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,),
                      "self_attn.kv_a_proj_with_mqa.weight":
                          (mla.kv_lora_rank + mla.qk_pos_emb_head_dim, H),
                      "self_attn.kv_a_layernorm.weight": (mla.kv_lora_rank,),
                      "self_attn.kv_b_proj.weight":
                          (heads * (mla.qk_head_dim + mla.v_head_dim), mla.kv_lora_rank),
                      "self_attn.o_proj.weight": (H, heads * mla.v_head_dim)}
            if mla.q_lora_rank is None:
                shapes["self_attn.q_proj.weight"] = (heads * qk, H)
            else:
                shapes.update({"self_attn.q_a_proj.weight": (mla.q_lora_rank, H),
                               "self_attn.q_a_layernorm.weight": (mla.q_lora_rank,),
                               "self_attn.q_b_proj.weight": (heads * qk, mla.q_lora_rank)})
        if not moe.pattern[index]:
            shapes.update({f"mlp.{n}.weight": dense[f"mlp.{n}.weight"] for n in MLP_NAMES})
            return shapes
        E, F, p = moe.num_experts, moe.ffn_hidden_size, self.moe_prefix
        shapes[p + "gate.weight"] = (E, H)
        if moe.expert_bias:
            shapes[p + "gate.e_score_correction_bias"] = (E,)
        gate, up, down = self.expert_names
        for e in range(E):
            shapes.update({f"{p}experts.{e}.{gate}.weight": (F, H),
                           f"{p}experts.{e}.{up}.weight": (F, H),
                           f"{p}experts.{e}.{down}.weight": (H, F)})
        if moe.shared_expert_ffn_size:
            S, shared = moe.shared_expert_ffn_size, self._shared_prefix()
            shapes.update({f"{shared}gate_proj.weight": (S, H), f"{shared}up_proj.weight": (S, H),
                           f"{shared}down_proj.weight": (H, S)})
            if moe.shared_expert_gate:
                shapes["mlp.shared_expert_gate.weight"] = (1, H)
        return shapes

    def _shared_prefix(self) -> str:
        return "mlp.shared_expert." if self.arch.model_type == "qwen2_moe" else \
            "mlp.shared_experts."

    def _check_names(self, drop_mtp: bool) -> int:
        """Refuse files that do not hold exactly this model's tensors; the number of
        multi-token-prediction layers dropped."""
        a, names = self.arch, set(self.reader.shapes)
        expected = {"model.embed_tokens.weight": (a.vocab_size, a.hidden_size),
                    "model.norm.weight": (a.hidden_size,)}
        if not a.tie_word_embeddings:
            expected["lm_head.weight"] = (a.vocab_size, a.hidden_size)
        for index in range(self.num_layers):
            prefix = HF_LAYER.format(index)
            expected.update({prefix + s: shape for s, shape in self._layer_shapes(index).items()})
        mtp = {name for name in names - set(expected) if _layer_index(name) >= self.num_layers}
        mtp_layers = sorted({_layer_index(name) for name in mtp})
        if mtp and not drop_mtp:
            raise CheckpointError(
                f"{self.directory} holds {len(mtp_layers)} layer(s) beyond num_hidden_layers="
                f"{self.num_layers} (model.layers.{mtp_layers[0]}.*: multi-token prediction, "
                "which megamoe does not train); pass --drop-mtp to import the model without them")
        check_shapes({name: shape for name, shape in self.reader.shapes.items()
                      if name not in mtp}, expected, str(self.directory), "config.json")
        return len(mtp_layers)

    # -- reading -----------------------------------------------------------------------------

    def _reader(self, index: int) -> Callable[[str], torch.Tensor]:
        prefix = HF_LAYER.format(index)
        return lambda suffix: self.reader.read(prefix + suffix).to(self.dtype)

    def _mla_tensors(self, read: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
        mla, heads = self.model.mla, self.arch.num_attention_heads
        present = self._layer_shapes(0)
        tensors = {mg: read(hf) for hf, mg in MLA_NAMES.items() if hf in present}
        if not mla.rope_interleave:
            rope = mla.qk_pos_emb_head_dim
            q_key = ("self_attention.linear_q_proj.weight" if mla.q_lora_rank is None
                     else "self_attention.linear_q_up_proj.weight")
            q = tensors[q_key].reshape(heads, mla.qk_head_dim + rope, -1)
            q[:, mla.qk_head_dim:] = torch.stack([rope_rows_interleaved(h[mla.qk_head_dim:])
                                                  for h in q])
            tensors[q_key] = q.reshape(-1, q.shape[-1])
            kv = tensors["self_attention.linear_kv_down_proj.weight"]
            kv[mla.kv_lora_rank:] = rope_rows_interleaved(kv[mla.kv_lora_rank:])
        return tensors

    def _extra_state_keys(self, is_moe: bool) -> list[str]:
        if self.model.mla is None:
            attention = [key for key in LINEAR_EXTRA_STATE if key.startswith("self_attention.")]
        else:
            attention = [f"self_attention.{name}._extra_state" for name in
                         ("linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj",
                          "linear_kv_up_proj", "linear_proj")] if self.model.mla.q_lora_rank \
                else [f"self_attention.{name}._extra_state" for name in
                      ("linear_q_proj", "linear_kv_down_proj", "linear_kv_up_proj", "linear_proj")]
        if not is_moe:
            return attention + ["mlp.linear_fc1._extra_state", "mlp.linear_fc2._extra_state"]
        return attention + (list(SHARED_EXTRA_STATE) if self.moe.shared_expert_ffn_size else [])

    def layer_items(self, index: int) -> tuple[list[TensorChunk], list[ObjectItem]]:
        """Layer `index` as checkpoint chunks (experts read lazily) and extra-state objects."""
        read, layout, is_moe = self._reader(index), self.layout, self.moe.pattern[index]
        if self.model.mla is None:
            shapes = self._layer_shapes(index)
            tensors = attention_tensors(self.arch, read, shapes.__contains__)
            tensors[POST_ATTENTION_NORM] = read("post_attention_layernorm.weight")
        else:
            tensors = self._mla_tensors(read)
        if not is_moe:
            tensors["mlp.linear_fc1.weight"] = glu_fc1(read, "mlp.gate_proj", "mlp.up_proj")
            tensors["mlp.linear_fc2.weight"] = read("mlp.down_proj.weight")
        else:
            tensors.update(self._moe_tensors(read))
        chunks = [chunk for suffix, tensor in tensors.items()
                  for chunk in layout.layer_tensor(suffix, index, tuple(tensor.shape),
                                                   tensor.dtype, lambda t=tensor: t,
                                                   glu_halves=suffix.endswith("fc1.weight"))]
        objects = [layout.layer_object(key, index, none_bytes())
                   for key in self._extra_state_keys(is_moe)]
        if is_moe:
            chunks += self._expert_chunks(index, read)
            objects += [layout.expert_object(name, index, e, self.moe.num_experts, none_bytes())
                        for e in range(self.moe.num_experts) for name in EXPERT_EXTRA_STATE]
        return chunks, objects

    def _moe_tensors(self, read: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
        moe, p = self.moe, self.moe_prefix
        tensors = {"mlp.router.weight": read(p + "gate.weight")}
        if moe.expert_bias:
            tensors["mlp.router.expert_bias"] = read(p + "gate.e_score_correction_bias").float()
        if moe.shared_expert_ffn_size:
            shared = self._shared_prefix()
            tensors["mlp.shared_experts.linear_fc1.weight"] = glu_fc1(
                read, shared + "gate_proj", shared + "up_proj")
            tensors["mlp.shared_experts.linear_fc2.weight"] = read(shared + "down_proj.weight")
            if moe.shared_expert_gate:
                tensors["mlp.shared_experts.gate_weight"] = read("mlp.shared_expert_gate.weight")
        return tensors

    def _expert_chunks(self, index: int, read: Callable[[str], torch.Tensor]
                       ) -> list[TensorChunk]:
        E, F, H = self.moe.num_experts, self.moe.ffn_hidden_size, self.arch.hidden_size
        gate, up, down = self.expert_names
        chunks = []
        for e in range(E):
            prefix = f"{self.moe_prefix}experts.{e}."
            chunks += self.layout.expert_tensor(
                "linear_fc1.weight", index, e, E, (2 * F, H), self.dtype,
                lambda prefix=prefix: glu_fc1(read, prefix + gate, prefix + up), glu_halves=True)
            chunks += self.layout.expert_tensor(
                "linear_fc2.weight", index, e, E, (H, F), self.dtype,
                lambda prefix=prefix: read(prefix + down + ".weight"))
        return chunks

    def non_layer_items(self) -> list[TensorChunk]:
        """The embedding, final norm and output layer, each read only when written (written as
        parts of their own, the two vocabulary-sized matrices are then never held together)."""
        chunks = []
        for hf, mg in NON_LAYER.items():
            if hf == "lm_head.weight" and self.arch.tie_word_embeddings:
                continue
            shape = self.reader.shapes[hf]
            chunks.append(TensorChunk(mg, shape, (0,) * len(shape), shape, self.dtype,
                                      lambda hf=hf: self.reader.read(hf).to(self.dtype)))
        return chunks


def _layer_index(name: str) -> int:
    """The layer number of a `model.layers.{i}.` tensor name, -1 for any other name."""
    parts = name.split(".")
    if len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
        return int(parts[2])
    return -1

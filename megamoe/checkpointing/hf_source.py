"""A dense Hugging Face checkpoint (Llama, Mistral, Qwen2, Qwen3 safetensors) read as the
upcycler's DenseSource: one layer at a time, in Megatron-Core's key names and layouts.

Mapping (HF `model.layers.{l}.` -> Megatron `decoder.layers.{l}.`; Megatron-Core's GPT layer with
Transformer-Engine-style sharded keys, which its local spec saves as well):
- `input_layernorm.weight` -> `self_attention.linear_qkv.layer_norm_weight`
- `self_attn.{q,k,v}_proj.weight|bias` -> `self_attention.linear_qkv.weight|bias`, rows grouped
  per key/value head: for each group g, its Q heads, then its K head, then its V head (the
  layout `SelfAttention.get_query_key_value_tensors` splits).
- `self_attn.o_proj.weight` -> `self_attention.linear_proj.weight`
- `self_attn.{q,k}_norm.weight` (Qwen3) -> `self_attention.{q,k}_layernorm.weight`
- `post_attention_layernorm.weight` -> `mlp.linear_fc1.layer_norm_weight`
- `mlp.{gate,up}_proj.weight` -> `mlp.linear_fc1.weight` = [gate; up] (Megatron's SwiGLU halves)
- `mlp.down_proj.weight` -> `mlp.linear_fc2.weight`
- `model.embed_tokens.weight`, `model.norm.weight`, `lm_head.weight` ->
  `embedding.word_embeddings.weight`, `decoder.final_layernorm.weight`, `output_layer.weight`
  (absent when the embeddings are tied).
RoPE needs no permutation: HF's Llama-family checkpoints already use the rotate-half convention
that Megatron-Core's non-interleaved RoPE applies.
"""
from __future__ import annotations

import io
from pathlib import Path
from typing import Callable, Iterator

import torch

from megamoe.checkpointing.expected_tensors import check_shapes
from megamoe.checkpointing.hf_arch import HFArch, read_config_json, read_hf_arch
from megamoe.checkpointing.safetensors_io import SafetensorsReader
from megamoe.checkpointing.sharded_keys import ObjectItem
from megamoe.checkpointing.source import DenseLayer
from megamoe.errors import CheckpointError

HF_LAYER = "model.layers.{}."
NON_LAYER = {"model.embed_tokens.weight": "embedding.word_embeddings.weight",
             "model.norm.weight": "decoder.final_layernorm.weight",
             "lm_head.weight": "output_layer.weight"}
ATTENTION = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
             "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
             "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
             "self_attn.k_norm.weight": "self_attention.k_layernorm.weight"}
POST_ATTENTION_NORM = "mlp.linear_fc1.layer_norm_weight"
"""Where Megatron's local and Transformer Engine GPT specs keep the pre-MLP norm."""
# Megatron's linear layers save an `_extra_state` object (None without Transformer Engine) that
# its loader asks for; written as such, so Megatron-Core and Megatron-LM load the output.
LINEAR_EXTRA_STATE = ("self_attention.linear_qkv._extra_state",
                      "self_attention.linear_proj._extra_state", "mlp.linear_fc1._extra_state",
                      "mlp.linear_fc2._extra_state")
UNSUPPORTED = ("mlp.gate_proj.bias", "mlp.up_proj.bias", "mlp.down_proj.bias",
               "self_attn.o_proj.bias")


def interleave_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """Megatron's fused QKV rows [groups x (Q heads of g, K of g, V of g)] from HF's q, k, v
    (weights [rows, H] or biases [rows])."""
    tail = q.shape[1:]
    q_g, k_g, v_g = (t.reshape(groups, -1, *tail) for t in (q, k, v))
    return torch.cat([q_g, k_g, v_g], dim=1).reshape(-1, *tail)


def split_qkv(qkv: torch.Tensor, arch: HFArch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of `interleave_qkv`: HF's q, k, v from Megatron's fused rows."""
    groups, d = arch.num_key_value_heads, arch.head_dim
    per_group = arch.num_attention_heads // groups * d
    tail = qkv.shape[1:]
    grouped = qkv.reshape(groups, per_group + 2 * d, *tail)
    q, k, v = grouped.split([per_group, d, d], dim=1)
    return tuple(t.reshape(-1, *tail).contiguous() for t in (q, k, v))


def attention_tensors(arch: HFArch, read: Callable[[str], torch.Tensor],
                      present: Callable[[str], bool]) -> dict[str, torch.Tensor]:
    """A layer's grouped-query attention (and its input norm) in Megatron's keys, from the HF
    tensors `read(suffix)` gives (see the module docstring)."""
    tensors = {mg: read(hf) for hf, mg in ATTENTION.items() if present(hf)}
    groups = arch.num_key_value_heads
    tensors["self_attention.linear_qkv.weight"] = interleave_qkv(
        read("self_attn.q_proj.weight"), read("self_attn.k_proj.weight"),
        read("self_attn.v_proj.weight"), groups)
    if arch.qkv_bias:
        tensors["self_attention.linear_qkv.bias"] = interleave_qkv(
            read("self_attn.q_proj.bias"), read("self_attn.k_proj.bias"),
            read("self_attn.v_proj.bias"), groups)
    return tensors


def glu_fc1(read: Callable[[str], torch.Tensor], gate: str, up: str) -> torch.Tensor:
    """Megatron's SwiGLU fc1 [gate; up] from HF's `<gate>.weight` and `<up>.weight`."""
    return torch.cat([read(gate + ".weight"), read(up + ".weight")])


def none_bytes() -> bytes:
    """`None` serialized as Megatron's torch_dist strategy stores a sharded object (a list of
    the shards' data, `strategies/torch.py` `_mcore_to_torch_sharded_object`)."""
    buffer = io.BytesIO()
    torch.save([None], buffer)
    return buffer.getvalue()


def tensor_shapes(a: HFArch) -> dict[str, tuple[int, ...]]:
    """The shape config.json implies for each dense-model tensor (per-layer ones by their
    suffix)."""
    q, kv = a.num_attention_heads * a.head_dim, a.num_key_value_heads * a.head_dim
    return {"model.embed_tokens.weight": (a.vocab_size, a.hidden_size),
            "lm_head.weight": (a.vocab_size, a.hidden_size),
            "model.norm.weight": (a.hidden_size,),
            "input_layernorm.weight": (a.hidden_size,),
            "post_attention_layernorm.weight": (a.hidden_size,),
            "self_attn.q_proj.weight": (q, a.hidden_size),
            "self_attn.k_proj.weight": (kv, a.hidden_size),
            "self_attn.v_proj.weight": (kv, a.hidden_size),
            "self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,),
            "self_attn.v_proj.bias": (kv,),
            "self_attn.o_proj.weight": (a.hidden_size, q),
            "self_attn.q_norm.weight": (a.head_dim,), "self_attn.k_norm.weight": (a.head_dim,),
            "mlp.gate_proj.weight": (a.intermediate_size, a.hidden_size),
            "mlp.up_proj.weight": (a.intermediate_size, a.hidden_size),
            "mlp.down_proj.weight": (a.hidden_size, a.intermediate_size)}


def is_hf_directory(path: Path) -> bool:
    """A Hugging Face model directory (config.json next to the weights)."""
    return path.is_dir() and (path / "config.json").is_file()


class HFSource:
    """A dense Hugging Face safetensors model read layer by layer (see the module docstring)."""

    format = "hf_safetensors"
    args = None
    key_layout = "hf"

    def __init__(self, directory: Path):
        self.directory = directory
        self.arch = read_hf_arch(directory)
        self.hf_config = read_config_json(directory)
        self.reader = SafetensorsReader(directory)
        self.num_layers = self.arch.num_layers
        self.description = (f"Hugging Face {self.arch.model_type} ({self.num_layers} layers, "
                            f"hidden {self.arch.hidden_size}) at {directory}")
        self.model_settings = self.arch.model_settings()
        self._check_names()

    def _check_names(self) -> None:
        names = self.reader.names()
        extra = sorted(n for n in names if n.startswith("model.layers.") and
                       int(n.split(".")[2]) >= self.num_layers)
        if extra:
            raise CheckpointError(f"{self.directory}: tensor {extra[0]} is beyond num_hidden_"
                                  f"layers={self.num_layers}; config.json and the weights differ")
        bad = sorted(n for n in names if n.split(".", 3)[-1] in UNSUPPORTED)
        if bad:
            raise CheckpointError(f"{self.directory}: {bad[0]} (MLP/output-projection biases) "
                                  "is not supported by megamoe's layers")
        if not self.arch.tie_word_embeddings and "lm_head.weight" not in self.reader:
            raise CheckpointError(f"{self.directory} lacks lm_head.weight but config.json says "
                                  "tie_word_embeddings=false; the checkpoint is incomplete")
        shapes = tensor_shapes(self.arch)
        expected = {name: shapes[key] for name in names if (key := name.split(".", 3)[-1] if
                    name.startswith("model.layers.") else name) in shapes}
        check_shapes(self.reader.shapes, expected, str(self.directory), "config.json",
                     complete=False)

    def layer(self, index: int) -> DenseLayer:
        prefix = HF_LAYER.format(index)

        def read(suffix: str) -> torch.Tensor:
            return self.reader.read(prefix + suffix)

        tensors = attention_tensors(self.arch, read, lambda suffix: prefix + suffix in self.reader)
        tensors[POST_ATTENTION_NORM] = read("post_attention_layernorm.weight")
        tensors["mlp.linear_fc1.weight"] = glu_fc1(read, "mlp.gate_proj", "mlp.up_proj")
        tensors["mlp.linear_fc2.weight"] = read("mlp.down_proj.weight")
        return DenseLayer(tensors, {key: none_bytes() for key in LINEAR_EXTRA_STATE})

    def non_layer_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for hf, mg in NON_LAYER.items():
            if hf == "lm_head.weight" and self.arch.tie_word_embeddings:
                continue
            yield mg, self.reader.read(hf)

    def non_layer_objects(self) -> list[ObjectItem]:
        return []

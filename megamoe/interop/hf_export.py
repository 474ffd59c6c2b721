"""Export a megamoe MoE checkpoint as a Hugging Face Mixtral, Qwen2-MoE, Qwen3-MoE or DeepSeek-V3
model.

Input: a torch_dist checkpoint written by megamoe (a training checkpoint, whose common state
holds the run's `config`, or tools/upcycle_ckpt.py's output from a Hugging Face model, whose
common state holds `megamoe_model`). The architecture is taken from those `model`/`moe`
sections; what the target architecture cannot express is refused in one line before anything
is written (`check_expressible`). config.json and generation_config.json are the source model's
own, changed only where training changed them, when the checkpoint keeps them, else generated
(megamoe.interop.hf_config); the tokenizer is the one the checkpoint records
(megamoe.interop.export_tokenizer). Tensors are read one layer at a time through DCP
(megamoe.checkpointing.dist_source, any key layout) and written into size-bounded safetensors
shards (megamoe.checkpointing.safetensors_io), so memory holds one layer plus one shard.

Key mapping, layer l (`model.layers.{l}.`), Megatron -> Hugging Face (hub layout, per expert):
- `self_attention.linear_qkv.layer_norm_weight` -> `input_layernorm.weight`
- `self_attention.linear_qkv.weight|bias` -> `self_attn.{q,k,v}_proj.weight|bias`
  (megamoe.checkpointing.hf_source.split_qkv); Qwen2-MoE always has QKV biases (zeros when absent)
- `self_attention.linear_proj.weight` -> `self_attn.o_proj.weight`
- `self_attention.{q,k}_layernorm.weight` -> `self_attn.{q,k}_norm.weight` (Qwen3-MoE)
- `mlp.linear_fc1.layer_norm_weight` (or `pre_mlp_layernorm.weight`) -> `post_attention_layernorm`
- `mlp.router.weight` -> Mixtral `block_sparse_moe.gate.weight`, Qwen `mlp.gate.weight`
- expert e's `linear_fc1` [gate; up] and `linear_fc2` -> Mixtral `block_sparse_moe.experts.{e}.
  w1|w3|w2`, Qwen `mlp.experts.{e}.gate_proj|up_proj|down_proj`
- `mlp.shared_experts.linear_fc1|fc2|gate_weight` -> Qwen2-MoE `mlp.shared_expert.*`,
  `mlp.shared_expert_gate.weight`
- dense layers (`mlp.linear_fc1|fc2`) -> `mlp.gate_proj|up_proj|down_proj` (`mlp_only_layers`)
- DeepSeek-V3: multi-head latent attention and its norms as `megamoe.checkpointing.
  hf_moe_source.MLA_NAMES` lists them (DeepSeek's interleaved RoPE pairs, `rope_interleave`),
  `mlp.router.expert_bias` -> `mlp.gate.e_score_correction_bias`, `mlp.shared_experts.*` ->
  `mlp.shared_experts.*` (`n_shared_experts` = shared size / expert size), the leading dense
  layers -> `first_k_dense_replace`
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch

from megamoe.atomic import atomic_directory
from megamoe.checkpointing.hf_arch import HFArch, read_config_json
from megamoe.checkpointing.hf_moe_arch import DEEPSEEK_GROUP_SCORE_TOPK
from megamoe.checkpointing.hf_moe_source import MLA_NAMES
from megamoe.checkpointing.hf_source import split_qkv
from megamoe.checkpointing.safetensors_io import ShardedSafetensorsWriter
from megamoe.config import moe_layer_pattern
from megamoe.errors import CheckpointError, ConfigError
from megamoe.interop.export_tokenizer import recorded_tokenizer, token_ids
from megamoe.interop.hf_config import ARCHITECTURES, exported_configs
from megamoe.paths import refuse_overlap
from megamoe.train.tokenizer import write_tokenizer_files
from megamoe.upcycle.hf_files import kept_source
from megamoe.upcycle.hf_logits import require_within

ARCHS = tuple(ARCHITECTURES)
EXPERTS = "mlp.experts.experts."
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


def default_arch(config) -> str:
    """The architecture that expresses this model: DeepSeek-V3 with latent attention, Qwen3-MoE
    with QK norm, Qwen2-MoE with a shared expert, else Mixtral."""
    if config.model.multi_latent_attention:
        return "deepseek_v3"
    if config.model.qk_layernorm:
        return "qwen3_moe"
    if config.moe_config().shared_expert.ffn_hidden_size:
        return "qwen2_moe"
    return "mixtral"


def check_expressible(arch: str, config, pattern: list[bool]) -> None:
    """Raise a one-line ConfigError for the first setting `arch` cannot express."""
    m, moe = config.model, config.moe_config()

    def refuse(what: str, fix: str) -> None:
        raise ConfigError(f"--arch {arch} cannot express {what}; {fix}")

    if arch not in ARCHS:
        raise ConfigError(f"--arch {arch!r} is not one of {list(ARCHS)}")
    if config.moe.layer_overrides:
        refuse("per-layer MoE overrides (moe.layer_overrides)", "export a uniform MoE model")
    if moe.router.kind != "topk":
        refuse(f"router.kind={moe.router.kind!r} (only top-k)", "train with moe.router.kind=topk")
    if moe.dispatcher.capacity_factor is not None:
        refuse(f"dispatcher.capacity_factor={moe.dispatcher.capacity_factor} (token dropping; "
               "Hugging Face MoE blocks are dropless)",
               "train dropless (moe.dispatcher.capacity_factor=null)")
    if moe.experts.activation != "swiglu" or not m.swiglu:
        refuse(f"activation {moe.experts.activation!r} (only SwiGLU)", "train with SwiGLU")
    if m.normalization != "RMSNorm" or m.position_embedding != "rope":
        refuse(f"normalization={m.normalization} / position_embedding={m.position_embedding} "
               "(only RMSNorm and RoPE)", "train a Llama-shaped model")
    if arch == "deepseek_v3":
        _check_deepseek_v3(refuse, config, pattern)
    else:
        _check_softmax_family(arch, refuse, config, pattern)


def _check_deepseek_v3(refuse: Callable[[str, str], None], config, pattern: list[bool]) -> None:
    m, moe = config.model, config.moe_config()
    if not m.multi_latent_attention:
        refuse("grouped-query attention (DeepSeek-V3 has multi-head latent attention)",
               "use mixtral, qwen2_moe or qwen3_moe")
    router = moe.router
    if router.score_function != "sigmoid" or moe.topk < 2:
        refuse(f"router.score_function={router.score_function!r} with topk={moe.topk} "
               "(DeepSeek-V3 renormalises top-k sigmoid gates, k >= 2)",
               "use mixtral, qwen2_moe or qwen3_moe")
    scoring = router.num_groups and router.experts_scoring_a_group(moe.topk)
    if scoring and scoring != DEEPSEEK_GROUP_SCORE_TOPK:
        refuse(f"groups scored by their top {scoring} experts "
               f"(DeepSeek-V3 scores by the top {DEEPSEEK_GROUP_SCORE_TOPK})",
               f"train with moe.router.group_score_topk={DEEPSEEK_GROUP_SCORE_TOPK}")
    shared = moe.shared_expert.ffn_hidden_size or 0
    if moe.shared_expert.gate or shared % moe.ffn_hidden_size:
        refuse(f"a shared expert of size {shared} (gate {moe.shared_expert.gate}; DeepSeek-V3 "
               "has ungated shared experts of whole expert sizes)",
               "train with moe.shared_expert.gate=false and a multiple of moe.ffn_hidden_size")
    first_moe = pattern.index(True)
    if not all(pattern[first_moe:]):
        refuse("dense layers after the first MoE layer (DeepSeek-V3 has only leading dense "
               "layers)", "use qwen2_moe or qwen3_moe (mlp_only_layers)")


def _check_softmax_family(arch: str, refuse: Callable[[str, str], None], config,
                          pattern: list[bool]) -> None:
    m, moe = config.model, config.moe_config()
    if m.multi_latent_attention:
        refuse("multi-head latent attention", "use deepseek_v3")
    router = moe.router
    if router.score_function != "softmax":
        refuse(f"router.score_function={router.score_function!r} routing (only softmax)",
               "train with moe.router.score_function=softmax, or use deepseek_v3")
    if router.num_groups or router.groups_per_token:
        refuse("group-limited routing (moe.router.num_groups)", "train without group limits, "
               "or use deepseek_v3")
    if router.topk_scaling_factor not in (None, 1.0):
        refuse(f"router.topk_scaling_factor={router.topk_scaling_factor}", "train without it, "
               "or use deepseek_v3")
    if arch == "mixtral":
        if router.pre_softmax and moe.topk > 1:
            refuse("gates without renormalisation (moe.router.pre_softmax=true)", "use qwen2_moe "
                   "or qwen3_moe (norm_topk_prob=false)")
        if not all(pattern):
            refuse("dense layers between MoE layers (Mixtral has none)",
                   "use qwen2_moe or qwen3_moe (mlp_only_layers)")
        if m.add_qkv_bias:
            refuse("QKV biases", "use qwen2_moe")
    shared = moe.shared_expert.ffn_hidden_size
    if arch in ("mixtral", "qwen3_moe") and shared:
        refuse("a shared expert", "use qwen2_moe (shared expert with gate)")
    if arch == "qwen2_moe" and not (shared and moe.shared_expert.gate):
        refuse("an MoE layer without a gated shared expert (Qwen2-MoE always has one)",
               "use mixtral or qwen3_moe")
    if (arch == "qwen3_moe") != m.qk_layernorm:
        refuse(f"qk_layernorm={m.qk_layernorm} (Qwen3-MoE always normalises Q and K, the "
               "others never)", "use qwen3_moe exactly for models with model.qk_layernorm")


class _LayerMapper:
    """Hugging Face tensors of one Megatron layer (see the module docstring)."""

    def __init__(self, arch: str, config):
        m = config.model
        self.arch = arch
        self.attn = HFArch(
            model_type=arch, num_layers=m.num_layers, hidden_size=m.hidden_size,
            num_attention_heads=m.num_attention_heads,
            num_key_value_heads=m.num_query_groups or m.num_attention_heads,
            head_dim=m.kv_channels or m.hidden_size // m.num_attention_heads,
            intermediate_size=m.ffn_hidden_size, vocab_size=0, rope_theta=m.rotary_base,
            rope_scaling_factor=m.rope_scaling_factor, rms_norm_eps=m.norm_epsilon,
            tie_word_embeddings=m.share_embeddings, qkv_bias=m.add_qkv_bias,
            qk_norm=m.qk_layernorm, max_position_embeddings=m.seq_length)
        self.moe_prefix = "block_sparse_moe." if arch == "mixtral" else "mlp."
        self.expert_names = (("w1", "w3", "w2") if arch == "mixtral"
                             else ("gate_proj", "up_proj", "down_proj"))

    def tensors(self, index: int, mg: dict[str, torch.Tensor], is_moe: bool
                ) -> Iterator[tuple[str, torch.Tensor]]:
        p = f"model.layers.{index}."
        if self.arch == "deepseek_v3":
            yield from ((p + hf, mg[key]) for hf, key in MLA_NAMES.items() if key in mg)
        else:
            yield from self._attention(p, mg)
        if not is_moe:
            yield from self._mlp(p + "mlp.", ("gate_proj", "up_proj", "down_proj"),
                                 mg["mlp.linear_fc1.weight"], mg["mlp.linear_fc2.weight"])
            return
        yield from self._moe(index, p, mg)

    def _attention(self, p: str, mg: dict[str, torch.Tensor]
                   ) -> Iterator[tuple[str, torch.Tensor]]:
        yield p + "input_layernorm.weight", mg["self_attention.linear_qkv.layer_norm_weight"]
        norm = mg.get("mlp.linear_fc1.layer_norm_weight", mg.get("pre_mlp_layernorm.weight"))
        yield p + "post_attention_layernorm.weight", norm
        q, k, v = split_qkv(mg["self_attention.linear_qkv.weight"], self.attn)
        yield from ((p + f"self_attn.{n}_proj.weight", t) for n, t in zip("qkv", (q, k, v)))
        if "self_attention.linear_qkv.bias" in mg or self.arch == "qwen2_moe":
            bias = mg.get("self_attention.linear_qkv.bias")
            if bias is None:
                bias = torch.zeros(mg["self_attention.linear_qkv.weight"].shape[0],
                                   dtype=q.dtype)
            qb, kb, vb = split_qkv(bias, self.attn)
            yield from ((p + f"self_attn.{n}_proj.bias", t) for n, t in zip("qkv", (qb, kb, vb)))
        yield p + "self_attn.o_proj.weight", mg["self_attention.linear_proj.weight"]
        for side in "qk":
            if f"self_attention.{side}_layernorm.weight" in mg:
                yield p + f"self_attn.{side}_norm.weight", \
                    mg[f"self_attention.{side}_layernorm.weight"]

    def _moe(self, index: int, p: str, mg: dict[str, torch.Tensor]
             ) -> Iterator[tuple[str, torch.Tensor]]:
        router, bias = mg["mlp.router.weight"], mg.get("mlp.router.expert_bias")
        if self.arch == "deepseek_v3":
            yield p + "mlp.gate.e_score_correction_bias", (
                torch.zeros(router.shape[0], dtype=torch.float32) if bias is None else bias)
        elif bias is not None and bool(bias.abs().max() > 0):
            raise ConfigError(f"--arch {self.arch} cannot express the expert bias of layer "
                              f"{index} (loss-free balancing steers selection; max |bias| "
                              f"{float(bias.abs().max()):.3g}); train without 'bias' in "
                              "moe.balancing.methods, or use deepseek_v3")
        yield p + self.moe_prefix + "gate.weight", router
        for e, (fc1, fc2) in enumerate(_experts(mg, index)):
            yield from self._mlp(f"{p}{self.moe_prefix}experts.{e}.", self.expert_names, fc1,
                                 fc2)
        if "mlp.shared_experts.linear_fc1.weight" in mg:
            shared = "mlp.shared_experts." if self.arch == "deepseek_v3" else "mlp.shared_expert."
            yield from self._mlp(p + shared, ("gate_proj", "up_proj", "down_proj"),
                                 mg["mlp.shared_experts.linear_fc1.weight"],
                                 mg["mlp.shared_experts.linear_fc2.weight"])
        if "mlp.shared_experts.gate_weight" in mg:
            yield p + "mlp.shared_expert_gate.weight", \
                mg["mlp.shared_experts.gate_weight"].reshape(1, -1)

    @staticmethod
    def _mlp(prefix: str, names: tuple[str, str, str], fc1: torch.Tensor, fc2: torch.Tensor
             ) -> Iterator[tuple[str, torch.Tensor]]:
        gate, up = fc1.chunk(2)
        yield prefix + f"{names[0]}.weight", gate.contiguous()
        yield prefix + f"{names[1]}.weight", up.contiguous()
        yield prefix + f"{names[2]}.weight", fc2


def _experts(mg: dict[str, torch.Tensor], index: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(fc1, fc2) per global expert, from stacked [E, ...] or singleton per-expert keys."""
    if EXPERTS + "linear_fc1.weight" in mg:
        return list(zip(mg[EXPERTS + "linear_fc1.weight"], mg[EXPERTS + "linear_fc2.weight"]))
    count = sum(1 for key in mg if key.startswith(EXPERTS) and key.endswith("linear_fc2.weight"))
    if not count:
        raise CheckpointError(f"layer {index} has a router but no expert weights; the "
                              "checkpoint is incomplete")
    return [(mg[f"{EXPERTS}{e}.linear_fc1.weight"], mg[f"{EXPERTS}{e}.linear_fc2.weight"])
            for e in range(count)]


def export_hf(load, save, arch: Optional[str] = None, tokenizer=None, overwrite: bool = False,
              verify: bool = False, max_shard_bytes: int = 2 * 2**30,
              log: Callable[[str], None] = print) -> ExportResult:
    """Write the MoE checkpoint at `load` as a Hugging Face model directory `save` (see the
    module docstring). verify: load it with transformers and compare logits with megamoe's
    (max |difference| <= 1e-4 in fp32), and run `generate`."""
    from megamoe.checkpointing.safe_dcp import load_common_state
    from megamoe.train.checkpoint import resolve_weights_dir
    from megamoe.train.config import config_from_dict
    from megamoe.checkpointing.dist_source import DistSource

    refuse_overlap(save, [load, tokenizer])
    folder = resolve_weights_dir(load)
    common = load_common_state(folder)
    sections = _model_sections(common, folder)
    config = config_from_dict(sections)
    pattern = moe_layer_pattern(config.model, config.model.first_k_dense)
    kept = kept_source(folder)
    arch = arch or _source_arch(kept) or default_arch(config)
    check_expressible(arch, config, pattern)
    shipped, record = recorded_tokenizer(folder, common, Path(load), tokenizer)
    source = DistSource(folder, moe=True)
    if source.num_layers != config.model.num_layers:
        raise CheckpointError(f"{folder} has {source.num_layers} layers but its config says "
                              f"{config.model.num_layers}; the checkpoint is corrupt")
    mapper = _LayerMapper(arch, config)
    with atomic_directory(save, overwrite=overwrite, owner="export_hf") as tmp:
        writer = ShardedSafetensorsWriter(tmp, max_shard_bytes)
        vocab_size = dtype = None
        for key, tensor in source.non_layer_tensors():
            name = {"embedding.word_embeddings.weight": "model.embed_tokens.weight",
                    "decoder.final_layernorm.weight": "model.norm.weight",
                    "output_layer.weight": "lm_head.weight"}.get(key)
            if name is None:
                continue
            if name == "model.embed_tokens.weight":
                vocab_size, dtype = tensor.shape[0], str(tensor.dtype).removeprefix("torch.")
            if name != "lm_head.weight" or not config.model.share_embeddings:
                writer.add(name, tensor)
        for index, is_moe in enumerate(pattern):
            writer.add_all(mapper.tensors(index, source.layer(index).tensors, is_moe))
        shards = writer.finish()
        log(f"exported {folder} as {arch}: {len(shards)} shard(s), "
            f"{writer.total_bytes / 2**20:.1f} MiB")
        if shipped is None:
            log(f"warning: {folder} records no tokenizer: the model is written without one "
                "(pass --tokenizer DIR to add it)")
        else:
            names = write_tokenizer_files(shipped, tmp)
            log(f"tokenizer: {shipped.describe()} ({', '.join(names)})")
        configs = exported_configs(arch, config, pattern, vocab_size, dtype, kept,
                                   token_ids(shipped, record))
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

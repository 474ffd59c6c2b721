"""What one micro-batch leaves saved for the backward pass, term by term, for one rank.

Every term is bytes of tensors autograd keeps from a layer's forward until its backward
(Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models", arXiv
2205.05198, sec. 4, counts the dense ones the same way), written for the modules megamoe's
trainer builds (Megatron-Core's local spec with megamoe's MoE layer, `docs/memory_planner.md`
lists each with its formula). Tensor parallelism runs with sequence parallelism, so each rank
keeps T = s*b/tp tokens of every token-wise tensor and a/tp heads of the full sequence.

Categories: `activations` (everything but the MoE layer's routed path) and `moe_dispatch`
(the router's scores, the balance losses' terms, the dispatched rows and the expert MLPs'
intermediates, at the busiest rank of the expert-parallel group: see `routed_rows`).

Shape legend: s sequence, b micro-batch, h hidden, a attention heads, g key-value groups,
d head dimension, F FFN width (F' = 2F when gated), E experts, k top-k, L local experts,
V vocabulary, e bytes per element.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from megamoe.config import MoEConfig
from megamoe.plan.tracker import ACTIVATIONS, MOE
from megamoe.train.config import TrainConfig

INDEX_BYTES = 8  # int64 indices
FP32 = 4


@dataclass(frozen=True)
class Term:
    """Bytes one micro-batch keeps for the backward pass, in one module of one layer."""

    name: str
    bytes: float
    category: str = ACTIVATIONS
    module: str = ""
    """The recompute module that drops it (Megatron-Core's names: `layernorm`, `core_attn`,
    `mla_up_proj`, `mlp`, `moe`); empty: kept under selective recomputation."""
    per_rank: bool = False
    """The same tensor for every layer and micro-batch (the attention mask): counted once."""


@dataclass(frozen=True)
class Shapes:
    """The sizes the terms need, for one rank."""

    s: int
    b: int
    h: int
    tp: int
    ep: int
    e: int
    vocab: int
    fused_attention: bool = False
    """Transformer Engine's fused (flash) attention, as the trainer runs on CUDA: no s^2
    softmax output, its fp32 statistics instead."""

    @property
    def tokens(self) -> int:
        """T: tokens of a micro-batch on this rank (sequence parallel)."""
        return self.s * self.b // self.tp


def routed_rows(cfg: MoEConfig, tokens: int, ep: int, maxvio: float) -> tuple[float, float]:
    """(rows this rank sends, rows the busiest rank of the expert-parallel group receives) per
    MoE layer and micro-batch, each of the group's ranks routing `tokens` tokens.

    Dropless at MaxVio V (max expert load / mean load - 1, arXiv 2408.15664): an expert takes at
    most (1 + V) * m assignments of a rank's tokens, m = T k / E, and at most T (a token picks an
    expert once); the busiest rank's L local experts take at most L (1 + V) m, and at most
    T min(L, k) (a token sends at most min(L, k) of its k rows to one rank), from each of the ep
    ranks. With `dispatcher.capacity_factor` an expert keeps at most ceil(c T k / E) per rank.
    With zero-computation experts k is the real experts per token (their compute budget)."""
    E, k = cfg.num_experts, cfg.real_experts_per_token
    local = E // ep
    mean = tokens * k / E
    hot = min(local * (1 + maxvio) * mean, tokens * min(local, k))
    sent = tokens * k
    capacity_factor = cfg.dispatcher.capacity_factor
    if capacity_factor is not None:
        capacity = max(1, math.ceil(capacity_factor * tokens * k / E))
        hot = min(hot, local * capacity)
        sent = min(sent, E * capacity)
    return float(sent), ep * hot


def _norm(config: TrainConfig, x: Shapes, width: int, name: str) -> list[Term]:
    """A norm over `width` channels: RMSNorm keeps its input, 1/rms and the normalised input,
    and its consumer keeps its output (3 T w + T); LayerNorm its input, mean and 1/std
    (2 T w + 2 T, output as before)."""
    T, e = x.tokens, x.e
    if config.model.normalization == "RMSNorm":
        return [Term(f"{name} input", T * width * e),
                Term(f"{name} statistics, normalised input", T * (width + 1) * e,
                     module="layernorm"),
                Term(f"{name} output", T * width * e, module="layernorm")]
    return [Term(f"{name} input", T * width * e),
            Term(f"{name} statistics", 2 * T * e, module="layernorm"),
            Term(f"{name} output", T * width * e, module="layernorm")]


def _attention(config: TrainConfig, x: Shapes) -> list[Term]:
    """Self-attention with the local (unfused) core: the core keeps query, key and value at a
    heads: the query is new after RoPE, the key after RoPE or grouped-query expansion, the
    value after expansion; the others are views of the query-key-value projection's output,
    which is then kept whole. Then the softmax output b (a/tp) s^2 and the context."""
    m, T, e, s = config.model, x.tokens, x.e, x.s
    a = m.num_attention_heads
    g = m.num_query_groups or a
    d = m.kv_channels or m.hidden_size // a
    rope, grouped = m.position_embedding == "rope", g < a
    new = int(rope) + int(rope or grouped) + int(grouped)
    terms = []
    if new:
        terms.append(Term("query, key, value at a heads (RoPE, expanded)", new * T * a * d * e,
                          module="core_attn"))
    if new < 3:
        terms.append(Term("query-key-value projection output", T * (a + 2 * g) * d * e))
    if rope:
        terms.append(Term("RoPE cos/sin", 4 * s * d * e))
    if m.qk_layernorm:
        terms.append(_qk_norms(config, x, a, g, d))
    terms += _core(config, x, a)
    terms.append(Term("context (projection input)", T * a * d * e))
    return terms


def _qk_norms(config: TrainConfig, x: Shapes, a: int, g: int, d: int) -> Term:
    """The query and key RMSNorms of `model.qk_layernorm` over w = (a + g) d channels: per head
    (Megatron's norm) each keeps, as any RMSNorm, its input, the normalised input with one
    statistic per head, and its output, 3 T w + T (a + g); over the whole projections
    (megamoe's projection norm) its input and its output, 2 T w, and 1/rms per token."""
    T, e, w = x.tokens, x.e, (a + g) * d
    if config.model.qk_layernorm_scope == "head":
        return Term("QK norms per head: input, statistics, normalised input, output",
                    3 * T * w * e + T * (a + g) * FP32)
    return Term("QK norms over the projections: input, statistics, output",
                2 * T * w * e + 2 * T * FP32)


def _core(config: TrainConfig, x: Shapes, heads: int) -> list[Term]:
    """The attention core's own terms: the local core keeps its softmax output (and the
    causal mask, one for all layers); a fused core (FlashAttention, arXiv 2205.14135) keeps
    the softmax's fp32 log-sum-exp per query and head instead."""
    s, b, e, tp = x.s, x.b, x.e, x.tp
    if x.fused_attention:
        return [Term("softmax statistics (fused attention)", b * heads / tp * s * FP32,
                     module="core_attn")]
    terms = [Term("softmax output", b * heads / tp * s * s * e, module="core_attn"),
             Term("attention mask", s * s, per_rank=True)]
    if config.model.attention_dropout > 0:
        terms.append(Term("attention dropout mask and output", b * heads / tp * s * s * (1 + e),
                          module="core_attn"))
    return terms


def _latent_attention(config: TrainConfig, x: Shapes) -> list[Term]:
    """Multi-head latent attention (arXiv 2405.04434): the query and key-value latents and
    their RMSNorms, query and key at a heads of (d_qk + d_rope), values at d_v, the softmax
    output, the context."""
    m, T, e, s = config.model, x.tokens, x.e, x.s
    a, pe = m.num_attention_heads, m.qk_pos_emb_head_dim
    terms = []
    if m.q_lora_rank:
        terms += [Term("query latent", T * m.q_lora_rank * e)]
        terms += _norm(config, x, m.q_lora_rank, "query latent norm")[1:]
    terms += [Term("key-value latent and RoPE key", T * (m.kv_lora_rank + pe) * e)]
    terms += _norm(config, x, m.kv_lora_rank, "key-value latent norm")[1:]
    terms += [Term("RoPE cos/sin", 4 * s * pe * e),
              Term("query and key (a heads)", 2 * T * a * (m.qk_head_dim + pe) * e,
                   module="mla_up_proj"),
              Term("value (a heads)", T * a * m.v_head_dim * e, module="mla_up_proj")]
    terms += _core(config, x, a)
    terms.append(Term("context (projection input)", T * a * m.v_head_dim * e))
    return terms


def _dense_mlp(config: TrainConfig, x: Shapes) -> list[Term]:
    """Megatron's MLP: fc1's output T F' and, gated, three T F tensors (SiLU of the gate half,
    the product, fc2's input); ungated the activation's output (2 T F in all)."""
    T, e, F = x.tokens, x.e, config.model.ffn_hidden_size
    if config.model.swiglu:
        return [Term("MLP fc1 output", 2 * T * F * e, module="mlp"),
                Term("MLP SwiGLU terms, fc2 input", 3 * T * F * e, module="mlp")]
    return [Term("MLP fc1 output, fc2 input", 2 * T * F * e, module="mlp")]


def _moe(cfg: MoEConfig, x: Shapes, maxvio: float) -> list[Term]:
    """megamoe's MoE layer: shared expert (fc1 output T F'_s, activation and fc2 input
    2 T F_s), router scores, balance-loss terms, and the routed path (`routed_rows`): per row
    sent, the sort indices (two int64), the expert output sent back, its gated product and the
    gate; per row received, the expert MLP's input, pre-activation (F') and activation (F), and
    with expert parallelism the int64 index that orders received rows by expert and the expert
    output in arrival order. Latent MoE (`experts.latent_size`) routes rows of the latent
    width, and keeps the projected-down tokens and the combined latent output."""
    T, e, D, E = x.tokens, x.e, cfg.expert_width, cfg.num_experts
    gated = cfg.experts.gated
    terms = []
    if cfg.shared_expert.ffn_hidden_size:
        Fs = cfg.shared_expert.ffn_hidden_size
        terms.append(Term("shared expert", T * Fs * ((2 if gated else 1) + 2) * e,
                          module="moe"))
        if cfg.shared_expert.gate:
            terms.append(Term("shared expert gate", 2 * T * e, module="moe"))
    terms.append(Term("router scores and selection",
                      T * cfg.router_width * (2 * FP32 + 1) + 2 * T * FP32, MOE, "moe"))
    if cfg.balancing.loss_coeffs or cfg.balancing.z_loss_coeff > 0:
        terms.append(Term("balance-loss terms", T * E * FP32 + 3 * T * FP32 + 2 * T, MOE, "moe"))
    if cfg.experts.latent_size is not None:
        terms.append(Term("latent projections: projected tokens, combined latent output",
                          2 * T * D * e, MOE, "moe"))
    sent, received = routed_rows(cfg, T, x.ep, maxvio)
    F = cfg.ffn_hidden_size
    terms.append(Term("sent rows: indices, returned output, gated output, gate",
                      sent * (2 * INDEX_BYTES + (2 * D + 1) * e), MOE, "moe"))
    # With expert parallelism the received rows are reordered by expert (an int64 index) and
    # the expert output is copied back in arrival order, which keeps it (index_copy).
    back = (D * e + INDEX_BYTES) if x.ep > 1 else 0
    terms.append(Term("received rows: expert input, pre-activation, activation",
                      received * ((D + (2 * F if gated else F) + F) * e + back), MOE, "moe"))
    if cfg.dispatcher.kind == "allgather" and x.ep > 1:
        terms.append(Term("all-gathered tokens", x.ep * T * D * e, MOE, "moe"))
    return terms


def layer_terms(config: TrainConfig, x: Shapes, moe: Optional[MoEConfig],
                maxvio: float) -> list[Term]:
    """Every term of one transformer layer for one micro-batch (dense MLP when `moe` is None)."""
    attention = _latent_attention if config.model.multi_latent_attention else _attention
    terms = _norm(config, x, x.h, "input norm") + attention(config, x)
    terms += _norm(config, x, x.h, "pre-MLP norm")
    terms += _dense_mlp(config, x) if moe is None else _moe(moe, x, maxvio)
    if config.model.hidden_dropout > 0:
        terms.append(Term("hidden dropout masks", 2 * x.tokens * x.h))
    return terms


def embedding_terms(config: TrainConfig, x: Shapes) -> list[Term]:
    """The first stage: token ids (and position ids with learned positions)."""
    ids = 2 if config.model.position_embedding == "learned_absolute" else 1
    return [Term("token and position ids", ids * x.s * x.b * INDEX_BYTES)]


def output_terms(config: TrainConfig, x: Shapes) -> list[Term]:
    """The last stage: the final norm and the cross-entropy's fp32 softmax over this rank's
    V/tp logits of every token, with its labels and masks."""
    return _norm(config, x, x.h, "final norm") + [
        Term("fp32 logits softmax (cross-entropy)", x.s * x.b * x.vocab / x.tp * FP32),
        Term("labels, loss mask", x.s * x.b * (INDEX_BYTES + 1 + FP32))]


def mtp_terms(config: TrainConfig, x: Shapes, moe: Optional[MoEConfig],
              maxvio: float) -> list[Term]:
    """One multi-token-prediction depth up to its final norm (DeepSeek-V3, arXiv 2412.19437
    sec. 2.2; Megatron-Core's MultiTokenPredictionLayer): its two inputs (the previous depth's
    hidden state and the embedding of the tokens shifted once more), kept by their RMSNorms;
    the norms' statistics and outputs (their concatenation is what the 2h -> h projection
    keeps); one transformer layer; the final norm. Its logits are `mtp_output_terms`."""
    terms = [Term("MTP inputs: hidden state, shifted embedding", 2 * x.tokens * x.h * x.e)]
    for name in ("MTP embedding norm", "MTP hidden-state norm"):
        terms += _norm(config, x, x.h, name)[1:]
    return terms + layer_terms(config, x, moe, maxvio) + _norm(config, x, x.h, "MTP final norm")


def mtp_output_terms(config: TrainConfig, x: Shapes) -> list[Term]:
    """One multi-token-prediction depth's loss: the cross-entropy's fp32 softmax over its
    logits with its shifted labels and mask, and the shifted token and position ids."""
    return output_terms(config, x)[-2:] + [
        Term("shifted token and position ids", 2 * x.s * x.b * INDEX_BYTES)]


def full_recompute(terms: list[Term], x: Shapes) -> tuple[list[Term], list[Term]]:
    """(kept, recomputed) under `training.recompute: full`: a layer keeps only its input (the
    checkpoint: the first term, the input norm's input; a multi-token-prediction depth's two
    inputs) and the shared mask; its backward replays everything else."""
    kept = [Term("layer input (checkpoint)", terms[0].bytes)]
    kept += [t for t in terms if t.per_rank]
    return kept, [t for t in terms[1:] if not t.per_rank]


def selective(terms: list[Term], modules: list[str]) -> tuple[list[Term], list[Term]]:
    """(kept, recomputed) terms under selective recomputation of `modules` (`mlp` covers
    megamoe's MoE layers as well)."""
    dropped = set(modules) | ({"moe"} if "mlp" in modules else set())
    return ([t for t in terms if t.module not in dropped],
            [t for t in terms if t.module in dropped])


def totals(terms: list[Term], per_microbatch: bool = True) -> dict[str, float]:
    """{category: bytes} of `terms` (those counted once per rank left out or kept only)."""
    out = {ACTIVATIONS: 0.0, MOE: 0.0}
    for term in terms:
        if term.per_rank != per_microbatch:
            out[term.category] += term.bytes
    return out

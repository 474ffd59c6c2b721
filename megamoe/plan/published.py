"""Released MoE models' published parameter counts beside the planner's: each model's
structure as a recipe of `configs/` plus overrides (its release's config.json), its published
total and active figures, and which parts each figure counts, since the publishers differ
(docs/memory_planner.md, "Against the published counts").

The parts a figure may leave out are the multi-token-prediction block (and, in DeepSeek-V3's
685B, its checkpoint's copies of the embedding and output head) from the total, and the input
embedding and output layer from the active count. Which ones a publisher leaves out is not
stated with the figures; each release takes the reading under which its figure, rounded as
published, is the count of its config.json, the nearer where two are (MiniMax-M2's 10B: 9.80B
without embedding and output layer, 10.42B with the output layer).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from megamoe.train.config import load_config

if TYPE_CHECKING:  # the counts build models (Megatron-Core): imported where they are counted
    from megamoe.plan.counts import ParameterCounts

WITHOUT_MTP = "without the MTP block"
WITH_MTP_COPIES = "with the MTP block and its copies of embedding and head"
TOTALS = {WITHOUT_MTP: lambda c: c.main, WITH_MTP_COPIES: lambda c: c.with_mtp_copies}
"""What a published total counts -> the planner's count of the same parts."""

ALL = "embedding and output layer"
OUTPUT_ONLY = "output layer, not the embedding"
NEITHER = "neither embedding nor output layer"
ACTIVES = {ALL: lambda c: c.active, OUTPUT_ONLY: lambda c: c.active_without_embedding,
           NEITHER: lambda c: c.active_without_embedding_and_output}
"""What a published active count holds besides the layers -> the planner's count of it."""

SINGLE_RANK = ("parallel.tensor=1", "parallel.pipeline=1", "parallel.first_stage_layers=null",
               "parallel.last_stage_layers=null")
"""A relative of a recipe with other sizes: drop the recipe's tensor and pipeline split, which
need not fit it (the counts are of the whole model)."""


@dataclass(frozen=True)
class Release:
    """A released model, the config that builds its structure, and its published figures."""

    name: str
    recipe: str
    """A config of `configs/` (its file stem)."""
    overrides: tuple[str, ...]
    """key=value settings that turn the recipe into this model's structure."""
    total: float
    total_counts: str
    """Which parts the published total counts (TOTALS)."""
    active: float
    active_counts: str
    """Which parts the published active count holds (ACTIVES)."""
    source: str


KIMI_K2 = ("model.mtp_layers=0", "model.num_attention_heads=64", "model.first_k_dense=1",
           "moe.num_experts=384", "moe.router.num_groups=null", "moe.router.groups_per_token=null",
           "moe.router.group_score_topk=null", "moe.router.topk_scaling_factor=2.827",
           "data.vocab_size=163840")
GLM_4_5_AIR = ("model.num_layers=46", "model.hidden_size=4096", "model.ffn_hidden_size=10944",
               "model.first_k_dense=1", "model.qk_layernorm=false", "moe.num_experts=128",
               "moe.ffn_hidden_size=1408", "moe.shared_expert.ffn_hidden_size=1408",
               *SINGLE_RANK)
MINIMAX_M2 = ("model.num_layers=62", "model.hidden_size=3072", "model.num_attention_heads=48",
              "model.first_k_dense=0", "model.add_qkv_bias=false",
              "model.qk_layernorm_scope=projection", "model.mtp_layers=0",
              "moe.num_experts=256", "moe.shared_expert.ffn_hidden_size=null",
              "moe.router.topk_scaling_factor=null", "data.vocab_size=200064", *SINGLE_RANK)
GPT_OSS_20B = ("model.num_layers=24", f"model.sliding_window_layers={[1, 0] * 12}",
               "moe.num_experts=32")

RELEASES = (
    Release("DeepSeek-V3", "deepseek_v3", (), 671e9, WITHOUT_MTP, 37e9, OUTPUT_ONLY,
            "arXiv 2412.19437 (671B total, 37B activated)"),
    Release("DeepSeek-V3 as released", "deepseek_v3", (), 685e9,
            WITH_MTP_COPIES, 37e9, OUTPUT_ONLY,
            "its Hugging Face release (685B: 671B + the 14B MTP module)"),
    Release("Kimi-K2", "deepseek_v3", KIMI_K2, 1.04e12, WITHOUT_MTP, 32e9, OUTPUT_ONLY,
            "Kimi K2 report, arXiv 2507.20534 (1.04T total, 32B activated)"),
    Release("GLM-4.5", "glm4_5", (), 355e9, WITHOUT_MTP, 32e9, NEITHER,
            "arXiv 2508.06471 (355B total, 32B activated)"),
    Release("GLM-4.5-Air", "glm4_5", GLM_4_5_AIR, 106e9,
            WITHOUT_MTP, 12e9, NEITHER, "arXiv 2508.06471 (106B total, 12B activated)"),
    Release("MiniMax-M2", "glm4_5", MINIMAX_M2, 230e9, WITHOUT_MTP, 10e9, NEITHER,
            "its model card (230B total, 10B active)"),
    Release("GPT-OSS-120b", "gpt_oss_120b", (), 116.8e9, WITHOUT_MTP, 5.1e9, OUTPUT_ONLY,
            "gpt-oss model card, arXiv 2508.10925 (116.83B total, 5.13B active)"),
    Release("GPT-OSS-20b", "gpt_oss_120b", GPT_OSS_20B, 20.9e9, WITHOUT_MTP, 3.6e9,
            OUTPUT_ONLY, "gpt-oss model card, arXiv 2508.10925 (20.91B total, 3.61B active)"),
    Release("Mixtral 8x7B", "mixtral_8x7b", (), 46.7e9, WITHOUT_MTP, 12.9e9, ALL,
            "arXiv 2401.04088 (46.7B total, 12.9B active)"),
)


@dataclass(frozen=True)
class Comparison:
    release: Release
    counts: ParameterCounts

    @property
    def total(self) -> int:
        """The planner's count of the parts the published total counts."""
        return TOTALS[self.release.total_counts](self.counts)

    @property
    def active(self) -> int:
        """The planner's count of the parts the published active count holds."""
        return ACTIVES[self.release.active_counts](self.counts)

    @property
    def total_error(self) -> float:
        """Relative difference of the planner's total from the published one."""
        return self.total / self.release.total - 1

    @property
    def active_error(self) -> float:
        return self.active / self.release.active - 1


def compare(release: Release, configs: Path) -> Comparison:
    """The planner's counts of `release`'s structure (the recipe under `configs`, with its
    overrides, and the release's vocabulary `data.vocab_size` whatever tokenizer is at hand)
    against its published figures."""
    from megamoe.plan.counts import parameter_counts

    config = load_config(configs / f"{release.recipe}.yaml", list(release.overrides))
    return Comparison(release, parameter_counts(config, config.data.vocab_size))

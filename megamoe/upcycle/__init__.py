"""Dense -> MoE upcycling of Megatron-Core checkpoints.

- `recipe`: UpcycleRecipe, every choice of a conversion.
- `granular`, `drop`, `experts`: the methods as pure tensor functions (sparse upcycling
  arXiv 2212.05055, granular upcycling with virtual groups arXiv 2410.07524, Drop-Upcycling
  arXiv 2502.19261).
- `source`, `dist_source`, `legacy_source`, `dcp_reader`: reading dense torch_dist and legacy
  per-rank checkpoints at any TP/PP layout (every pickle through megamoe.checkpointing's
  allow-lists).
- `layout`, `moe_layer`, `dcp_writer`, `convert`: writing the MoE checkpoint in Megatron-Core's
  layout, one layer at a time.
- `arch`, `verify`: comparing dense and MoE logits.
"""
from megamoe.upcycle.convert import UpcycleResult, upcycle_checkpoint
from megamoe.upcycle.recipe import UpcycleRecipe, parse_moe_layers
from megamoe.upcycle.source import open_dense_checkpoint

__all__ = ["UpcycleRecipe", "UpcycleResult", "open_dense_checkpoint", "parse_moe_layers",
           "upcycle_checkpoint"]

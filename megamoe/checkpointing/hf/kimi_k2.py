"""Kimi-K2 (Moonshot AI) both ways: DeepSeek-V3's architecture and table (`deepseek_v3`) at
other sizes (384 routed experts, one expert group, `routed_scaling_factor` 2.827), released
with its own config.json `model_type: kimi_k2` (architectures `DeepseekV3ForCausalLM`)."""
from __future__ import annotations

from megamoe.checkpointing.hf.base import register
from megamoe.checkpointing.hf.deepseek_v3 import DeepSeekV3


@register
class KimiK2(DeepSeekV3):
    model_type = "kimi_k2"

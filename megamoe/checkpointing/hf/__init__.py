"""The Hugging Face MoE architectures megamoe imports and exports, one two-way table each
(`megamoe.checkpointing.hf.base.Architecture`); adding one is a module and one line below.
The export's default `--arch` is the first registered one that expresses the model."""
from __future__ import annotations

from pathlib import Path

from megamoe.checkpointing.hf.base import ARCHITECTURES, Architecture
from megamoe.checkpointing.hf.deepseek_v3 import DeepSeekV3  # noqa: F401
from megamoe.checkpointing.hf.kimi_k2 import KimiK2  # noqa: F401
from megamoe.checkpointing.hf.qwen3_moe import Qwen3MoE  # noqa: F401
from megamoe.checkpointing.hf.qwen2_moe import Qwen2MoE  # noqa: F401
from megamoe.checkpointing.hf.mixtral import Mixtral  # noqa: F401
from megamoe.checkpointing.hf.gpt_oss import GptOss  # noqa: F401
from megamoe.checkpointing.hf.glm4_moe import Glm4Moe  # noqa: F401
from megamoe.checkpointing.hf.minimax_m2 import MiniMaxM2  # noqa: F401
from megamoe.checkpointing.hf_arch import CONFIG_FILE, DENSE_TYPES, read_config_json
from megamoe.checkpointing.hf_moe_arch import HFMoEModel
from megamoe.errors import CheckpointError


def architecture(config: dict, where: Path) -> Architecture:
    """The table of config.json's `model_type`, or a one-line refusal naming the supported
    ones."""
    kind = config.get("model_type")
    if kind in DENSE_TYPES:
        raise CheckpointError(f"{where}: model_type {kind!r} is dense; read it with "
                              "megamoe.checkpointing.hf_arch.read_hf_arch")
    if kind not in ARCHITECTURES:
        raise CheckpointError(f"{where}: model_type={kind!r:.60} cannot be imported; supported "
                              f"MoE architectures: {', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[kind]


def read_hf_moe_model(directory: Path) -> HFMoEModel:
    """The MoE model in `directory`, checked to be one megamoe reproduces (its architecture's
    `read_config`)."""
    config = read_config_json(directory)
    where = directory / CONFIG_FILE
    return architecture(config, where).read_config(config, where)

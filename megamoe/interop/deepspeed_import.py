"""Convert a Megatron-DeepSpeed MoE checkpoint into megamoe's torch_dist MoE checkpoint
(Megatron-Core's MoE layout, the one tools/upcycle_ckpt.py writes), one layer at a time.

Output as the upcycler's: `OUT/latest_checkpointed_iteration.txt` ("release"), `OUT/release/`
(torch_dist with megamoe's checksum manifest), `OUT/deepspeed_import.json` (what was converted).
Stacked keys when every layer is MoE, per-layer keys otherwise (Megatron-Core's choice). The
expert bias is written as zeros (DeepSpeed has none).

`verify`: every MoE layer of the output, as a megamoe MoELayer, against DeepSpeed's own
`deepspeed.moe.layer.MoE` loaded from the source files, on the same random tokens: the max
|difference| must be <= 1e-5 (fp32).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Optional

import torch

from megamoe.atomic import atomic_directory
from megamoe.checkpointing.dcp_writer import StreamingCheckpointWriter
from megamoe.checkpointing.deepspeed_source import FC1, FC2, DeepSpeedSource
from megamoe.checkpointing.layout import RELEASE, TRACKER
from megamoe.checkpointing.manifest import write_manifest
from megamoe.checkpointing.sharded_keys import KeyLayout, whole_tensor
from megamoe.errors import ConfigError
from megamoe.paths import refuse_overlap
from megamoe.upcycle.hf_logits import require_within

RECORD_FILE = "deepspeed_import.json"
VERIFY_TOLERANCE = 1e-5
ACTIVATIONS = ("gelu", "swiglu")


def _layer_chunks(layout: KeyLayout, index: int, tensors: dict[str, torch.Tensor],
                  gated: bool) -> list:
    chunks = []
    for suffix, tensor in tensors.items():
        if suffix in (f"mlp.{FC1}", f"mlp.{FC2}"):
            continue
        glu = gated and suffix == "mlp.linear_fc1.weight"
        chunks += layout.layer_tensor(suffix, index, tuple(tensor.shape), tensor.dtype,
                                      lambda t=tensor: t, glu)
    if "mlp.router.weight" in tensors:
        E = tensors["mlp.router.weight"].shape[0]
        chunks += layout.layer_tensor("mlp.router.expert_bias", index, (E,), torch.float32,
                                      lambda: torch.zeros(E))
        for name, key, glu in (("linear_fc1.weight", FC1, gated),
                               ("linear_fc2.weight", FC2, False)):
            stacked = tensors[f"mlp.{key}"]
            for e in range(E):
                chunks += layout.expert_tensor(name, index, e, E, tuple(stacked.shape[1:]),
                                               stacked.dtype, lambda t=stacked[e]: t, glu)
    return chunks


def import_deepspeed(load, save, topk: int, activation: str = "gelu", overwrite: bool = False,
                     verify: bool = False, log: Callable[[str], None] = print) -> Optional[float]:
    """Convert the DeepSpeed checkpoint at `load` into `save`; returns the verify figure."""
    refuse_overlap(save, [load])
    if activation not in ACTIVATIONS:
        raise ConfigError(f"--activation {activation!r} is not one of {list(ACTIVATIONS)}")
    gated = activation == "swiglu"
    source = DeepSpeedSource(Path(load), glu=gated)
    if not 1 <= topk <= source.num_experts:
        raise ConfigError(f"--topk {topk} must be in 1..{source.num_experts} (the experts)")
    all_moe = len(source.moe_layers) == source.num_layers
    layout = KeyLayout("stacked" if all_moe else "per_layer", source.num_layers)
    with atomic_directory(save, overwrite=overwrite, owner="import_deepspeed_moe") as tmp:
        checkpoint_dir = tmp / RELEASE
        checkpoint_dir.mkdir()
        writer = StreamingCheckpointWriter(checkpoint_dir)
        ffn = None
        for index in range(source.num_layers):
            tensors = source.layer(index).tensors
            if f"mlp.{FC2}" in tensors:
                ffn = tensors[f"mlp.{FC2}"].shape[-1]
            writer.write_part(_layer_chunks(layout, index, tensors, gated))
        writer.write_part([whole_tensor(k, t) for k, t in source.non_layer_tensors()])
        record = {"tool": "megamoe.interop.deepspeed_import", "source": str(source.directory),
                  "num_layers": source.num_layers, "moe_layers": source.moe_layers,
                  "key_layout": layout.kind, "activation": activation,
                  "megatron_settings": {
                      "num_moe_experts": source.num_experts, "moe_router_topk": topk,
                      "moe_ffn_hidden_size": ffn, "moe_router_pre_softmax": topk == 1,
                      "moe_layer_freq": [int(i in source.moe_layers)
                                         for i in range(source.num_layers)]}}
        writer.finish({"checkpoint_version": 3.0, "iteration": 0, "deepspeed_import": record})
        write_manifest(checkpoint_dir)
        (tmp / TRACKER).write_text(RELEASE)
        (tmp / RECORD_FILE).write_text(json.dumps(record, indent=2) + "\n")
        log(f"converted {source.directory}: {source.num_layers} layers, MoE layers "
            f"{source.moe_layers}, {source.num_experts} experts, {writer.bytes_written / 2**20:.1f}"
            " MiB")
        diff = _verify(source, checkpoint_dir, topk, activation, log) if verify else None
    return diff


def _verify(source: DeepSpeedSource, checkpoint_dir: Path, topk: int, activation: str,
            log: Callable[[str], None]) -> float:
    from megamoe.config import MoEConfig
    from megamoe.interop.deepspeed_moe import deepspeed_moe_layer, init_deepspeed_comm
    from megamoe.layer import MoELayer
    from megamoe.checkpointing.dist_source import DistSource

    init_deepspeed_comm()
    output = DistSource(checkpoint_dir, moe=True)
    worst = 0.0
    for index in source.moe_layers:
        converted = output.layer(index).tensors
        fc1 = converted["mlp.experts.experts.linear_fc1.weight"]
        fc2 = converted["mlp.experts.experts.linear_fc2.weight"]
        E, H, F = fc1.shape[0], fc1.shape[2], fc2.shape[2]
        ours = MoELayer(MoEConfig.from_dict({
            "hidden_size": H, "num_experts": E, "ffn_hidden_size": F, "topk": topk,
            "router": {"pre_softmax": topk == 1}, "balancing": {"methods": "none"},
            "dispatcher": {"kind": "alltoall"}, "experts": {"activation": activation}})).eval()
        ours.load_state_dict({"router.weight": converted["mlp.router.weight"],
                              "experts.fc1_weight": fc1, "experts.fc2_weight": fc2})
        theirs = deepspeed_moe_layer(H, F, E, topk, activation).eval()
        theirs.load_state_dict(source.deepspeed_state(index))
        x = torch.randn(16, 4, H, generator=torch.Generator().manual_seed(index))
        with torch.no_grad():
            diff = float((ours(x)[0] - theirs(x)[0]).abs().max())
        worst = max(worst, diff)
    log(f"verify: max |output diff| megamoe vs deepspeed.moe.layer.MoE = {worst:.3e} over "
        f"{len(source.moe_layers)} MoE layer(s) (bar {VERIFY_TOLERANCE:.0e})")
    require_within(worst, VERIFY_TOLERANCE, "output")
    return worst

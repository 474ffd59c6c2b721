"""Worker of test_hf_import.py: imported Hugging Face MoE checkpoints run with their experts
split over the ranks (expert parallelism), one spawn for every architecture: their logits, then a
few training steps through the trainer (`python -m megamoe.train`'s `loop.run`)."""
from __future__ import annotations

import torch


def import_job(rank: int, world_size: int, imports: dict, tokens: torch.Tensor,
               training: dict) -> dict:
    """{architecture: logits} of each imported checkpoint (`imports`: architecture ->
    (import folder, config sections)) at expert-parallel size `world_size`; then each is
    trained at that size with the `training` overrides, into `training["output_dir"]/<arch>`."""
    import warnings
    from pathlib import Path

    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    from megamoe.train import loop
    from megamoe.train.config import config_from_dict
    from megamoe.upcycle.hf_logits import megamoe_logits

    # One process group for the job, which each setup_megatron reuses.
    dist.init_process_group("gloo", init_method="env://")
    logits = {}
    for arch, (folder, sections) in imports.items():
        logits[arch] = megamoe_logits(str(Path(folder) / "release"),
                                      {**sections, "vocab_size": 4096}, tokens,
                                      expert_parallel=world_size)
        raw = {**sections, **training, "output_dir": f"{training['output_dir']}/{arch}",
               "data": {**sections["data"], **training["data"]},
               "parallel": {"expert": world_size},
               "checkpoint": {"init_from": folder}}
        assert loop.run(config_from_dict(raw)) == 0
    return logits

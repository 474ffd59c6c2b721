"""The optimizer steps with what the config says (issue 55), through the trainer's own entry
point in this process on one rank:
- Megatron-LM's parameter-group rule: after one step from the same weights and data, every bias
  and 1-D parameter (the norm weights) at `optimizer.weight_decay=5` equals the one at 0, and
  every other parameter differs;
- optimizer settings changed on resume take effect from the resumed step (the checkpoint differs
  from an unchanged resume's) and are announced once, on the console and as `setting` events.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from test_train_in_process import train

CHANGED = {"optimizer.weight_decay": 5.0, "optimizer.eps": 1.0, "optimizer.beta1": 0.0}


def model_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The model tensors of a torch_dist checkpoint (no optimizer state), read by torch's DCP."""
    reader = dcp.FileSystemReader(str(checkpoint))
    tensors = {name: torch.empty(meta.size, dtype=meta.properties.dtype)
               for name, meta in reader.read_metadata().state_dict_metadata.items()
               if isinstance(meta, TensorStorageMetadata) and not name.startswith("optimizer.")}
    dcp.load(tensors, storage_reader=reader, no_dist=True)
    return tensors


def decays(name: str, tensor: torch.Tensor) -> bool:
    """Megatron-LM's rule: no weight decay on biases and 1-D parameters."""
    return not (name.endswith(".bias") or tensor.dim() == 1)


@pytest.mark.quick(budget_s=60)
def test_norms_and_biases_do_not_decay(corpus_cache, tmp_path):
    last = {}
    for decay in (0.0, 5.0):
        out = tmp_path / f"wd{decay}"
        train(corpus_cache, out, "training.train_steps=1", f"optimizer.weight_decay={decay}")
        last[decay] = model_weights(out / "checkpoints" / "iter_0000001")
    kept, decayed = [], []
    for name, tensor in last[0.0].items():
        if not tensor.is_floating_point() or name.endswith("_extra_state"):
            continue
        (decayed if decays(name, tensor) else kept).append(name)
        same = torch.equal(tensor, last[5.0][name])
        assert same != decays(name, tensor), name
    assert any("layernorm" in name or "norm.weight" in name for name in kept), kept
    assert decayed


@pytest.mark.quick(budget_s=60)
def test_optimizer_settings_changed_on_resume_apply_and_are_announced(corpus_cache, tmp_path,
                                                                      capsys):
    first = tmp_path / "first"
    train(corpus_cache, first, "training.train_steps=2", "training.exit_interval=1")
    changed = tmp_path / "changed"
    shutil.copytree(first, changed)
    train(corpus_cache, first, "training.train_steps=2")
    capsys.readouterr()
    train(corpus_cache, changed, "training.train_steps=2",
          *(f"{name}={value}" for name, value in CHANGED.items()))
    console = capsys.readouterr().out
    for name, value in CHANGED.items():
        assert console.count(f"setting {name}: ") == 1, console
    events = [json.loads(line) for line in (changed / "metrics.jsonl").read_text().splitlines()]
    announced = {e["setting"]: (e["new"], e["step"]) for e in events if e.get("event") == "setting"}
    assert announced == {name: (value, 2) for name, value in CHANGED.items()}
    unchanged = model_weights(first / "checkpoints" / "iter_0000002")
    resumed = model_weights(changed / "checkpoints" / "iter_0000002")
    assert any(not torch.equal(unchanged[name], resumed[name]) for name in unchanged)

"""Import a released Hugging Face model as a megamoe checkpoint, to continue its pretraining.

MoE models (every architecture of `megamoe.checkpointing.hf`, read by
`megamoe.checkpointing.hf_moe_source`, multi-token-prediction layers included) become a
torch_dist checkpoint in Megatron-LM's layout, as the upcycler writes one:
`OUT/latest_checkpointed_iteration.txt` ("release"), `OUT/release/` (with megamoe's checksum
manifest, the `model`/`moe` config sections in its common state under `megamoe_model`, which
tools/export_hf.py reads, the model's tokenizer in `release/tokenizer/` with its identity in the
common state, and the source's config.json and generation_config.json in `release/hf_source/`:
megamoe.upcycle.hf_files), `OUT/train_config.yaml` (those sections and the continued-pretraining
settings, each with a comment, naming the tokenizer: megamoe.upcycle.train_recipe; train with
`python -m megamoe.train --config OUT/train_config.yaml`) and `OUT/import_metrics.jsonl`
(seconds, bytes and MB/s per layer). Dense models (Llama, Mistral, Qwen2, Qwen3) take the dense
conversion (`megamoe.interop.hf_dense`). Everything is written to a temporary directory renamed
to OUT only when the conversion and `verify` succeeded; memory holds one layer and one expert.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable, Optional

import torch
from tqdm import tqdm

from megamoe.atomic import atomic_directory
from megamoe.checkpointing.dcp_writer import StreamingCheckpointWriter
from megamoe.checkpointing.hf_arch import DENSE_TYPES, read_config_json
from megamoe.checkpointing.hf_moe_source import HFMoESource
from megamoe.checkpointing.layout import RELEASE
from megamoe.errors import CheckpointError
from megamoe.paths import refuse_overlap
from megamoe.upcycle.convert import (TRAIN_CONFIG_FILE, VERIFY_TOLERANCE, finish_release,
                                     part_metric)
from megamoe.upcycle.hf_files import hf_origin, tokenizer_line
from megamoe.upcycle.hf_logits import require_within

METRICS_FILE = "import_metrics.jsonl"


def import_hf(load, save, overwrite: bool = False, verify: bool = False, drop_mtp: bool = False,
              progress: bool = True, log: Callable[[str], None] = print,
              dtype: Optional[torch.dtype] = None) -> Optional[float]:
    """Write the Hugging Face model at `load` as a megamoe checkpoint at `save` (see the
    module docstring); returns the verify figure (max |logit difference| against transformers)
    when asked. drop_mtp: import the model without its multi-token-prediction layers; dtype:
    of the written weights (None: the checkpoint's)."""
    load = Path(load)
    refuse_overlap(save, [load])
    if read_config_json(load).get("model_type") in DENSE_TYPES:
        from megamoe.interop.hf_dense import convert_hf_dense

        if dtype is not None:
            raise CheckpointError("--dtype applies to MoE imports; a dense model converts in "
                                  "its own precision")

        return convert_hf_dense(load, save, overwrite=overwrite, verify=verify, log=log,
                                owner="import_hf")
    source = HFMoESource(load, drop_mtp=drop_mtp, dtype=dtype)
    sections = source.train_sections()
    record = {"tool": "megamoe.interop.hf_import", "source": str(load.resolve()),
              "model_type": source.arch.model_type, "dropped_mtp_layers": source.dropped_mtp}
    origin = hf_origin(load, save, "tools/import_hf.py", source.description, source.arch,
                       record, {"moe": source.moe.balancing_notes(source.arch.model_type)})
    start = time.perf_counter()
    with atomic_directory(save, overwrite=overwrite, owner="import_hf") as tmp:
        log(f"importing {source.description}: {source.layout.kind} keys")
        note = source.mtp_note()
        if note:
            log(note)
        if source.reader.quantization:
            log(f"dequantising {source.reader.quantization.method} weights into "
                f"{str(source.dtype).removeprefix('torch.')}")
        checkpoint_dir = tmp / RELEASE
        checkpoint_dir.mkdir()
        writer = StreamingCheckpointWriter(checkpoint_dir)
        metrics = _write_layers(source, writer, progress)
        log(f"converted {source.finish()}")
        finish_release(tmp, writer, {"checkpoint_version": 3.0, "iteration": 0,
                                     "hf_import": record}, sections, origin)
        (tmp / METRICS_FILE).write_text("".join(json.dumps(m) + "\n" for m in metrics))
        seconds = time.perf_counter() - start
        log(f"wrote {writer.bytes_written / 2**20:.1f} MiB in {seconds:.1f} s")
        log(tokenizer_line(origin))
        # The config sets checkpoint.init_from already: the command needs nothing more.
        log(f"train with: python -m megamoe.train --config {save}/{TRAIN_CONFIG_FILE}")
        diff = _verify(load, checkpoint_dir, sections, log, source.reader) if verify else None
    return diff


def _write_layers(source: HFMoESource, writer: StreamingCheckpointWriter,
                  progress: bool) -> list[dict]:
    metrics = []
    # Closed before an error leaves, so the one-line error is the last line on stderr.
    with tqdm(total=source.num_layers + 1 + len(source.extra_blocks), desc="import", unit="layer",
              disable=not progress) as bar:
        for index in range(source.num_layers):
            start = time.perf_counter()
            written = writer.write_part(*source.layer_items(index))
            metrics.append(part_metric(f"layer {index}", source.moe.pattern[index], written,
                                       start))
            bar.update(1)
        start = time.perf_counter()
        # One part (file) per tensor: torch's DCP writer keeps each named tensor of a part until
        # the part's file is complete, which held the embedding and output matrices together.
        written = sum(writer.write_part([chunk]) for chunk in source.non_layer_items())
        metrics.append(part_metric("embeddings and output layer", False, written, start))
        bar.update(1)
        for index, block in enumerate(source.extra_blocks):
            start = time.perf_counter()
            written = writer.write_part(*source.extra_items(index))
            metrics.append(part_metric(f"multi-token prediction {index}", block.is_moe, written,
                                       start))
            bar.update(1)
    return metrics


def _verify(load: Path, checkpoint_dir: Path, sections: dict, log: Callable[[str], None],
            weights) -> float:
    """transformers' logits (on `weights`, the tensors as the import read them) against
    megamoe's."""
    from megamoe.upcycle.hf_logits import hf_vs_megamoe

    diff = hf_vs_megamoe(load, checkpoint_dir, sections, weights=weights)
    log(f"verify: max |logit diff| transformers vs megamoe = {diff:.3e} "
        f"(bar {VERIFY_TOLERANCE:.0e})")
    require_within(diff, VERIFY_TOLERANCE, "logit")
    return diff

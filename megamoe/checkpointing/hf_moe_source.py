"""A Hugging Face MoE checkpoint read layer by layer into Megatron-Core's sharded keys, through
its architecture's two-way table (megamoe.checkpointing.hf: the names, shapes and transforms
of every tensor, config.json's mapping; the export reads the same table).

The files must hold exactly the tensors the table lists for config.json, in its shapes: a bias,
an unknown tensor or a missing one is refused in one line before anything is written
(`check_shapes`), and every tensor read is counted (`TensorLedger`): `finish()` fails naming a
tensor left unread. Layers beyond `num_hidden_layers` are multi-token-prediction layers: all
those config.json announces are imported (megamoe.checkpointing.hf.mtp), or with `--drop-mtp`
none (counted as dropped). Quantised releases (FP8 block scales, MXFP4) are read dequantised,
into the asked dtype (megamoe.checkpointing.quantized).

Megatron keys: decoder layers follow Megatron's stacked (every layer alike) or per-layer key
layout (`KeyLayout`); a SwiGLU fc1 is written as its gate and up halves; each linear layer gets
its `_extra_state` object (None, as Megatron saves it without Transformer Engine), each routed
expert its own. Memory: one layer's non-expert tensors, plus one expert (or, for an
architecture storing all experts in one tensor, that tensor) while it is written; outside the
layers, one tensor at a time.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import torch

from megamoe.checkpointing.expected_tensors import check_shapes
from megamoe.checkpointing.hf import architecture
from megamoe.checkpointing.hf.base import (ALL_EXPERTS, MEGATRON_EXPERTS, Block, Rule,
                                           TensorLedger)
from megamoe.checkpointing.hf.mtp import mtp_blocks, mtp_depths
from megamoe.checkpointing.hf_arch import CONFIG_FILE, read_config_json
from megamoe.checkpointing.hf_moe_arch import HFMoEModel
from megamoe.checkpointing.hf_source import none_bytes
from megamoe.checkpointing.quantized import open_weights
from megamoe.checkpointing.sharded_keys import (KeyLayout, ObjectItem, TensorChunk,
                                                object_key)
from megamoe.errors import CheckpointError

Items = tuple[list[TensorChunk], list[ObjectItem]]


def megatron_shape(rule: Rule) -> tuple[int, ...]:
    """The shape of the Megatron tensor `rule` makes (its transform run on meta tensors)."""
    parts = [torch.empty(shape, device="meta") for shape in rule.shapes]
    return tuple(rule.transform.to_megatron(parts).shape)


def extra_state_key(megatron: str) -> Optional[str]:
    """`X.linear_Y._extra_state` for the weight `X.linear_Y.weight` of a linear layer, else
    None."""
    module, _, name = megatron.rpartition(".")
    if name != "weight" or not module.rpartition(".")[2].startswith("linear_"):
        return None
    return module + "._extra_state"


class HFMoESource:
    """A Hugging Face MoE model, block by block (see the module docstring)."""

    format = "hf_safetensors"

    def __init__(self, directory: Path, drop_mtp: bool = False,
                 dtype: Optional[torch.dtype] = None):
        """dtype: of the written weights (None: that of the checkpoint's unquantised tensors)."""
        self.directory = directory
        config = read_config_json(directory)
        self.table = architecture(config, directory / CONFIG_FILE)
        self.model: HFMoEModel = self.table.read_config(config, directory / CONFIG_FILE)
        self.arch, self.moe = self.model.arch, self.model.moe
        self.reader = open_weights(directory, config, dtype)
        self.cast = dtype is not None
        self.num_layers = self.arch.num_layers
        pattern = self.moe.pattern
        # Megatron-Core stacks the layers' keys only when every layer is alike.
        self.layout = KeyLayout("stacked" if all(pattern) else "per_layer", self.num_layers)
        self.description = (f"Hugging Face {self.arch.model_type} ({self.num_layers} layers, "
                            f"{sum(pattern)} MoE with {self.moe.num_experts} experts, hidden "
                            f"{self.arch.hidden_size}) at {directory}")
        layers = {_layer_index(name) for name in self.reader.shapes}
        self.mtp_depths = 0 if drop_mtp else mtp_depths(self.model, layers, str(directory))
        self.blocks = self.table.blocks(self.model) + mtp_blocks(self.table, self.model,
                                                                  self.mtp_depths)
        self.dropped_mtp = self._check_names()
        self.dtype = self.reader.dtype
        # Tensors kept in a dtype of their own, which --verify's reference keeps too.
        self.reader.held = {block.hf_prefix + name: kept for block in self.blocks
                            for rule in block.rules
                            if (kept := self._dtype(block, rule)) != self.dtype
                            for name in rule.hf}

    def train_sections(self) -> dict[str, dict]:
        """The training config's sections of the model as imported."""
        return self.model.train_sections(with_mtp=self.mtp_depths > 0)

    # -- what the files must hold ------------------------------------------------------------

    def _check_names(self) -> int:
        """Refuse files that do not hold exactly this model's tensors; the number of
        multi-token-prediction layers dropped (`--drop-mtp`: the layers beyond the table's)."""
        expected = {name: shape for block in self.blocks
                    for name, shape in block.hf_names().items()}
        dropped = {name for name in set(self.reader.shapes) - set(expected)
                   if _layer_index(name) >= self.num_layers + self.mtp_depths}
        check_shapes({name: shape for name, shape in self.reader.shapes.items()
                      if name not in dropped}, expected, str(self.directory), "config.json")
        self.ledger = TensorLedger({**expected, **{n: self.reader.shapes[n] for n in dropped}},
                                   str(self.directory), f"the {self.arch.model_type} model")
        self.ledger.skip(dropped)
        return len({_layer_index(name) for name in dropped})

    def mtp_note(self) -> Optional[str]:
        """One line on the multi-token-prediction layers: imported, dropped (which and how
        many tensors) or announced by config.json but absent from the files; None: none."""
        N, depth = self.num_layers, self.mtp_depths or self.dropped_mtp
        where = f"model.layers.{N}.*" if depth == 1 else f"model.layers.{N}..{N + depth - 1}.*"
        if self.dropped_mtp:
            return (f"dropping {self.dropped_mtp} multi-token-prediction layer(s) (--drop-mtp): "
                    f"{where}, {len(self.ledger.skipped)} tensors")
        if self.mtp_depths:
            return (f"multi-token prediction: {self.mtp_depths} layer(s) {where} imported as "
                    f"model.mtp_layers={self.mtp_depths}")
        if self.model.mtp_layers:
            return (f"config.json announces num_nextn_predict_layers={self.model.mtp_layers} but "
                    "the files hold no MTP tensors: imported without multi-token prediction")
        return None

    def finish(self) -> str:
        """After every item was written: fail naming a tensor of the files left unread; else
        the count, one line."""
        return self.ledger.close()

    # -- reading -----------------------------------------------------------------------------

    def _dtype(self, block: Block, rule: Rule) -> torch.dtype:
        """The dtype `rule`'s Megatron tensor is written in: the rule's own (DeepSeek's fp32
        correction bias); with `--dtype`, that one; else the one its Hugging Face tensors are
        saved in when they agree and are not quantised (transformers saves a bf16 DeepSeek-V3's
        router in fp32: it stays so, and the export gives it back as saved), else the
        model's."""
        if rule.dtype or self.cast:
            return rule.dtype or self.dtype
        saved = {self.reader.stored_dtype(block.hf_prefix + name) for name in rule.hf}
        return saved.pop() if len(saved) == 1 and None not in saved else self.dtype

    def _convert(self, block: Block, rule: Rule) -> torch.Tensor:
        """The Megatron tensor of `rule`, from its HF tensors (counted in the ledger)."""
        dtype = self._dtype(block, rule)
        parts = []
        for name in rule.hf:
            name = block.hf_prefix + name
            parts.append(self.reader.read(name).to(dtype))
            self.ledger.mark(name, tuple(parts[-1].shape))
        return rule.transform.to_megatron(parts)

    def _check_copy(self, block: Block, rule: Rule) -> None:
        """A copy of another HF tensor (`rule.copy_of`) must equal it."""
        (name,) = (block.hf_prefix + n for n in rule.hf)
        copy, original = self.reader.read(name), self.reader.read(rule.copy_of)
        self.ledger.mark(name, tuple(copy.shape))
        if not torch.equal(copy, original):
            raise CheckpointError(f"{self.directory}: tensor {name} differs from "
                                  f"{rule.copy_of}, of which it must be a copy (megamoe shares "
                                  "one tensor for both); the checkpoint is inconsistent")

    def _block_items(self, block: Block) -> Items:
        """The chunks and extra-state objects of one block (a decoder layer or an MTP layer):
        non-expert tensors converted now, routed experts when written."""
        chunks: list[TensorChunk] = []
        objects: dict[str, ObjectItem] = {}
        E = self.moe.num_experts
        place = _Placement(self.layout, block)
        for rule in block.rules:
            if not rule.hf:
                continue
            if rule.copy_of:
                self._check_copy(block, rule)
                continue
            shape, dtype = megatron_shape(rule), self._dtype(block, rule)
            state = extra_state_key(rule.megatron)
            if rule.expert is None:
                tensor = self._convert(block, rule)
                chunks += place.tensor(rule.megatron, shape, dtype, lambda t=tensor: t, rule.glu)
                if state:
                    objects[state] = place.object(state)
                continue
            experts = range(E) if rule.expert == ALL_EXPERTS else (rule.expert,)
            convert = _Shared(lambda rule=rule: self._convert(block, rule),
                              len(experts) * (2 if rule.glu else 1))
            for e in experts:
                make = (lambda e=e, convert=convert: convert()[e]) \
                    if rule.expert == ALL_EXPERTS else convert
                chunks += place.expert_tensor(rule.megatron, e, E, shape[1:] if
                                              rule.expert == ALL_EXPERTS else shape, dtype,
                                              make, rule.glu)
                if state:
                    objects[f"{state}#{e}"] = place.expert_object(state, e, E)
        return chunks, list(objects.values())

    def layer_items(self, index: int) -> Items:
        """Decoder layer `index` as checkpoint chunks and extra-state objects."""
        return self._block_items(self.blocks[1 + index])

    @property
    def extra_blocks(self) -> list[Block]:
        """The blocks after the decoder layers (the multi-token-prediction layers)."""
        return self.blocks[1 + self.num_layers:]

    def extra_items(self, index: int) -> Items:
        """Extra block `index` (multi-token-prediction layer `index`), one part."""
        return self._block_items(self.extra_blocks[index])

    def non_layer_items(self) -> list[TensorChunk]:
        """The embedding, final norm and output layer, each read only when written (written as
        parts of their own, the two vocabulary-sized matrices are then never held together)."""
        block, chunks = self.blocks[0], []
        for rule in block.rules:
            shape = megatron_shape(rule)
            chunks.append(TensorChunk(rule.megatron, shape, (0,) * len(shape), shape,
                                      self._dtype(block, rule),
                                      lambda rule=rule: self._convert(block, rule)))
        return chunks


class _Shared:
    """A tensor made on its first use and let go after its last (`uses`: the chunks written
    from it), so a layer's routed experts are never all held at once."""

    def __init__(self, make: Callable[[], torch.Tensor], uses: int):
        self.make, self.uses, self.value = make, uses, None

    def __call__(self) -> torch.Tensor:
        value = self.value if self.value is not None else self.make()
        self.uses -= 1
        self.value = value if self.uses > 0 else None
        return value


class _Placement:
    """Where a block's Megatron tensors go: a decoder layer's keys follow the checkpoint's key
    layout; another block's are `megatron_prefix + key`, routed experts on an expert axis."""

    def __init__(self, layout: KeyLayout, block: Block):
        self.layout, self.block = layout, block

    def tensor(self, key: str, shape, dtype, make: Callable, glu: bool) -> list[TensorChunk]:
        if self.block.layer is not None:
            return self.layout.layer_tensor(key, self.block.layer, shape, dtype, make, glu)
        return KeyLayout._chunks(self.block.megatron_prefix + key, (), (), shape, dtype, make,
                                 glu, singleton=False)

    def expert_tensor(self, key: str, e: int, E: int, shape, dtype, make: Callable, glu: bool
                      ) -> list[TensorChunk]:
        name = key.removeprefix(MEGATRON_EXPERTS)
        if self.block.layer is not None:
            return self.layout.expert_tensor(name, self.block.layer, e, E, shape, dtype, make,
                                             glu)
        return KeyLayout._chunks(self.block.megatron_prefix + key, (e,), (E,), shape, dtype,
                                 make, glu, singleton=False)

    def object(self, key: str) -> ObjectItem:
        if self.block.layer is not None:
            return self.layout.layer_object(key, self.block.layer, none_bytes())
        return ObjectItem(object_key(self.block.megatron_prefix + key), none_bytes())

    def expert_object(self, key: str, e: int, E: int) -> ObjectItem:
        name = key.removeprefix(MEGATRON_EXPERTS)
        if self.block.layer is not None:
            return self.layout.expert_object(name, self.block.layer, e, E, none_bytes())
        return ObjectItem(object_key(self.block.megatron_prefix + key, (e,), (E,)),
                          none_bytes())


def _layer_index(name: str) -> int:
    """The layer number of a `model.layers.{i}.` tensor name, -1 for any other name."""
    parts = name.split(".")
    if len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
        return int(parts[2])
    return -1

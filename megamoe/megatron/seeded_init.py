"""Layout-invariant weight initialisation: a parameter's initial values are a function of the
seed and of the parameter's global identity only, never of the tensor-, pipeline-, virtual-,
expert- or data-parallel rank nor of the order in which a rank builds its modules.

Megatron-Core draws initial weights from generators seeded by pipeline and expert rank (and, on
CUDA, by tensor rank), in build order, so a model changes with its layout. `initialise_weights`
overwrites every floating tensor of a freshly built model chunk through the chunk's own
distributed-checkpoint description (`sharded_state_dict`), which names each local tensor by its
key in the one-process model, its offsets on the prepended axes (global layer index, global
expert id) and the slice of the full tensor it holds: exactly what resharding checkpoints rely on.

The random stream of a full tensor G (its shape without the prepended axes) is cut into blocks
of whole rows of its first axis, `rows_per_block = max(1, BLOCK_ELEMENTS // row size)` rows
each, a number that depends on G alone. Block b is `torch.randn` of its rows from a CPU
generator seeded by a hash of (seed, key, prepended offsets, b). A rank generates only the
blocks that overlap its rows and keeps its slice of them, so its values are exactly those of the
one-process tensor at the same positions, and its memory is its shard plus one block. A slice
along a later axis (row-parallel weights) generates full rows and keeps its columns: compute
grows with the tensor-parallel size, memory does not.

The distributions are Megatron's own (Shoeybi et al., "Megatron-LM", arXiv 1909.08053): N(0,
sigma) with the std of the config's `init_method` for embeddings, the output layer, QKV (and
multi-head latent attention's down and up projections), FC1, routers, shared-expert gates,
multi-token prediction's projections (`eh_proj`) and attention sinks (`softmax_offset`, one
logit per head, as Megatron's `init_method` draws them);
the std of `output_layer_init_method` (sigma / sqrt(2 L)) for the projections back into the
residual stream (`linear_proj`, `linear_fc2`, routed and shared experts alike). Norm weights
(MLA's latent norms among them) and biases, the expert bias included, keep their constant
construction values, which no layout changes. A floating tensor that no rule names, or that the
description does not reach, is an error rather than a tensor left layout-dependent.
"""
from __future__ import annotations

import functools
import hashlib
import math
from typing import Any, Iterator, Optional

import torch
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

BLOCK_ELEMENTS = 1 << 20
"""Elements of one generator block (4 MiB in fp32): the unit of the random stream."""

CONSTANT_SUFFIXES = ("layernorm.weight", "layer_norm_weight", "norm.weight", ".bias", "_bias")
OUTPUT_SUFFIXES = ("linear_proj.weight", "linear_fc2.weight", "fc2_latent_proj.weight")
INPUT_SUFFIXES = ("linear_qkv.weight", "linear_fc1.weight", "router.weight", "gate_weight",
                  "fc1_latent_proj.weight",
                  "output_layer.weight", "eh_proj.weight", "linear_q_proj.weight",
                  "linear_q_down_proj.weight", "linear_q_up_proj.weight",
                  "linear_kv_down_proj.weight", "linear_kv_up_proj.weight",
                  "core_attention.softmax_offset")
EMBEDDING_SUFFIXES = ("word_embeddings.weight", "position_embeddings.weight")


def normal_std(init_method: Any) -> float:
    """The std of one of Megatron's normal init methods (`init_method_normal`,
    `scaled_init_method_normal`: partials of `torch.nn.init.normal_`)."""
    if (isinstance(init_method, functools.partial) and init_method.func is torch.nn.init.normal_
            and init_method.keywords.get("mean", 0.0) == 0.0 and "std" in init_method.keywords):
        return float(init_method.keywords["std"])
    raise ValueError(f"layout-invariant initialisation needs Megatron's normal init methods "
                     f"(partials of torch.nn.init.normal_ with mean 0); got {init_method!r}")


def init_std(key: str, config: Any) -> Optional[float]:
    """The std of `key`'s normal initialisation, or None for a tensor built constant."""
    if key.endswith(CONSTANT_SUFFIXES):
        return None
    if key.endswith(OUTPUT_SUFFIXES):
        return normal_std(config.output_layer_init_method)
    if key.endswith(INPUT_SUFFIXES):
        return normal_std(config.init_method)
    if key.endswith(EMBEDDING_SUFFIXES):
        return normal_std(getattr(config, "embedding_init_method", None) or config.init_method)
    raise ValueError(f"no layout-invariant initialisation rule for parameter {key!r}; add its "
                     "suffix to megamoe.megatron.seeded_init")


def hashed_seed(*parts) -> int:
    """A 63-bit generator seed from `parts` (a hash, so nearby keys give unrelated streams)."""
    text = "/".join(map(str, parts)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


def block_seed(seed: int, key: str, unit: tuple[int, ...], block: int) -> int:
    """The generator seed of one block of the full tensor `key` at prepended offsets `unit`."""
    return hashed_seed(seed, key, ",".join(map(str, unit)), block)


def full_tensor_slice(seed: int, key: str, unit: tuple[int, ...], shape: tuple[int, ...],
                      index: tuple[slice, ...]) -> torch.Tensor:
    """`index` of the full standard-normal tensor `key` (shape `shape`, one tensor per `unit`),
    generated block by block (see the module docstring), in fp32 on the CPU."""
    if not shape:
        shape, index = (1,), (slice(0, 1),)
    row_size = math.prod(shape[1:])
    rows_per_block = max(1, BLOCK_ELEMENTS // max(row_size, 1))
    first, stop = index[0].start, index[0].stop
    pieces = []
    for block in range(first // rows_per_block, -(-stop // rows_per_block)):
        lo = block * rows_per_block
        rows = min(rows_per_block, shape[0] - lo)
        generator = torch.Generator().manual_seed(block_seed(seed, key, unit, block))
        values = torch.randn((rows, *shape[1:]), generator=generator)
        keep = slice(max(first, lo) - lo, min(stop, lo + rows) - lo)
        pieces.append(values[(keep, *index[1:])])
    return torch.cat(pieces)


def local_tensors(chunk: torch.nn.Module, metadata: Optional[dict]) -> Iterator[ShardedTensor]:
    """The ShardedTensors of a model chunk's distributed-checkpoint description, factories
    (GLU halves, stacked experts) built, in a fixed order."""
    sharded = chunk.sharded_state_dict(metadata=metadata)
    apply_factories(sharded)
    for value in nested_values(sharded):
        if isinstance(value, ShardedTensor) and torch.is_floating_point(value.data):
            yield value


@torch.no_grad()
def initialise_weights(chunks: list[torch.nn.Module], config: Any, seed: int,
                       metadata: Optional[dict] = None) -> None:
    """Overwrite every floating parameter and buffer of `chunks` (one pipeline rank's model) with
    its layout-invariant initial values for `seed` (`config`: the TransformerConfig; `metadata`:
    the model's `sharded_state_dict` metadata)."""
    for chunk in chunks:
        owners = {t.untyped_storage().data_ptr(): name for name, t in _floating_tensors(chunk)}
        # Buffers are state that starts from its constructed value (a router's expert bias or
        # expert-threshold EMA, the adaptive aux coefficient), never a random draw.
        buffers = {t.untyped_storage().data_ptr() for _, t in _floating_tensors(chunk)
                   if not isinstance(t, torch.nn.Parameter)}
        reached = set()
        for sharded in local_tensors(chunk, metadata):
            storage = sharded.data.untyped_storage().data_ptr()
            if storage not in owners:
                raise RuntimeError(f"{sharded.key}: its checkpoint description is a copy, not a "
                                   "view of a parameter, so it cannot be initialised in place")
            reached.add(storage)
            std = None if storage in buffers else init_std(sharded.key, config)
            if std is None:
                continue
            p = sharded.prepend_axis_num
            unit = tuple(sharded.global_offset[:p])
            index = tuple(slice(offset, offset + size) for offset, size in
                          zip(sharded.global_offset[p:], sharded.local_shape))
            values = full_tensor_slice(seed, sharded.key, unit, tuple(sharded.global_shape[p:]),
                                       index)
            sharded.data.copy_(values.reshape(sharded.data.shape).mul_(std))
        missing = sorted(name for ptr, name in owners.items() if ptr not in reached)
        if missing:
            raise RuntimeError(f"layout-invariant initialisation does not reach {missing}: "
                               "they are not in the model's sharded_state_dict")


def _floating_tensors(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every floating parameter and persistent buffer of `module` (state_dict's tensors)."""
    for name, tensor in module.state_dict(keep_vars=True).items():
        if isinstance(tensor, torch.Tensor) and torch.is_floating_point(tensor):
            yield name, tensor

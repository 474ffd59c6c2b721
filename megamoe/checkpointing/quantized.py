"""Quantised Hugging Face releases, dequantised one tensor at a time as they are read.

Two formats, each as the release's own reference conversion defines it:
- **FP8 with block scales** (DeepSeek-V3, Kimi-K2, MiniMax-M2; config.json `quantization_config`
  = {quant_method: fp8, fmt: e4m3, weight_block_size: [b0, b1], activation_scheme: dynamic}):
  a weight W (out x in) saved as `float8_e4m3fn` comes with `W_scale_inv` (float32, shape
  (ceil(out / b0), ceil(in / b1))), and W[i, j] = float32(W_fp8[i, j]) * scale_inv[i // b0,
  j // b1], rounded once to the asked dtype; the last row and column of blocks are partial when
  b0 / b1 do not divide the shape. This is DeepSeek-V3's `inference/fp8_cast_bf16.py`
  (`weight_dequant`: the product in fp32, stored in the output dtype).
- **MXFP4** (GPT-OSS's experts, `quant_method: mxfp4`; OCP Microscaling Formats v1.0):
  `X_blocks` (uint8 [..., R, G, 16]: blocks of 32 E2M1 values, two a byte, low nibble first)
  with `X_scales` (uint8 [..., R, G]: one E8M0 exponent a block, bias 127) hold
  value = e2m1 * 2^(scale - 127) as R x (G * 32) matrices, which are transposed into
  X [..., G * 32, R]: the layout of transformers' GPT-OSS `gate_up_proj` [E, H, 2F] and
  `down_proj` [E, F, H] (its `integrations/mxfp4.py`, `convert_moe_packed_tensors`).

`open_weights` gives a `WeightsReader`: SafetensorsReader's interface (`shapes`, `names`,
`read`, `in`) over the checkpoint with the scale tensors hidden, each quantised tensor under its
own name (`X` for `X_blocks`) and dequantised shape, read dequantised into the asked dtype, one
tensor at a time (MXFP4 one leading index, e.g. one expert, at a time), so memory holds one
tensor and its fp32 working copy. Every pair is checked when the reader opens (dtype, scale
shape, block size), a failure one line naming the tensor.
"""
from __future__ import annotations

import json
import math
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import torch

from megamoe.checkpointing.safetensors_io import FLOAT_DTYPES, SafetensorsReader, \
    ShardedSafetensorsWriter
from megamoe.checkpointing.torch_files import require_finite
from megamoe.errors import CheckpointError

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
"""The precisions an import can write (tools/import_hf.py --dtype)."""
SAVED_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
FP8_FORMATS = ("e4m3", "float8_e4m3fn")
"""`quantization_config.fmt` spellings of float8 e4m3 (DeepSeek/Kimi, MiniMax); absent = e4m3."""
MAX_BLOCK = 1 << 14
"""Largest accepted side of an FP8 scale block (released models use 128)."""
SCALE_INV = "_scale_inv"
MX_BLOCKS, MX_SCALES = "_blocks", "_scales"
MX_BLOCK_BYTES = 16
"""Bytes of one MXFP4 block: 32 E2M1 values."""
E8M0_BIAS = 127
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""E2M1 code (sign bit 3, exponent bits 2-1, mantissa bit 0) -> value."""
PACKED_DTYPES = {"fp8": ("F8_E4M3",), "mxfp4": ("U8",)}
"""Safetensors dtypes each method stores its quantised tensors in."""


@dataclass(frozen=True)
class Quantization:
    """A release's `quantization_config`, checked."""

    method: str
    """"fp8" or "mxfp4"."""
    block: Optional[tuple[int, int]] = None
    """FP8's weight_block_size (rows, columns)."""


def quantization_of(config: dict, where: Path) -> Optional[Quantization]:
    """The quantisation `config` (a config.json) declares, None when it declares none; one that
    cannot be dequantised exactly is refused in one line."""
    spec = config.get("quantization_config")
    if not spec:
        return None
    method = spec.get("quant_method") if isinstance(spec, dict) else None
    if method == "mxfp4":
        return Quantization("mxfp4")
    if method != "fp8":
        raise CheckpointError(f"{where}: the model is quantised ({method or '?'}); megamoe "
                              "dequantises fp8 block-scaled (DeepSeek-V3, Kimi-K2, MiniMax-M2) "
                              "and mxfp4 (GPT-OSS) releases; convert an unquantised "
                              "(fp32/bf16/fp16) checkpoint")
    fmt = spec.get("fmt", "e4m3")
    if fmt not in FP8_FORMATS:
        raise CheckpointError(f"{where}: quantization_config.fmt={fmt!r:.40}; only float8 e4m3 "
                              "weights are dequantised (convert an unquantised checkpoint)")
    if spec.get("activation_scheme", "dynamic") != "dynamic":
        raise CheckpointError(f"{where}: quantization_config.activation_scheme="
                              f"{spec.get('activation_scheme')!r:.40}; only 'dynamic' (no "
                              "activation scales saved) is dequantised")
    block = spec.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(
            isinstance(b, int) and not isinstance(b, bool) and 1 <= b <= MAX_BLOCK
            for b in block)):
        raise CheckpointError(f"{where}: quantization_config.weight_block_size={block!r:.60} "
                              f"must be two whole numbers from 1 to {MAX_BLOCK} (block scales; "
                              "per-tensor fp8 is not dequantised)")
    return Quantization("fp8", (block[0], block[1]))


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                   dtype: torch.dtype) -> torch.Tensor:
    """float32(weight) times the scale_inv entry of its (block[0] x block[1]) block, in `dtype`
    (module docstring); the edge blocks are cut to the shape."""
    rows, cols = weight.shape
    scale = scale_inv.float().repeat_interleave(block[0], 0)[:rows]
    scale = scale.repeat_interleave(block[1], 1)[:, :cols]
    return (weight.float() * scale).to(dtype)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
                     ) -> torch.Tensor:
    """MXFP4 `blocks` [..., R, G, 16] with E8M0 `scales` [..., R, G] as values [..., G * 32, R]
    in `dtype` (module docstring), one leading index at a time (the products are exact in
    fp32)."""
    *prefix, rows, groups, width = blocks.shape
    # byte -> its two values, low nibble first: one gather decodes a whole block row
    pairs = torch.tensor([[E2M1_VALUES[byte & 0xF], E2M1_VALUES[byte >> 4]]
                          for byte in range(256)], dtype=torch.float32)
    out = torch.empty(*prefix, groups * 2 * width, rows, dtype=dtype)
    flat_out = out.view(-1, groups * 2 * width, rows)
    flat_blocks = blocks.reshape(-1, rows, groups, width)
    flat_scales = scales.reshape(-1, rows, groups)
    for index in range(flat_blocks.shape[0]):
        values = pairs[flat_blocks[index].int()].view(rows, groups, 2 * width)
        values.mul_(torch.exp2(flat_scales[index].float() - E8M0_BIAS).unsqueeze(-1))
        flat_out[index] = values.view(rows, groups * 2 * width).t()
    return out


class WeightsReader:
    """A (possibly quantised) safetensors checkpoint with SafetensorsReader's interface, its
    quantised tensors dequantised into `dtype` as they are read (module docstring)."""

    def __init__(self, directory: Path, config: dict, dtype: Optional[torch.dtype] = None):
        where = directory / "config.json"
        self.directory, self.config = directory, config
        self.quantization = quantization_of(config, where)
        method = self.quantization.method if self.quantization else None
        self.raw = SafetensorsReader(directory, PACKED_DTYPES.get(method, ()))
        self._packed: dict[str, tuple[str, str]] = {}
        """Visible name -> (its packed tensor, its scale tensor)."""
        hidden = self._pair_fp8() if method == "fp8" else \
            self._pair_mxfp4() if method == "mxfp4" else set()
        self.shapes: dict[str, tuple[int, ...]] = {
            name: shape for name, shape in self.raw.shapes.items() if name not in hidden}
        for name in self._packed:
            self.shapes[name] = self._dequantized_shape(name)
        self.dtype = dtype or self._saved_dtype()
        """The precision dequantised tensors come in (default: `_saved_dtype`)."""
        self.held: dict[str, torch.dtype] = {}
        """Tensors an import holds in a dtype of their own, not `dtype` (set by the importer,
        e.g. DeepSeek-V3's fp32 correction biases): `write_unquantized` writes them so."""

    def stored_dtype(self, name: str) -> Optional[torch.dtype]:
        """The floating dtype tensor `name` is saved in; None for a quantised (packed) one."""
        return SAVED_DTYPES.get(self.raw.dtypes.get(name))

    def _saved_dtype(self) -> torch.dtype:
        """The dtype holding most elements among the unquantised tensors (a release's
        embeddings and output layer), bf16 (fp8_cast_bf16's) when there are none."""
        counts: dict[str, int] = {}
        for name, saved in self.raw.dtypes.items():
            if saved in FLOAT_DTYPES and name in self.shapes:
                counts[saved] = counts.get(saved, 0) + math.prod(self.raw.shapes[name])
        return SAVED_DTYPES[max(counts, key=counts.get)] if counts else torch.bfloat16

    def _fail(self, name: str, problem: str) -> CheckpointError:
        return CheckpointError(f"{self.directory}: tensor {name} {problem}; the checkpoint is "
                               "corrupt or not the release its config.json describes")

    def _pair_fp8(self) -> set[str]:
        """Pair every float8 weight with its `_scale_inv`, checked; the scale names."""
        raw, (b0, b1) = self.raw, self.quantization.block
        for name, saved in raw.dtypes.items():
            if saved != "F8_E4M3":
                continue
            scale = name + SCALE_INV
            if len(raw.shapes[name]) != 2:
                raise self._fail(name, f"is float8 of shape {raw.shapes[name]}; only 2-D "
                                       "weights carry block scales")
            rows, cols = raw.shapes[name]
            expected = (-(-rows // b0), -(-cols // b1))
            if scale not in raw.dtypes:
                raise self._fail(name, f"is float8 without its {scale}")
            if raw.dtypes[scale] != "F32" or raw.shapes[scale] != expected:
                raise self._fail(scale, f"is {raw.dtypes[scale]} of shape {raw.shapes[scale]}; "
                                        f"weight_block_size [{b0}, {b1}] over {name} "
                                        f"{(rows, cols)} needs F32 of shape {expected}")
            self._packed[name] = (name, scale)
        scales = {scale for _, scale in self._packed.values()}
        orphans = sorted(n for n in raw.dtypes if n.endswith(SCALE_INV) and n not in scales)
        if orphans:
            raise self._fail(orphans[0], "scales no float8 weight")
        return scales

    def _pair_mxfp4(self) -> set[str]:
        """Pair every `X_blocks` with its `X_scales` under the name X, checked; both names."""
        raw, hidden = self.raw, set()
        for name, saved in raw.dtypes.items():
            if saved != "U8" or name.endswith(MX_SCALES):
                continue
            if not name.endswith(MX_BLOCKS):
                raise self._fail(name, "is uint8 but neither *_blocks nor *_scales")
            base = name[:-len(MX_BLOCKS)]
            scales, shape = base + MX_SCALES, raw.shapes[name]
            if len(shape) < 3 or shape[-1] != MX_BLOCK_BYTES or 0 in shape:
                raise self._fail(name, f"has shape {shape}; MXFP4 blocks are [..., rows, "
                                       f"blocks, {MX_BLOCK_BYTES}]")
            if raw.dtypes.get(scales) != "U8" or raw.shapes[scales] != shape[:-1]:
                raise self._fail(name, f"needs {scales} as U8 of shape {shape[:-1]}")
            if base in raw.dtypes:
                raise self._fail(base, f"is saved beside {name}, which dequantises to it")
            self._packed[base] = (name, scales)
            hidden |= {name, scales}
        orphans = sorted(n for n, saved in raw.dtypes.items()
                         if saved == "U8" and n not in hidden)
        if orphans:
            raise self._fail(orphans[0], "scales no *_blocks tensor")
        return hidden

    def _dequantized_shape(self, name: str) -> tuple[int, ...]:
        packed, _ = self._packed[name]
        shape = self.raw.shapes[packed]
        if self.quantization.method == "fp8":
            return shape
        *prefix, rows, groups, width = shape
        return (*prefix, groups * 2 * width, rows)

    def __contains__(self, name: str) -> bool:
        return name in self.shapes

    def names(self) -> list[str]:
        return list(self.shapes)

    @property
    def as_saved(self) -> bool:
        """Whether the files give transformers (which reads them in fp32) the weights as held:
        nothing quantised, and each tensor held in its saved dtype or in fp32 (exact casts)."""
        return not self._packed and all(
            self.held.get(name, self.dtype) in (SAVED_DTYPES[saved], torch.float32)
            for name, saved in self.raw.dtypes.items())

    def read(self, name: str) -> torch.Tensor:
        """One tensor: a quantised one dequantised into `dtype`, any other as saved."""
        if name not in self._packed:
            if name not in self.shapes:  # a hidden scale, or a name the files lack
                raise CheckpointError(f"{self.directory} lacks tensor {name}; the checkpoint "
                                      "is incomplete or of another architecture")
            return self.raw.read(name)
        packed, scale = self._packed[name]
        data, scales = self.raw.read(packed), self.raw.read(scale)
        if self.quantization.method == "fp8":
            _check_scales(scales, f"{self.directory}: tensor {scale}")
            tensor = dequantize_fp8(data, scales, self.quantization.block, self.dtype)
        else:
            tensor = dequantize_mxfp4(data, scales, self.dtype)
        hint = " into float16 (beyond its 65504: import with --dtype bf16 or fp32)" \
            if self.dtype == torch.float16 else ""
        return require_finite(tensor, f"{self.directory}: tensor {name} dequantised{hint}")


def _check_scales(scale_inv: torch.Tensor, what: str) -> None:
    """FP8 block scales (the factors a block of weights is multiplied by) are not negative: a
    quantiser writes max|W_block| / 448, so a negative one is a corrupt file, not a weight to
    train from (non-finite ones are refused with the dequantised tensor)."""
    negative = scale_inv < 0
    if bool(negative.any()):
        index = [int(i) for i in negative.nonzero()[0]]
        raise CheckpointError(f"{what} holds {float(scale_inv[tuple(index)])!r} at {index}; "
                              "block scales are never negative: the file is corrupt, download "
                              "it again")


def open_weights(directory: Path, config: dict, dtype: Optional[torch.dtype] = None
                 ) -> WeightsReader:
    """The tensors of the Hugging Face model in `directory` whose config.json is `config`,
    dequantised into `dtype` (None: the dtype of its unquantised tensors) if it is a quantised
    release."""
    return WeightsReader(directory, config, dtype)


def write_unquantized(reader: WeightsReader, target: Path) -> None:
    """Save every tensor of `reader` as it reads it, in `reader.dtype` (`reader.held`'s in
    theirs), with its config.json less `quantization_config`: the weights an import in that
    dtype holds, as an unquantised model."""
    writer = ShardedSafetensorsWriter(target)
    for name in reader.names():
        tensor = reader.read(name)
        held = reader.held.get(name, reader.dtype)
        writer.add(name, tensor.to(held) if tensor.is_floating_point() else tensor)
    writer.finish()
    config = {key: value for key, value in reader.config.items()
              if key != "quantization_config"}
    config["dtype" if "dtype" in config else "torch_dtype"] = \
        str(reader.dtype).removeprefix("torch.")
    (target / "config.json").write_text(json.dumps(config, indent=2) + "\n")


@contextmanager
def unquantized_model(directory: Path, reader: Optional[WeightsReader]) -> Iterator[Path]:
    """A Hugging Face model directory holding the weights `reader` gives: `directory` itself
    when it reads every tensor as saved (or `reader` is None), else a temporary copy
    (`write_unquantized`) removed on exit. (transformers' own FP8 loading needs accelerate,
    and derives the block from the scale grid, rows // scale rows, which refuses or mis-scales
    partial edge blocks: 200 rows in 128-row blocks read as two blocks of 100.)"""
    if reader is None or reader.as_saved:
        yield directory
        return
    with tempfile.TemporaryDirectory(prefix="megamoe-dequantized-") as tmp:
        write_unquantized(reader, Path(tmp))
        yield Path(tmp)

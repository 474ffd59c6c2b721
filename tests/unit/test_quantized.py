"""Quantised releases dequantised as they are read (megamoe.checkpointing.quantized), against
dequantisations written here element by element from the formats' definitions: DeepSeek-V3's
fp8_cast_bf16.py (float32 product of the e4m3 value and its block's scale_inv, then the cast;
partial edge blocks) and OCP MXFP4 (E2M1 nibbles decoded from their bits, low nibble first,
times 2^(E8M0 - 127)); plus transformers' own GPT-OSS conversion for MXFP4's output layout, and
the reader's refusals of corrupt pairs."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from megamoe.checkpointing.quantized import (DTYPES, dequantize_fp8, dequantize_mxfp4,
                                             open_weights, quantization_of)
from megamoe.errors import CheckpointError

FP8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [16, 24],
       "activation_scheme": "dynamic"}


def naive_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
              dtype: torch.dtype) -> torch.Tensor:
    """Element by element: fp32(w[i, j]) * scale_inv[i // b0][j // b1] in fp32, then dtype."""
    values = weight.float().tolist()
    scales = scale_inv.tolist()
    out = [[np.float32(values[i][j]) * np.float32(scales[i // block[0]][j // block[1]])
            for j in range(weight.shape[1])] for i in range(weight.shape[0])]
    return torch.tensor(np.array(out, dtype=np.float32)).to(dtype)


def e2m1(code: int) -> float:
    """An E2M1 code's value from its bits: sign 3, exponent 2-1 (bias 1), mantissa 0."""
    sign = -1.0 if code & 8 else 1.0
    exponent, mantissa = (code >> 1) & 3, code & 1
    magnitude = mantissa * 0.5 if exponent == 0 else (1 + mantissa / 2) * 2.0 ** (exponent - 1)
    return sign * magnitude


def naive_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[E, R, G, 16] bytes, [E, R, G] exponents -> [E, G * 32, R]: value k of block g of row r
    (byte k // 2, low nibble for even k) at column g * 32 + k, transposed."""
    experts, rows, groups, width = blocks.shape
    out = torch.zeros(experts, groups * 2 * width, rows, dtype=torch.float64)
    for e in range(experts):
        for r in range(rows):
            for g in range(groups):
                scale = 2.0 ** (int(scales[e, r, g]) - 127)
                for k in range(2 * width):
                    byte = int(blocks[e, r, g, k // 2])
                    code = byte & 0xF if k % 2 == 0 else byte >> 4
                    out[e, g * 2 * width + k, r] = e2m1(code) * scale
    return out


def quantize_fp8(weight: torch.Tensor, block: tuple[int, int]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, fp32 scale_inv per block) as DeepSeek quantises: each block scaled so its
    largest magnitude is e4m3's 448 (the scale a power of two times a random factor, so the
    products are not trivially exact)."""
    rows, cols = weight.shape
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    scale = torch.empty(grid)
    quantized = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(grid[0]):
        for j in range(grid[1]):
            part = weight[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]]
            scale[i, j] = part.abs().max().clamp(min=1e-12) / 448.0
            quantized[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]] = (
                part / scale[i, j]).to(torch.float8_e4m3fn)
    return quantized, scale


@pytest.mark.parametrize("shape,block", [((37, 45), (16, 24)), ((32, 48), (16, 24)),
                                         ((5, 130), (128, 128)), ((1, 1), (3, 7))])
@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_fp8_block_dequantisation_is_deepseeks(shape, block, dtype):
    torch.manual_seed(0)
    weight, scale = quantize_fp8(torch.randn(shape) * 3, block)
    ours = dequantize_fp8(weight, scale, block, DTYPES[dtype])
    reference = naive_fp8(weight, scale, block, DTYPES[dtype])
    assert ours.dtype == DTYPES[dtype] and torch.equal(ours, reference)


def test_mxfp4_dequantisation_is_the_format_and_gpt_oss_layout():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    generator = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (2, 6, 3, 16), dtype=torch.uint8, generator=generator)
    scales = torch.randint(110, 140, (2, 6, 3), dtype=torch.uint8, generator=generator)
    ours = dequantize_mxfp4(blocks, scales, torch.float32)
    assert ours.shape == (2, 96, 6)
    assert torch.equal(ours.double(), naive_mxfp4(blocks, scales))
    assert torch.equal(ours, convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.bfloat16), ours.bfloat16())


def _save(folder: Path, tensors: dict, quantization: dict | None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    config = {"model_type": "deepseek_v3"}
    if quantization is not None:
        config["quantization_config"] = quantization
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _fp8_checkpoint(folder: Path, **replace) -> tuple[Path, dict]:
    torch.manual_seed(1)
    weight, scale = quantize_fp8(torch.randn(37, 45), (16, 24))
    tensors = {"embed.weight": torch.randn(50, 8, dtype=torch.bfloat16),
               "norm.weight": torch.ones(8, dtype=torch.float32),
               "proj.weight": weight, "proj.weight_scale_inv": scale, **replace}
    tensors = {name: t for name, t in tensors.items() if t is not None}
    return _save(folder, tensors, FP8), tensors


def _open(folder: Path, dtype=None):
    return open_weights(folder, json.loads((folder / "config.json").read_text()), dtype)


def test_the_reader_hides_scales_and_streams_dequantised_tensors(tmp_path):
    folder, saved = _fp8_checkpoint(tmp_path / "ok")
    reader = _open(folder)
    assert sorted(reader.names()) == ["embed.weight", "norm.weight", "proj.weight"]
    assert "proj.weight_scale_inv" not in reader and reader.shapes["proj.weight"] == (37, 45)
    assert reader.dtype == torch.bfloat16  # the unquantised tensors' (most elements)
    expected = naive_fp8(saved["proj.weight"], saved["proj.weight_scale_inv"], (16, 24),
                         torch.bfloat16)
    assert torch.equal(reader.read("proj.weight"), expected)
    assert reader.read("norm.weight").dtype == torch.float32  # unquantised: as saved
    as_fp32 = _open(folder, torch.float32)
    assert torch.equal(as_fp32.read("proj.weight"),
                       naive_fp8(saved["proj.weight"], saved["proj.weight_scale_inv"],
                                 (16, 24), torch.float32))
    with pytest.raises(CheckpointError, match="lacks tensor proj.weight_scale_inv"):
        reader.read("proj.weight_scale_inv")


def test_the_reader_names_gpt_oss_experts_by_their_dequantised_shape(tmp_path):
    generator = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (2, 8, 2, 16), dtype=torch.uint8, generator=generator)
    scales = torch.randint(120, 130, (2, 8, 2), dtype=torch.uint8, generator=generator)
    name = "model.layers.0.mlp.experts.gate_up_proj"
    folder = _save(tmp_path / "mx", {f"{name}_blocks": blocks, f"{name}_scales": scales,
                                     f"{name}_bias": torch.zeros(2, 8, dtype=torch.bfloat16)},
                   {"quant_method": "mxfp4"})
    reader = _open(folder)
    assert sorted(reader.names()) == [name, f"{name}_bias"] and reader.shapes[name] == (2, 64, 8)
    assert torch.equal(reader.read(name).double(),
                       naive_mxfp4(blocks, scales).to(torch.bfloat16).double())


def test_the_verify_reference_holds_what_the_import_holds(tmp_path):
    """unquantized_model: the files themselves when they hold the weights as imported, else a
    temporary unquantised copy in the import's dtype (held tensors in theirs), no scales, no
    quantization_config."""
    from safetensors.torch import load_file

    from megamoe.checkpointing.quantized import unquantized_model

    folder, saved = _fp8_checkpoint(tmp_path / "q")
    reader = _open(folder, torch.float16)
    reader.held = {"norm.weight": torch.float32}
    with unquantized_model(folder, reader) as copy:
        assert copy != folder
        tensors = load_file(str(next(copy.glob("*.safetensors"))))
        config = json.loads((copy / "config.json").read_text())
    assert not copy.exists() and "quantization_config" not in config
    assert config["torch_dtype"] == "float16" and sorted(tensors) == sorted(reader.names())
    assert torch.equal(tensors["proj.weight"], naive_fp8(
        saved["proj.weight"], saved["proj.weight_scale_inv"], (16, 24), torch.float16))
    assert tensors["embed.weight"].dtype == torch.float16
    assert torch.equal(tensors["norm.weight"], saved["norm.weight"])
    plain = _save(tmp_path / "plain", {"a": torch.ones(2, dtype=torch.bfloat16)}, None)
    for dtype, copied in ((None, False), (torch.float32, False), (torch.float16, True)):
        with unquantized_model(plain, _open(plain, dtype)) as directory:
            assert (directory != plain) == copied


@pytest.mark.parametrize("replace,match", [
    ({"proj.weight_scale_inv": torch.ones(2, 2)}, r"proj.weight_scale_inv is F32 of shape "
                                                   r"\(2, 2\).*needs F32 of shape \(3, 2\)"),
    ({"proj.weight_scale_inv": torch.ones(3, 2, dtype=torch.bfloat16)}, "is BF16"),
    ({"proj.weight_scale_inv": None}, "proj.weight is float8 without its proj.weight_scale_inv"),
    ({"other.weight_scale_inv": torch.ones(1, 1)}, "other.weight_scale_inv scales no float8"),
    ({"proj.weight": torch.zeros(2, 3, 4, dtype=torch.float8_e4m3fn)}, "only 2-D weights"),
    ({"proj.weight": torch.zeros(37, 45, dtype=torch.float8_e5m2)}, "F8_E5M2"),
    ({"proj.weight_scale_inv": torch.full((3, 2), float("inf"))}, "NaN/Inf"),
    ({"proj.weight_scale_inv": torch.tensor([[1.0, 1.0], [1.0, -0.5], [1.0, 1.0]])},
     r"proj.weight_scale_inv holds -0.5 at \[1, 1\]; block scales are never negative"),
])
def test_corrupt_fp8_pairs_are_one_line_naming_the_tensor(tmp_path, replace, match):
    folder, _ = _fp8_checkpoint(tmp_path / "bad", **replace)
    with pytest.raises(CheckpointError, match=match) as err:
        _open(folder).read("proj.weight")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("spec,match", [
    ({"quant_method": "gptq", "bits": 4}, r"quantised \(gptq\).*convert an unquantised"),
    ({**FP8, "fmt": "e5m2"}, "fmt='e5m2'"),
    ({**FP8, "weight_block_size": [0, 128]}, "weight_block_size"),
    ({**FP8, "weight_block_size": [128, 1 << 20]}, "weight_block_size"),
    ({**FP8, "weight_block_size": None}, "per-tensor"),
    ({**FP8, "activation_scheme": "static"}, "activation_scheme='static'"),
    ("fp8", r"quantised \(\?\)"),
])
def test_quantisation_configs_that_cannot_be_dequantised_are_refused(spec, match):
    with pytest.raises(CheckpointError, match=match):
        quantization_of({"quantization_config": spec}, Path("config.json"))


SCALARS = (st.none() | st.booleans() | st.integers(-2, 2 ** 70) | st.floats() |
           st.text(max_size=12) | st.sampled_from(["fp8", "mxfp4", "e4m3", "dynamic"]))
SPEC = st.dictionaries(st.sampled_from(["quant_method", "fmt", "weight_block_size",
                                        "activation_scheme"]),
                       SCALARS | st.lists(SCALARS, max_size=3), max_size=4)


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(spec=SPEC | SCALARS)
def test_any_quantization_config_reads_or_is_one_line(spec):
    try:
        found = quantization_of({"quantization_config": spec}, Path("config.json"))
    except CheckpointError as err:
        assert "\n" not in str(err) and len(str(err)) < 400
        return
    assert found is None or found.method == "mxfp4" or (
        found.method == "fp8" and all(1 <= b <= 1 << 14 for b in found.block))


def test_mxfp4_blocks_without_their_scales_are_refused(tmp_path):
    blocks = torch.zeros(2, 8, 2, 16, dtype=torch.uint8)
    folder = _save(tmp_path / "mx", {"w_blocks": blocks, "w_scales": torch.zeros(
        2, 8, 3, dtype=torch.uint8)}, {"quant_method": "mxfp4"})
    with pytest.raises(CheckpointError, match=r"w_blocks needs w_scales as U8 of shape "
                                              r"\(2, 8, 2\)"):
        _open(folder)

"""GPT-OSS as it ships: its experts in MXFP4 (`*_blocks` / `*_scales`, quantization_config
mxfp4). A tiny transformers GPT-OSS has its experts replaced by random MXFP4 tensors; the
unquantised twin holds the same weights dequantised by the format's definition, written out here
(OCP Microscaling Formats v1.0: E2M1 values, two a byte, low nibble first, times 2^(E8M0 - 127);
GPT-OSS stores each expert's matrix output-major, [out, in / 32 blocks, 16 bytes]). The import of
the quantised model reproduces transformers' logits (--verify) and exports back exactly the
twin's tensors."""
from __future__ import annotations

import json

import pytest
import torch

from hf_models import save_tiny_hf_model

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
EXPERTS = ("gate_up_proj", "down_proj")


def dequantized(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[E, R, G, 16] bytes and [E, R, G] exponents -> the [E, G * 32, R] weights (row r of the
    output-major matrix is column r here, transformers' input-major expert layout)."""
    codes = torch.stack([blocks & 0xF, blocks >> 4], dim=-1).flatten(-2).long()  # low first
    values = torch.tensor(E2M1, dtype=torch.float64)[codes]
    values = values * torch.pow(2.0, scales.double() - 127).unsqueeze(-1)
    return values.flatten(-2).transpose(1, 2).float().contiguous()


def _tensors(directory):
    from safetensors.torch import load_file

    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(path)))
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(quantised model dir, unquantised twin dir)."""
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    twin = save_tiny_hf_model("gpt_oss", root / "twin", shard_size=None, tokenizer=True)
    tensors = _tensors(twin)
    generator = torch.Generator().manual_seed(0)
    quantized = {}
    for name in list(tensors):
        if not name.endswith(EXPERTS):
            quantized[name] = tensors[name]
            continue
        E, inner, outer = tensors[name].shape  # [E, in, out] in transformers' layout
        blocks = torch.randint(0, 256, (E, outer, inner // 32, 16), dtype=torch.uint8,
                               generator=generator)
        scales = torch.randint(118, 125, (E, outer, inner // 32), dtype=torch.uint8,
                               generator=generator)
        quantized[name + "_blocks"], quantized[name + "_scales"] = blocks, scales
        tensors[name] = dequantized(blocks, scales)
    save_file(tensors, str(twin / "model.safetensors"), metadata={"format": "pt"})
    quant = root / "quantized"
    quant.mkdir()
    for path in twin.iterdir():
        if path.suffix != ".safetensors":
            (quant / path.name).write_bytes(path.read_bytes())
    save_file(quantized, str(quant / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((twin / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
        "lm_head"]}
    (quant / "config.json").write_text(json.dumps(config))
    return quant, twin


def test_mxfp4_import_reproduces_transformers_and_exports_the_dequantised_twin(models,
                                                                              tmp_path):
    from megamoe.interop.hf_export import export_hf
    from megamoe.interop.hf_import import import_hf

    quant, twin = models
    diff = import_hf(quant, tmp_path / "imported", verify=True, progress=False,
                     log=lambda line: None)
    assert diff <= 1e-4
    export_hf(tmp_path / "imported", tmp_path / "back", arch="gpt_oss", log=lambda line: None)
    back, expected = _tensors(tmp_path / "back"), _tensors(twin)
    assert sorted(back) == sorted(expected)
    assert [name for name in expected if not torch.equal(back[name], expected[name])] == []
    assert "quantization_config" not in json.loads((tmp_path / "back" / "config.json")
                                                   .read_text())

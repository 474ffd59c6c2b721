"""A DeepSeek-V3 release as it ships, FP8 with block scales, imported and exported: a tiny
transformers DeepSeek-V3 with a multi-token-prediction layer (tests/hf_models.py
add_mtp_tensors), whose linear weights this test quantises to float8 e4m3 with
`weight_scale_inv` per 16 x 24 block (no weight a multiple of the block: partial edge blocks) and
`quantization_config` in its config.json, imported with tools/import_hf.py --verify
(transformers on the dequantised weights), then exported: every tensor comes back equal, bit for
bit in the chosen dtype, to this test's own dequantisation (the unquantised ones to the source's),
the scales gone, and the config.json the source's without `quantization_config`."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
import torch  # noqa: E402
import warm_launcher  # noqa: E402
from hf_models import (add_mtp_tensors, save_tiny_hf_model, saved_config,  # noqa: E402
                       saved_tensors)

REPO = Path(__file__).resolve().parents[2]
BAR = 1e-4
BLOCK = (16, 24)
FP8_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
              "weight_block_size": list(BLOCK)}
QUANTISED = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj",
             "up_proj", "down_proj", "eh_proj")
"""The linear layers DeepSeek-V3's release stores in FP8, its multi-token-prediction layer's
included (not embeddings, heads, norms, router)."""
E4M3_MAX = 448.0


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, fp32 scale_inv) with each block's largest magnitude at e4m3's 448."""
    rows, cols = weight.shape
    scale = torch.empty(-(-rows // BLOCK[0]), -(-cols // BLOCK[1]))
    quantized = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            rows_, cols_ = slice(i * BLOCK[0], (i + 1) * BLOCK[0]), slice(j * BLOCK[1],
                                                                          (j + 1) * BLOCK[1])
            scale[i, j] = weight[rows_, cols_].abs().max() / E4M3_MAX
            quantized[rows_, cols_] = (weight[rows_, cols_] / scale[i, j]).to(torch.float8_e4m3fn)
    return quantized, scale


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype
               ) -> torch.Tensor:
    """fp8_cast_bf16.py's rule, by indexing: element (i, j) times scale_inv[i // 16, j // 24]
    in fp32, then `dtype`."""
    rows = torch.arange(weight.shape[0]) // BLOCK[0]
    cols = torch.arange(weight.shape[1]) // BLOCK[1]
    return (weight.float() * scale_inv[rows][:, cols]).to(dtype)


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory) -> Path:
    """The tiny DeepSeek-V3 with a multi-token-prediction layer, saved (sharded) in the FP8
    block-scaled format."""
    from safetensors.torch import load_file, save_file

    hf = add_mtp_tensors(save_tiny_hf_model("deepseek_v3", tmp_path_factory.mktemp("fp8") / "hf",
                                            tokenizer=True))
    index_path = hf / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    for shard in sorted(set(index["weight_map"].values())):
        tensors = {}
        for name, tensor in load_file(str(hf / shard)).items():
            if name.split(".")[-2] in QUANTISED:
                tensors[name], tensors[name + "_scale_inv"] = quantize(tensor)
                index["weight_map"][name + "_scale_inv"] = shard
            else:
                tensors[name] = tensor
        save_file(tensors, str(hf / shard), metadata={"format": "pt"})
    index_path.write_text(json.dumps(index))
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "quantization_config": FP8_CONFIG}))
    return hf


def _expected(source: dict, dtype: torch.dtype) -> dict:
    """The source's tensors as an import in `dtype` holds them: FP8 ones dequantised, the
    correction biases as saved (fp32: megamoe's loss-free balancing bias), the rest cast."""
    def held(name: str, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dtype == torch.float8_e4m3fn:
            return dequantize(tensor, source[name + "_scale_inv"], dtype)
        return tensor if name.endswith("e_score_correction_bias") else tensor.to(dtype)

    return {name: held(name, tensor) for name, tensor in source.items()
            if not name.endswith("_scale_inv")}


def _run(*args: str) -> subprocess.CompletedProcess:
    return warm_launcher.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True,
                             timeout=300)


@pytest.mark.parametrize("dtype", ["default", "bf16"])
def test_fp8_release_imports_verified_and_exports_dequantised(fp8_model, dtype, tmp_path):
    """The import with --verify (transformers on the dequantised weights; --dtype through the
    command line), then the export (with its own --verify): each tensor equals this test's
    dequantisation, bit for bit."""
    source = saved_tensors(fp8_model)
    quantised = [name for name, t in source.items() if t.dtype == torch.float8_e4m3fn]
    assert len(quantised) > 20 and any(  # partial edge blocks
        t.shape[0] % BLOCK[0] or t.shape[1] % BLOCK[1] for t in map(source.get, quantised))
    from megamoe.interop.hf_export import export_hf
    from megamoe.interop.hf_import import import_hf

    if dtype == "default":  # in process (the command line's start-up once is enough)
        diff = import_hf(fp8_model, tmp_path / "imported", verify=True, progress=False,
                         log=lambda line: None)
    else:
        done = _run("tools/import_hf.py", "--load", str(fp8_model), "--save",
                    str(tmp_path / "imported"), "--verify", "--no-progress", "--dtype", dtype)
        assert done.returncode == 0, done.stderr[-3000:]
        diff = float(done.stdout.split("transformers vs megamoe: ")[1].split()[0])
    assert diff <= BAR

    result = export_hf(tmp_path / "imported", tmp_path / "back", verify=True,
                       log=lambda line: None)
    assert result.max_logit_diff <= BAR
    expected = _expected(source, torch.float32 if dtype == "default" else torch.bfloat16)
    back = saved_tensors(tmp_path / "back")
    assert sorted(back) == sorted(expected)
    different = [name for name in expected if not (back[name].dtype == expected[name].dtype and
                                                   torch.equal(back[name], expected[name]))]
    assert not different, different[:3]
    source_config = saved_config(fp8_model)
    del source_config["quantization_config"]
    assert saved_config(tmp_path / "back") == source_config


def _refused(hf: Path, out: Path, field: str) -> None:
    done = _run("tools/import_hf.py", "--load", str(hf), "--save", str(out), "--no-progress")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and field in lines[0], done.stderr
    assert not out.exists()


def test_corrupt_scales_and_block_sizes_are_one_line_naming_them(fp8_model, tmp_path):
    """A scale tensor of the wrong shape, a weight_block_size of 0: exit code 2, one line
    naming the tensor or the field, nothing written."""
    import shutil

    from safetensors.torch import load_file, save_file

    hf = tmp_path / "hf"
    shutil.copytree(fp8_model, hf)
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    name = "model.layers.1.self_attn.o_proj.weight_scale_inv"  # (4, 3) scales
    shard = hf / index["weight_map"][name]
    tensors = load_file(str(shard))
    tensors[name] = tensors[name][:, :1].contiguous()
    save_file(tensors, str(shard), metadata={"format": "pt"})
    _refused(hf, tmp_path / "out", name)
    config = json.loads((fp8_model / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [0, 24]
    (hf / "config.json").write_text(json.dumps(config))
    _refused(hf, tmp_path / "out", "weight_block_size")

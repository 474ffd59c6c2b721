"""Fuzzed import inputs, in-process (hypothesis; few examples under CI=true): a Hugging Face
`config.json`, a safetensors header, a safetensors index and instruction jsonl either read or
raise the package's one-line error types, never anything else (no traceback, no hang, no
allocation driven by a size in the input)."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from ckpt_fault_helpers import QUICK
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from megamoe.checkpointing.hf_arch import read_hf_arch
from megamoe.checkpointing.safetensors_io import INDEX_FILE, SINGLE_FILE, SafetensorsReader
from megamoe.errors import CheckpointError, DataError
from megamoe.instruct.dataset import read_records

FUZZ = settings(max_examples=20 if QUICK else 100, deadline=None, derandomize=QUICK,
                suppress_health_check=[HealthCheck.function_scoped_fixture])
SCALARS = (st.none() | st.booleans() | st.integers() | st.integers(-2, 2 ** 70) |
           st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12))
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) |
                    st.dictionaries(st.text(max_size=12), inner, max_size=4), max_leaves=10)
LLAMA = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64,
         "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
         "vocab_size": 256, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
         "max_position_embeddings": 128}


def one_line(err: Exception) -> None:
    assert "\n" not in str(err) and len(str(err)) < 1000, str(err)[:2000]


@FUZZ
@given(changes=st.dictionaries(st.sampled_from(sorted(LLAMA) + ["head_dim", "rope_scaling",
                                                                  "rope_parameters",
                                                                  "quantization_config",
                                                                  "hidden_act"]),
                               JSON, max_size=3))
def test_hugging_face_config_json(changes, tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf")
    (folder / "config.json").write_text(json.dumps({**LLAMA, **changes}))
    try:
        arch = read_hf_arch(folder)
    except CheckpointError as err:
        one_line(err)
        return
    assert 1 <= arch.num_layers <= 4096 and 1 <= arch.hidden_size <= 1 << 17
    assert arch.num_attention_heads % arch.num_key_value_heads == 0


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("st") / SINGLE_FILE
    save_file({"a.weight": torch.ones(4, 3), "b.weight": torch.zeros(2)}, str(path))
    return path.read_bytes()


@FUZZ
@given(header=JSON.map(lambda v: json.dumps(v).encode()) | st.binary(max_size=80),
       declared=st.none() | st.integers(0, 2 ** 64 - 1), keep_data=st.booleans())
def test_safetensors_header(weights, header, declared, keep_data, tmp_path_factory):
    """A header of any bytes, a declared header size of any value."""
    folder = tmp_path_factory.mktemp("st")
    size = len(header) if declared is None else declared
    data = weights[8 + struct.unpack("<Q", weights[:8])[0]:] if keep_data else b""
    (folder / SINGLE_FILE).write_bytes(struct.pack("<Q", size) + header + data)
    try:
        reader = SafetensorsReader(folder)
        for name in reader.names():
            reader.read(name)
    except CheckpointError as err:
        one_line(err)


@FUZZ
@given(index=JSON.map(lambda v: json.dumps(v).encode()) | st.binary(max_size=80) |
       st.dictionaries(st.text(max_size=8), st.sampled_from(
           [SINGLE_FILE, "../x.safetensors", "/etc/passwd", "", "sub/../model.safetensors"]),
           max_size=3).map(lambda m: json.dumps({"weight_map": m}).encode()))
def test_safetensors_index(weights, index, tmp_path_factory):
    folder = tmp_path_factory.mktemp("index")
    (folder / SINGLE_FILE).write_bytes(weights)
    (folder / INDEX_FILE).write_bytes(index)
    try:
        reader = SafetensorsReader(folder)
    except CheckpointError as err:
        one_line(err)
        return
    assert set(reader.shard_of.values()) <= {SINGLE_FILE, "sub/../model.safetensors"}


RECORD = st.fixed_dictionaries({"prompt": st.text(max_size=8), "response": st.text(max_size=8)},
                               optional={"task": JSON, "messages": JSON})


@FUZZ
@given(lines=st.lists(RECORD.map(lambda r: json.dumps(r).encode()) | st.binary(max_size=60) |
                      JSON.map(lambda v: json.dumps(v).encode()), min_size=1, max_size=4))
def test_instruction_jsonl(lines, tmp_path_factory):
    path = Path(tmp_path_factory.mktemp("jsonl")) / "data.jsonl"
    path.write_bytes(b"\n".join(line.replace(b"\n", b" ") for line in lines) + b"\n")
    try:
        records = read_records(path)
    except DataError as err:
        one_line(err)
        return
    assert all(record.response for record in records)

"""Hostile and careless inputs through the CLIs, as an attacker or a hurried user would send
them. Every class ends in one line on stderr and exit code 2 (or the documented outcome), fast,
in bounded memory, with nothing written over what was read:

1. tools whose output overlaps their input;      5. bombs and absurd sizes;
2. integrity: storage files outside the folder,   6. two runs on one output directory;
   corrupt newest checkpoints;                    7. SIGINT, leftover temporary folders, an
3. links and index entries that leave a folder;      output_dir that is a file;
4. non-finite settings and parameters;            8. NaN in imported weights.

Training cases use the tiny model of the cross-version fixtures (18k parameters, one process).
The time and peak memory of each rejection is printed (`pytest -s` shows them)."""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from ckpt_fault_helpers import REPO, assert_one_line_error, env, run

from megamoe.checkpointing.manifest import write_manifest
from megamoe.checkpointing.safe_dcp import METADATA_FILE, read_dcp_metadata
from megamoe.train.checkpoint import checkpoint_problem

FIXTURES = REPO / "tests" / "fixtures" / "mcore_checkpoints"
DATA = FIXTURES / "data" / "synthetic"


def fixture_train_args(out: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "megamoe.train", "--config", str(FIXTURES / "config.yaml"),
            f"output_dir={out}", f"data.prefixes=[{DATA}]", f"data.tokenizer_model={DATA}.model",
            f"data.cache_dir={out.parent / 'cache'}", *overrides]


def fixture_train(out: Path, *overrides: str) -> subprocess.CompletedProcess:
    return run(fixture_train_args(out, *overrides))


def tree_digest(path: Path) -> str:
    """A digest of every file under `path` (names and bytes)."""
    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        digest.update(str(file.relative_to(path)).encode())
        digest.update(file.read_bytes())
    return digest.hexdigest()


def measured(args: list[str]) -> tuple[subprocess.CompletedProcess, str]:
    """Run a CLI; (result, "seconds, peak resident memory of that process")."""
    with open(os.devnull, "rb") as stdin, tempfile.TemporaryFile("w+") as out, \
            tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        process = subprocess.Popen(args, cwd=REPO, env=env(), stdin=stdin, stdout=out,
                                   stderr=err, text=True)
        _, status, usage = os.wait4(process.pid, 0)
        seconds = time.perf_counter() - start
        process.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        done = subprocess.CompletedProcess(args, process.returncode, out.read(), err.read())
    return done, f"{seconds:.1f} s, peak RSS {usage.ru_maxrss / 1024:.0f} MiB"


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory) -> Path:
    from hf_models import save_tiny_hf_model

    return save_tiny_hf_model("llama", tmp_path_factory.mktemp("hf") / "llama", shard_size=None)


def copy_of(source: Path, target: Path) -> Path:
    shutil.copytree(source, target, symlinks=True)
    return target


@pytest.fixture(scope="module")
def moe_checkpoint(hf_model, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("moe") / "moe"
    done = run([sys.executable, "tools/upcycle_ckpt.py", "--load", str(hf_model), "--save",
                str(out), "--num-experts", "4", "--topk", "2", "--no-progress"])
    assert done.returncode == 0, done.stderr[-3000:]
    return out


# ---- 1. tools never write over what they read -----------------------------------------

def test_tools_refuse_an_output_that_overlaps_their_input(hf_model, moe_checkpoint, tmp_path):
    hf = copy_of(hf_model, tmp_path / "hf")
    moe = copy_of(moe_checkpoint, tmp_path / "moe")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "docs.idx").write_text("not really an index\n")
    attacks = {
        "dense conversion onto itself": ["tools/upcycle_ckpt.py", "--load", str(hf), "--save",
                                         str(hf), "--dense", "--overwrite"],
        "upcycling into its input": ["tools/upcycle_ckpt.py", "--load", str(hf), "--save",
                                     str(hf / "moe"), "--num-experts", "4", "--topk", "2"],
        "export onto its input": ["tools/export_hf.py", "--load", str(moe), "--save", str(moe),
                                  "--overwrite"],
        "export onto the input's parent": ["tools/export_hf.py", "--load",
                                           str(moe / "checkpoints"), "--save", str(moe),
                                           "--overwrite"],
        "DeepSpeed import onto its input": ["tools/import_deepspeed_moe.py", "--load", str(moe),
                                            "--save", str(moe), "--topk", "2", "--overwrite"],
        "preprocessing over its input": ["tools/preprocess_data.py", "--input",
                                         str(corpus / "docs.idx"), "--output-prefix",
                                         str(corpus / "docs"), "--train-tokenizer",
                                         "--vocab-size", "300", "--overwrite"],
    }
    before = {path: tree_digest(path) for path in (hf, moe, corpus)}
    for name, args in attacks.items():
        done = run([sys.executable, *args])
        assert_one_line_error(done, "the tool would write over what it reads")
        assert {path: tree_digest(path) for path in before} == before, name


# ---- 2. integrity covers every file a load reads ----------------------------------------

@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """The fixture model after 4 steps, checkpoints at steps 2 and 4."""
    out = tmp_path_factory.mktemp("trained") / "run"
    done = fixture_train(out, "training.train_steps=4", "checkpoint.interval=2")
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def test_metadata_naming_storage_outside_the_folder_is_refused(trained, tmp_path):
    """The attacker moves a data file out of the checkpoint, points `.metadata` at it and
    recomputes the manifest (which lists only the folder's files): the resume refuses."""
    out = copy_of(trained, tmp_path / "run")
    folder = out / "checkpoints" / "iter_0000004"
    metadata = read_dcp_metadata(folder / METADATA_FILE)
    data_file = sorted(folder.glob("*.distcp"))[0]
    outside = tmp_path / "elsewhere.distcp"
    shutil.move(data_file, outside)
    for info in metadata.storage_data.values():
        if info.relative_path == data_file.name:
            info.relative_path = os.path.relpath(outside, folder)
    with open(folder / METADATA_FILE, "wb") as f:
        pickle.dump(metadata, f)
    write_manifest(folder)
    done = fixture_train(out, "training.train_steps=6")
    assert_one_line_error(done, "points outside the folder")
    absolute = copy_of(trained, tmp_path / "absolute")
    folder = absolute / "checkpoints" / "iter_0000004"
    for info in metadata.storage_data.values():
        info.relative_path = str(outside)
    with open(folder / METADATA_FILE, "wb") as f:
        pickle.dump(metadata, f)
    write_manifest(folder)
    assert_one_line_error(fixture_train(absolute, "training.train_steps=6"),
                          "points outside the folder")


def _corrupt(folder: Path) -> None:
    data_file = sorted(folder.glob("*.distcp"))[0]
    raw = bytearray(data_file.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data_file.write_bytes(bytes(raw))


def test_resume_from_verified_rewrites_a_corrupt_newest_checkpoint(trained, tmp_path):
    out = copy_of(trained, tmp_path / "run")
    _corrupt(out / "checkpoints" / "iter_0000004")
    done = fixture_train(out, "training.train_steps=6", "checkpoint.interval=2",
                         "checkpoint.resume_from_verified=true")
    assert done.returncode == 0, done.stderr[-3000:]
    ckpts = out / "checkpoints"
    assert f"replaced checkpoint {ckpts / 'iter_0000004'}" in done.stdout
    assert (ckpts / "latest_checkpointed_iteration.txt").read_text().strip() == "6"
    for name in ("iter_0000002", "iter_0000004", "iter_0000006"):
        assert checkpoint_problem(ckpts / name) is None, name


def test_a_finished_run_verifies_its_newest_checkpoint(trained, tmp_path):
    out = copy_of(trained, tmp_path / "run")
    _corrupt(out / "checkpoints" / "iter_0000004")
    done = fixture_train(out, "training.train_steps=4")
    assert_one_line_error(done, "iter_0000004", "checksum", "iter_0000002")
    assert "nothing to do" not in done.stdout


# ---- 3. nothing outside an input folder is read or copied -------------------------------

def test_links_and_index_entries_leaving_the_folder_are_refused(hf_model, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("private\n")
    linked = copy_of(hf_model, tmp_path / "linked")
    (linked / "tokenizer.json").symlink_to(secret)
    done = run([sys.executable, "tools/upcycle_ckpt.py", "--load", str(linked), "--save",
                str(tmp_path / "out"), "--num-experts", "4", "--topk", "2"])
    assert_one_line_error(done, "tokenizer.json", "points outside the folder")
    assert not (tmp_path / "out").exists()
    indexed = copy_of(hf_model, tmp_path / "indexed")
    shutil.move(indexed / "model.safetensors", tmp_path / "outside.safetensors")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "outside.safetensors"), framework="pt") as handle:
        names = list(handle.keys())
    for target in ("../outside.safetensors", str(tmp_path / "outside.safetensors")):
        (indexed / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": {name: target for name in names}}))
        done = run([sys.executable, "tools/upcycle_ckpt.py", "--load", str(indexed), "--save",
                    str(tmp_path / "out"), "--dense"])
        assert_one_line_error(done, "points outside the folder")
        assert not (tmp_path / "out").exists()


# ---- 4. non-finite settings and parameters ---------------------------------------------

SETTINGS = ["optimizer.lr=.inf", "optimizer.lr=-.inf", "optimizer.lr=.nan",
            "moe.balancing.bias_update_rate=.nan", "optimizer.lr=1e400",
            "training.train_steps=1e400", f"training.train_steps={10 ** 30}",
            "training.train_steps=" + "9" * 10_000]


def test_non_finite_and_out_of_range_settings_are_refused(tmp_path):
    from megamoe.errors import ConfigError
    from megamoe.train.config import load_config

    for override in SETTINGS:
        with pytest.raises(ConfigError, match=override.split("=")[0]) as raised:
            load_config(FIXTURES / "config.yaml", [override])
        assert len(str(raised.value)) < 400, override
    done, cost = measured(fixture_train_args(tmp_path / "run", "training.train_steps=1",
                                             "optimizer.lr=.inf"))
    print(f"optimizer.lr=.inf: {cost}")
    assert_one_line_error(done, "optimizer.lr=inf is not a finite number")
    assert not (tmp_path / "run").exists()


def test_parameters_that_are_not_finite_are_never_saved(tmp_path):
    """The last update of a run made a weight non-finite (after the guard's check): the save
    refuses on every rank, naming the parameter, and nothing is written."""
    import torch.distributed as dist

    from megamoe.train.checkpoint import save_checkpoint
    from megamoe.train.guards import DivergenceError
    from megamoe.checkpointing.layout import TrainState

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(2, 2))
        with torch.no_grad():
            model[0].weight[0, 0] = float("inf")
        with pytest.raises(DivergenceError, match=r"step 5: 0\.weight is not finite"):
            save_checkpoint(tmp_path / "checkpoints", TrainState(5, 40), model, None, None)
    finally:
        dist.destroy_process_group()
    assert not any((tmp_path / "checkpoints").glob("*iter_*"))


# ---- 5. bombs and absurd sizes ------------------------------------------------------------

def _alias_bomb() -> str:
    lines = ["a: &a [x, x, x, x, x, x, x, x, x]"]
    for level in range(1, 9):
        name, previous = chr(97 + level), chr(96 + level)
        lines.append(f"{name}: &{name} [" + ", ".join([f"*{previous}"] * 9) + "]")
    return "\n".join(lines) + "\ntraining:\n  recompute_modules: *i\n"


CONFIG_BOMBS = {
    "alias bomb": (_alias_bomb().encode(), "more than 100,000 values"),
    "20,000 levels deep": (b"model: " + b"[" * 20000 + b"]" * 20000 + b"\n", "nests deeper"),
    "a byte that is not UTF-8": (b"model:\n  num_layers: 2  # \xff\xfe\n", "not UTF-8"),
    "2 MiB of comments": (b"# padding\n" * 200_000, "larger than"),
}


def test_config_bombs_fail_fast(tmp_path):
    import tracemalloc

    from megamoe.errors import ConfigError
    from megamoe.train.config import load_config

    config = tmp_path / "bomb.yaml"
    for name, (content, fragment) in CONFIG_BOMBS.items():
        config.write_bytes(content)
        tracemalloc.start()
        start = time.perf_counter()
        with pytest.raises(ConfigError, match=fragment):
            load_config(config)
        seconds, peak = time.perf_counter() - start, tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        print(f"config {name}: {seconds:.2f} s, peak {peak / 2**20:.1f} MiB")
        assert seconds < 10 and peak < 256 * 2**20, name
    config.write_bytes(CONFIG_BOMBS["alias bomb"][0])
    done, cost = measured([sys.executable, "-m", "megamoe.train", "--config", str(config)])
    print(f"config alias bomb through the CLI: {cost}")
    assert_one_line_error(done, "more than 100,000 values")


HF_ABSURD = {
    "num_hidden_layers 1e9": ({"num_hidden_layers": 1e9}, "num_hidden_layers"),
    "num_hidden_layers 10**9": ({"num_hidden_layers": 10 ** 9}, "num_hidden_layers"),
    "hidden_size 1e12": ({"hidden_size": 10 ** 12}, "hidden_size"),
    "no attention heads": ({"num_attention_heads": 0}, "num_attention_heads"),
    "kv heads not dividing heads": ({"num_key_value_heads": 3}, "does not divide"),
    "a boolean size": ({"intermediate_size": True}, "intermediate_size"),
    "a huge integer": ({"vocab_size": 10 ** 50}, "digits"),
    "nested 100,000 deep": ({"rope_scaling": "DEEP"}, "nests deeper"),
}


def test_absurd_hugging_face_configs_are_refused(hf_model, tmp_path):
    from megamoe.errors import CheckpointError
    from megamoe.checkpointing.hf_arch import read_hf_arch

    model = copy_of(hf_model, tmp_path / "hf")
    original = json.loads((model / "config.json").read_text())
    for name, (changes, fragment) in HF_ABSURD.items():
        text = json.dumps({**original, **changes}).replace('"DEEP"',
                                                           "[" * 100_000 + "]" * 100_000)
        (model / "config.json").write_text(text)
        start = time.perf_counter()
        with pytest.raises(CheckpointError, match=fragment):
            read_hf_arch(model)
        print(f"HF config.json {name}: {time.perf_counter() - start:.3f} s")
    (model / "config.json").write_text(json.dumps({**original, "num_hidden_layers": 1e9}))
    done, cost = measured([sys.executable, "tools/upcycle_ckpt.py", "--load", str(model),
                           "--save", str(tmp_path / "out"), "--num-experts", "4", "--topk",
                           "2"])
    print(f"HF config.json num_hidden_layers 1e9 through the CLI: {cost}")
    assert_one_line_error(done, "num_hidden_layers")
    assert not (tmp_path / "out").exists()


def test_a_hugging_face_tensor_of_the_wrong_shape_is_refused(hf_model, tmp_path):
    from safetensors.torch import load_file, save_file

    model = copy_of(hf_model, tmp_path / "hf")
    tensors = load_file(str(model / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, str(model / "model.safetensors"), metadata={"format": "pt"})
    done = run([sys.executable, "tools/upcycle_ckpt.py", "--load", str(model), "--save",
                str(tmp_path / "out"), "--num-experts", "4", "--topk", "2"])
    assert_one_line_error(done, name, "config.json implies")


JSONL_BOMBS = {
    "invalid UTF-8": (b'{"prompt": "a", "response": "b\xff"}\n', "not UTF-8"),
    "a 5,000-digit number": (b'{"prompt": "a", "response": "b", "task": ' + b"7" * 5000 +
                             b"}\n", "digits"),
    "100,000 levels deep": (b'{"prompt": "a", "response": "b", "x": ' + b"[" * 100_000 +
                            b"]" * 100_000 + b"}\n", "nests deeper"),
    "one 60 MB line": (b'{"prompt": "' + b"a" * 60_000_000 + b'", "response": "b"}\n',
                       "longer than"),
}


@pytest.mark.parametrize("name", sorted(JSONL_BOMBS))
def test_instruction_jsonl_bombs_fail_fast_in_bounded_memory(tmp_path, name):
    import tracemalloc

    from megamoe.errors import DataError
    from megamoe.instruct.dataset import read_records

    content, fragment = JSONL_BOMBS[name]
    path = tmp_path / "data.jsonl"
    path.write_bytes(content)
    del content
    tracemalloc.start()
    start = time.perf_counter()
    with pytest.raises(DataError, match=fragment) as raised:
        read_records(path)
    seconds = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    print(f"instruction jsonl {name}: {seconds:.2f} s, peak {peak / 2**20:.1f} MiB")
    assert "\n" not in str(raised.value) and len(str(raised.value)) < 400
    assert peak < 64 * 2**20  # bounded by the record limit, not by the file


# ---- 6. one run per output directory -------------------------------------------------------

def test_a_second_run_on_the_same_output_dir_is_refused(tmp_path):
    out = tmp_path / "run"
    first = subprocess.Popen(fixture_train_args(out, "training.train_steps=100000",
                                                "checkpoint.interval=0"),
                             cwd=REPO, env=env(), stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and "step 1/" not in first.stdout.readline():
            pass
        second = fixture_train(out, "training.train_steps=100000")
        error = assert_one_line_error(second, "is in use by another run", f"pid {first.pid}")
        assert str(out) in error
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=60)
        # the kernel released the lock with the process: a new run takes the directory over
        third = fixture_train(out, "training.train_steps=2")
        assert third.returncode == 0, third.stderr[-3000:]
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text()
             .splitlines() if "event" not in json.loads(line)]
    assert steps[-2:] == [1, 2]


# ---- 7. interrupts and odd paths -----------------------------------------------------------

def test_sigint_saves_and_exits_like_sigterm_and_leftovers_are_removed(tmp_path):
    out = tmp_path / "run"
    leftover = out / "checkpoints" / ".iter_0000009.tmp"
    leftover.mkdir(parents=True)
    (leftover / "__0_0.distcp").write_bytes(b"half a save")
    trainer = subprocess.Popen(fixture_train_args(out, "training.train_steps=100000",
                                                  "checkpoint.interval=0"),
                               cwd=REPO, env=env(), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and "step 2/" not in trainer.stdout.readline():
        pass
    trainer.send_signal(signal.SIGINT)
    stdout, stderr = trainer.communicate(timeout=120)
    assert trainer.returncode == 0, stderr[-3000:]
    assert "Traceback" not in stderr and "received SIGINT" in stderr
    saved = sorted(p.name for p in (out / "checkpoints").iterdir() if "iter_" in p.name)
    assert len(saved) == 1 and saved[0].startswith("iter_"), saved  # the leftover is gone
    assert checkpoint_problem(out / "checkpoints" / saved[0]) is None


def test_an_output_dir_that_is_a_file_is_refused(tmp_path):
    out = tmp_path / "run"
    out.write_text("a file\n")
    assert_one_line_error(fixture_train(out, "training.train_steps=1"), "is a file")
    assert out.read_text() == "a file\n"


# ---- 8. NaN in what is imported ------------------------------------------------------------

def test_nan_in_imported_weights_is_refused(hf_model, tmp_path):
    from safetensors.torch import load_file, save_file

    model = copy_of(hf_model, tmp_path / "hf")
    tensors = load_file(str(model / "model.safetensors"))
    name = "model.layers.0.self_attn.o_proj.weight"
    tensors[name][3, 5] = float("nan")
    save_file(tensors, str(model / "model.safetensors"), metadata={"format": "pt"})
    for extra in (["--num-experts", "4", "--topk", "2"], ["--dense"]):
        done = run([sys.executable, "tools/upcycle_ckpt.py", "--load", str(model), "--save",
                    str(tmp_path / "out"), *extra])
        assert_one_line_error(done, name, "NaN/Inf")
        assert not (tmp_path / "out").exists()

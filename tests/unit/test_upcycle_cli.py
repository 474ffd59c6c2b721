"""tools/upcycle_ckpt.py: a working run, and every bad input -> one line on stderr, exit code 2,
no output left behind."""
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

import upcycle_ckpts as ck
from tool_modules import tool_module
from megamoe.errors import run_cli
from megamoe.megatron.runtime import setup_megatron, teardown_megatron
from megamoe.checkpointing.torch_files import load_torch_file
import warm_launcher

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "upcycle_ckpt.py"


CLI_MAIN = tool_module("upcycle_ckpt").main


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    setup_megatron(seed=3)
    root = tmp_path_factory.mktemp("cli")
    cfg = ck.config(ck.GLU, num_layers=2)
    dense = ck.build(cfg)
    args = ck.megatron_lm_args(cfg)
    moe_cfg = ck.moe_config(ck.GLU, 2, dict(num_moe_experts=4, moe_router_topk=2))
    moe = ck.build(moe_cfg)
    paths = dict(dist=ck.save_torch_dist(dense, root / "dist", args),
                 legacy=ck.save_legacy(dense, root / "legacy", args),
                 moe_dist=ck.save_torch_dist(moe, root / "moe_dist", args),
                 moe_legacy=ck.save_legacy(moe, root / "moe_legacy", args))
    yield paths
    teardown_megatron()


def run(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_cli(CLI_MAIN, [str(a) for a in argv])
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err


def base_args(load, save, *extra):
    return ["--load", load, "--save", save, "--num-experts", 4, "--topk", 2, "--no-progress",
            *extra]


def assert_refused(code, err, save, match):
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and match in lines[0], err
    assert not save.exists()
    assert not [p for p in save.parent.iterdir() if p.name.startswith(f".{save.name}.")]


def test_cli_upcycles_verifies_and_prints_the_logit_difference(ckpts, tmp_path, capsys):
    save = tmp_path / "moe"
    code, out, _ = run(base_args(ckpts["dist"], save, "--granularity", 2, "--verify",
                                 "--shared-expert"), capsys)
    assert code == 0
    diff = float(out.split("max |logit diff| dense vs MoE: ")[1].split()[0])
    assert diff <= 1e-4
    assert "--moe-ffn-hidden-size 64" in out and "--moe-shared-expert-intermediate-size 128" in out
    recipe = json.loads((save / "upcycle_recipe.json").read_text())
    assert recipe["recipe"]["granularity"] == 2 and recipe["recipe"]["shared_expert"] is True
    assert recipe["source"]["path"] == str(ckpts["dist"].resolve())
    common = load_torch_file(save / "release" / "common.pt")
    assert common["iteration"] == 0 and common["upcycle_recipe"] == recipe
    assert common["args"].num_experts == 4 and common["args"].moe_ffn_hidden_size == 64
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "release"
    metrics = [json.loads(line) for line in (save / "upcycle_metrics.jsonl").read_text()
               .splitlines()]
    assert len(metrics) == 3 and all(m["bytes"] > 0 for m in metrics)


def test_existing_output_is_refused_unless_overwrite(ckpts, tmp_path, capsys):
    save = tmp_path / "moe"
    save.mkdir()
    (save / "keep.txt").write_text("mine")
    code, _, err = run(base_args(ckpts["legacy"], save), capsys)
    assert code == 2 and "exists" in err and len(err.strip().splitlines()) == 1
    assert (save / "keep.txt").read_text() == "mine"
    # --overwrite replaces only the tool's own output: a folder of the user's stays as it was
    code, _, err = run(base_args(ckpts["legacy"], save, "--overwrite"), capsys)
    assert code == 2 and "did not write" in err and len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in save.iterdir()) == ["keep.txt"]
    (save / "keep.txt").unlink()
    code, _, _ = run(base_args(ckpts["legacy"], save), capsys)
    assert code == 0 and (save / "release" / ".metadata").exists()
    (save / "release" / "stale").write_text("from before")
    code, _, _ = run(base_args(ckpts["legacy"], save, "--overwrite"), capsys)
    assert code == 0 and not (save / "release" / "stale").exists()
    assert (save / "release" / ".metadata").exists()


def corrupt_copy(source: Path, tmp_path: Path, mutate) -> Path:
    copy = tmp_path / "corrupt"
    shutil.copytree(source, copy)
    mutate(copy)
    return copy


def truncate_data_file(root: Path):
    data = sorted((root / "iter_0000007").glob("*.distcp"))[0]
    data.write_bytes(data.read_bytes()[:1000])


def garble(path: Path):
    path.write_bytes(b"not a checkpoint" * 10)


@pytest.mark.parametrize("case,match", [
    ("missing", "does not exist"),
    ("truncated_data", "corrupt"),
    ("garbled_metadata", "corrupt"),
    ("garbled_legacy", "corrupt"),
    ("missing_legacy_rank", "incomplete"),
    ("unknown_format", "unknown checkpoint format"),
    ("zarr", "only torch_dist"),
    ("moe_dist", "already an MoE checkpoint"),
    ("moe_legacy", "already an MoE checkpoint"),
])
def test_bad_checkpoints_are_refused(ckpts, tmp_path, capsys, case, match):
    dist, legacy = ckpts["dist"], ckpts["legacy"]
    loads = {
        "missing": lambda: tmp_path / "nowhere",
        "truncated_data": lambda: corrupt_copy(dist, tmp_path, truncate_data_file),
        "garbled_metadata": lambda: corrupt_copy(
            dist, tmp_path, lambda root: garble(root / "iter_0000007" / ".metadata")),
        "garbled_legacy": lambda: corrupt_copy(legacy, tmp_path, lambda root: garble(
            root / "iter_0000007" / "mp_rank_00" / "model_optim_rng.pt")),
        "missing_legacy_rank": lambda: corrupt_copy(legacy, tmp_path, lambda root: shutil.copytree(
            root / "iter_0000007" / "mp_rank_00", root / "iter_0000007" / "mp_rank_02")),
        "unknown_format": lambda: corrupt_copy(dist, tmp_path, lambda root: shutil.rmtree(
            root / "iter_0000007") or (root / "iter_0000007").mkdir()),
        "zarr": lambda: corrupt_copy(dist, tmp_path, lambda root: (
            root / "iter_0000007" / "metadata.json").write_text('{"sharded_backend": "zarr"}')),
        "moe_dist": lambda: ckpts["moe_dist"],
        "moe_legacy": lambda: ckpts["moe_legacy"],
    }
    save = tmp_path / "out"
    code, _, err = run(base_args(loads[case](), save), capsys)
    assert_refused(code, err, save, match)


@pytest.mark.parametrize("extra,match", [
    (["--num-experts", 6, "--granularity", 4], "not divisible by granularity"),
    (["--num-experts", 8, "--granularity", 2, "--topk", 3, "--verify"], "multiple of granularity"),
    (["--moe-layers", "odd"], "every:N"),
    (["--moe-layers", "0,9"], "outside"),
    (["--num-experts", 6, "--granularity", 3], "does not divide the dense FFN size"),
    (["--router-init", "orthogonal"], "invalid choice"),
    (["--bogus"], "unrecognized arguments"),
])
def test_bad_options_are_refused(ckpts, tmp_path, capsys, extra, match):
    save = tmp_path / "out"
    code, _, err = run(base_args(ckpts["dist"], save, *extra), capsys)
    assert_refused(code, err, save, match)


def test_verify_needs_the_head_count_when_the_checkpoint_has_no_args(ckpts, tmp_path, capsys):
    bare = corrupt_copy(ckpts["dist"], tmp_path, lambda root: torch.save(
        {"iteration": 7}, root / "iter_0000007" / "common.pt"))
    save = tmp_path / "out"
    code, _, err = run(base_args(bare, save, "--verify"), capsys)
    assert_refused(code, err, save, "num_attention_heads")
    code, out, _ = run(base_args(bare, save, "--verify", "--arch", "num_attention_heads=4"),
                       capsys)
    assert code == 0 and "max |logit diff|" in out


@pytest.mark.slow
def test_cli_process_exit_code_and_single_error_line(tmp_path):
    save = tmp_path / "out"
    done = warm_launcher.run([sys.executable, str(TOOL), "--load", str(tmp_path / "missing"),
                              "--save", str(save), "--num-experts", "4", "--topk", "2"],
                             capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"error: checkpoint path {tmp_path / 'missing'} does not exist"]
    assert not save.exists()

"""Adding a router is one new file plus one import line: the worked example of
docs/architecture.md ("Add a router: a worked example"), taken from the docs as written, is added
to a copy of the package and trained from YAML with its own setting through
`python -m megamoe.train`; a misspelt setting of it is one line with did-you-mean, exit 2."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs" / "architecture.md"
TINY = REPO / "configs" / "tiny_cpu.yaml"


def _worked_example() -> tuple[str, str, str]:
    """(file name under megamoe/routing, its code, the import line) of the docs' example."""
    text = DOCS.read_text(encoding="utf-8")
    section = text.split("### Add a router: a worked example", 1)[1].split("\n## ", 1)[0]
    path = re.search(r"`megamoe/routing/(\w+\.py)`", section).group(1)
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    line = re.search(r"`(from megamoe\.routing\.\w+ import \w+)`", section).group(1)
    return path, code, line


@pytest.fixture(scope="module")
def package_copy(tmp_path_factory) -> Path:
    """A copy of the megamoe package with the docs' router file and its one import line."""
    root = tmp_path_factory.mktemp("added_router")
    shutil.copytree(REPO / "megamoe", root / "megamoe",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    path, code, line = _worked_example()
    routing = root / "megamoe" / "routing"
    assert not (routing / path).exists()
    (routing / path).write_text(code, encoding="utf-8")
    init = routing / "__init__.py"
    init.write_text(init.read_text(encoding="utf-8") + line + "\n", encoding="utf-8")
    return root


def _train(root: Path, router: dict, cache: Path, out: Path) -> subprocess.CompletedProcess:
    """`python -m megamoe.train` of the copy (run from it, so it is the package imported) on the
    tiny config with `moe.router` replaced by `router`, for 2 steps in one process."""
    config = yaml.safe_load(TINY.read_text(encoding="utf-8"))
    config["moe"]["router"] = router
    path = out.parent / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(root), "TORCHDYNAMO_DISABLE": "1",
           "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    return subprocess.run(
        [sys.executable, "-m", "megamoe.train", "--config", str(path), f"output_dir={out}",
         f"data.cache_dir={cache}", "parallel.expert=1", "training.train_steps=2",
         "training.global_batch_size=8", "optimizer.warmup_steps=1", "checkpoint.interval=0",
         "logging.interval=1", "logging.progress_bar=false", "logging.tensorboard=false"],
        cwd=root, env=env, capture_output=True, text=True, timeout=300)


def test_added_router_trains_with_its_own_setting_from_yaml(package_copy, corpus_cache, tmp_path):
    """floor 0.99 is above every softmax score of 8 experts at initialisation, so each token
    keeps only its best expert: 1 expert per token where top-2 routing takes 2."""
    out = tmp_path / "floor"
    done = _train(package_copy, {"kind": "floor", "floor": 0.99}, corpus_cache, out)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [record for record in steps if "loss" in record]
    assert [record["step"] for record in steps] == [1, 2]
    per_token = [value for record in steps for key, value in record.items()
                 if key.endswith("/experts_per_token")]
    assert len(per_token) == 2 * 3  # 2 steps x MoE layers 2-4 (layer 1 is dense)
    assert per_token == [1.0] * len(per_token)


def test_misspelt_setting_of_the_added_router_is_one_line(package_copy, corpus_cache, tmp_path):
    out = tmp_path / "flor"
    done = _train(package_copy, {"kind": "floor", "flor": 0.1}, corpus_cache, out)
    assert done.returncode == 2, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "unknown config key 'moe.router.flor'" in lines[0], lines
    assert "did you mean 'moe.router.floor'?" in lines[0]
    assert not out.exists()

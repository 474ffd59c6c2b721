"""Every command line refuses bad input before it imports Megatron-Core: the trainer and each
tool in tools/, given a bad config path, a missing input or a bad flag, exits with code 2 and
one line on stderr, and `python -X importtime` shows no `megatron` module imported (a refusal
costs the interpreter and torch, not the seconds of Megatron-Core's imports). One refusal per
command-line tool: a new tool fails `test_every_tool_is_covered` until it has one here.

The refusals run as subprocesses in parallel (they are interpreter start-ups, mostly waiting on
imports), so the file costs about one refusal's time per worker.
"""
from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOOLS = REPO / "tools"
IMPORT_TIME = "import time:"

# name -> (argv after the interpreter, a text the error must hold); {tmp}: the test's folder,
# where nothing exists unless the refusal makes it.
CASES = {
    "megamoe.train": (["-m", "megamoe.train", "--config", "{tmp}/missing.yaml"],
                      "missing.yaml does not exist"),
    "megamoe.train override": (["-m", "megamoe.train", "--config", "configs/tiny_cpu.yaml",
                                "training.no_such_key=1"], "training.no_such_key"),
    "bench_ep_dispatch": (["--dispatchers", "nosuch", "--out", "{tmp}/ep.json"], "nosuch"),
    "bench_moe_layer": (["--json", "{tmp}"], "is a folder"),
    "bench_muon": (["--config", "{tmp}/missing.yaml"], "missing.yaml does not exist"),
    "bench_muon_memory": (["--config", "{tmp}/missing.yaml"], "missing.yaml does not exist"),
    "bench_parameter_counts": (["--model", "nosuch"], "'nosuch' is not a released model"),
    "bench_preprocess": (["--megatron-lm", "{tmp}/missing", "--workdir", "{tmp}/work"],
                         "is not a Megatron-LM checkout"),
    "bench_tokenizer_load": (["--entries", "12"], "--entries '12' must be comma-separated"),
    "bench_upcycle": (["--workdir", "{tmp}/work", "--experts", "4", "--topk", "8"],
                      "--topk 8 exceeds --experts 4"),
    "export_hf": (["--load", "{tmp}/missing", "--save", "{tmp}/out"],
                  "no torch_dist checkpoint at"),
    "import_deepspeed_moe": (["--load", "{tmp}/missing", "--save", "{tmp}/out", "--topk", "2"],
                             "missing does not exist"),
    "import_hf": (["--load", "{tmp}/missing", "--save", "{tmp}/out"], "has no config.json"),
    "plan_memory": (["--config", "{tmp}/missing.yaml"], "missing.yaml does not exist"),
    "plot_expert_load": (["{tmp}/missing"], "no metrics file"),
    "preprocess_data": (["--input", "{tmp}/missing.jsonl", "--output-prefix", "{tmp}/out/x",
                         "--train-tokenizer", "--vocab-size", "300"],
                        "missing.jsonl does not exist"),
    "soak": (["--out", "{tmp}/out", "no_such.key=1"], "no_such.key"),
    "study_layout_seed": (["--out", "{tmp}/out", "no_such.key=1"], "no_such.key"),
    "study_muon": (["--out", "{tmp}/out", "--adamw-lrs", "abc"], "--adamw-lrs"),
    "study_routing": (["--out", "{tmp}/out", "--variants", "nosuch"], "nosuch"),
    "study_simoe": (["--out", "{tmp}/out", "--learning-rates", "abc"], "--learning-rates"),
    "study_topp": (["--out", "{tmp}/out", "--variants", "nosuch"], "nosuch"),
    "upcycle_ckpt": (["--load", "{tmp}/missing", "--save", "{tmp}/out", "--num-experts", "4",
                      "--topk", "2"], "missing does not exist"),
}


def _argv(name: str, tmp: Path) -> list[str]:
    args, _ = CASES[name]
    head = [] if name.startswith("megamoe.") else [str(TOOLS / f"{name}.py")]
    return [sys.executable, "-X", "importtime", *head,
            *(arg.format(tmp=tmp) for arg in args)]


def _refuse(name: str, tmp: Path) -> str | None:
    """What is wrong with `name`'s refusal (None: nothing)."""
    folder = tmp / name.replace(" ", "_")
    folder.mkdir()
    env = {**os.environ, "TORCHDYNAMO_DISABLE": "1", "OMP_NUM_THREADS": "1"}
    try:
        done = subprocess.run(_argv(name, folder), cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=240)
    except subprocess.TimeoutExpired:
        return "no refusal within 240 s"
    imported = [line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines()
                if line.startswith(IMPORT_TIME)]
    error = [line for line in done.stderr.splitlines() if not line.startswith(IMPORT_TIME)]
    megatron = [module for module in imported
                if module == "megatron" or module.startswith("megatron.")]
    problems = []
    if done.returncode != 2:
        problems.append(f"exit code {done.returncode}")
    if len(error) != 1 or not error[0].startswith("error: "):
        problems.append(f"stderr is not one 'error:' line: {error[-5:]}")
    elif CASES[name][1] not in error[0]:
        problems.append(f"the error does not name {CASES[name][1]!r}: {error[0]}")
    if megatron:
        problems.append(f"imported {len(megatron)} megatron modules first ({megatron[0]}, ...)")
    if not imported:
        problems.append("no importtime output (was -X importtime honoured?)")
    return "; ".join(problems) or None


def test_every_tool_is_covered():
    tools = {path.stem for path in TOOLS.glob("*.py")}
    assert tools <= set(CASES), f"add a refusal to CASES for {sorted(tools - set(CASES))}"
    assert set(CASES) - tools == {"megamoe.train", "megamoe.train override"}


@pytest.mark.quick(budget_s=120)
def test_bad_input_is_refused_in_one_line_before_megatron_is_imported(tmp_path):
    workers = max(2, min(8, len(os.sched_getaffinity(0))))
    with ThreadPoolExecutor(workers) as pool:
        results = dict(zip(CASES, pool.map(lambda name: _refuse(name, tmp_path), CASES)))
    failed = {name: problem for name, problem in results.items() if problem}
    assert not failed, "\n".join(f"{name} ({' '.join(_argv(name, tmp_path)[3:])}): {problem}"
                                 for name, problem in failed.items())

"""No tool writes over what it does not own: every tool in tools/, every output flag it has.

The output flags are discovered from each tool's own argparse parser (an option whose name ends
in out, output, save, json, png, runs, results, workdir or prefix), so a new tool or flag is
covered without editing this file; only the cheapest valid values of a tool's other required
arguments are listed here (REQUIRED). Each flag is pointed at
(a) the tool's input, for a tool that reads one (and, for an input folder, a path inside it),
(b) a folder of the user's with a file in it,
(c) a copy of the project's own docs/ (never the real one),
(d) for every tool but export_hf, a Hugging Face export (marked beside itself, not inside),
with and without --overwrite where the tool has it. Each attempt must be refused when the
arguments are checked, in one line with exit code 2, and leave everything under the test's
folder byte-identical (no file changed, added or removed). The tools run in this process:
a tool that starts a process (training, a benchmark) instead fails the test at once.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from megamoe.errors import run_cli
from megamoe.ownership import MARK, outside_mark
from tool_modules import TOOLS, tool_module

ROOT = TOOLS.parent
OUTPUT_WORDS = {"out", "output", "save", "json", "png", "runs", "results", "workdir", "prefix"}
REQUIRED = {  # tool -> its required arguments other than outputs; {input} is the tool's input
    "export_hf": ["--load", "{input}"],
    "import_hf": ["--load", "{input}"],
    "import_deepspeed_moe": ["--load", "{input}", "--topk", "2"],
    "upcycle_ckpt": ["--load", "{input}", "--num-experts", "4", "--topk", "2"],
    "plan_memory": ["--config", "{input}"],
    "plot_expert_load": ["{input}"],
    "preprocess_data": ["--input", "{input}", "--train-tokenizer", "--vocab-size", "300"],
}
INPUT_FOLDERS = {"export_hf", "import_hf", "import_deepspeed_moe", "upcycle_ckpt"}
"""Tools whose input is a folder (a checkpoint or a model); the others read a file."""


class _Parser(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        super().__init__()
        self.parser = parser


def tool_parser(name: str) -> argparse.ArgumentParser:
    """The parser tools/NAME.py builds, caught as its main() starts to parse."""
    module = tool_module(name)

    def capture(self, *args, **kwargs):
        raise _Parser(self)

    original = argparse.ArgumentParser.parse_known_args
    argparse.ArgumentParser.parse_known_args = capture
    try:
        module.main([])
    except _Parser as caught:
        return caught.parser
    finally:
        argparse.ArgumentParser.parse_known_args = original
    raise AssertionError(f"tools/{name}.py's main() parsed no command line")


def output_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The options of `parser` that name an output (by the last word of their dest)."""
    return [a for a in parser._actions if a.option_strings and a.nargs != 0
            and a.dest.split("_")[-1] in OUTPUT_WORDS]


TOOL_NAMES = sorted(p.stem for p in TOOLS.glob("*.py"))
CASES = [(name, flag) for name in TOOL_NAMES
         for flag in (a.option_strings[-1] for a in output_actions(tool_parser(name)))]


def test_every_tool_with_outputs_is_covered():
    covered = {name for name, _ in CASES}
    assert {"study_routing", "study_topp", "study_simoe", "study_layout_seed", "plan_memory",
            "import_hf", "export_hf", "upcycle_ckpt", "import_deepspeed_moe", "soak",
            "plot_expert_load", "preprocess_data", "bench_upcycle"} <= covered
    flags = {f"{name} {flag}" for name, flag in CASES}
    assert {"study_routing --runs", "plan_memory --json", "plan_memory --png",
            "preprocess_data --output-prefix", "bench_upcycle --results"} <= flags


def tree(path: Path) -> str:
    """A digest of everything under `path`: each entry's name and kind, each file's bytes,
    each link's target."""
    digest = hashlib.sha256()
    for entry in sorted(path.rglob("*")):
        digest.update(str(entry.relative_to(path)).encode() + b"\0")
        if entry.is_symlink():
            digest.update(b"link:" + os.readlink(entry).encode())
        elif entry.is_file():
            digest.update(b"file:" + entry.read_bytes())
        else:
            digest.update(b"dir")
    return digest.hexdigest()


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    """The test's folder: inputs (a file and a folder), a user's folder, a copy of docs/, an
    export_hf output."""
    root = tmp_path_factory.mktemp("tool_outputs")
    (root / "input.yaml").write_text((ROOT / "configs" / "tiny_cpu.yaml").read_text())
    (root / "input_folder").mkdir()
    (root / "input_folder" / "config.json").write_text("{}\n")
    (root / "mine").mkdir()
    (root / "mine" / "thesis.txt").write_text("three years of work\n")
    shutil.copytree(ROOT / "docs", root / "docs")
    (root / "hf_export").mkdir()
    (root / "hf_export" / "config.json").write_text("{}\n")
    outside_mark(root / "hf_export").write_text("export_hf\n")
    assert not (root / "hf_export" / MARK).exists()
    return root


def _no_processes(*args, **kwargs):
    raise AssertionError(f"the tool started a process instead of refusing: {args[:1]}")


@pytest.mark.parametrize("name, flag", CASES, ids=[f"{n}{f}" for n, f in CASES])
def test_output_over_an_input_a_users_folder_or_docs_is_refused_untouched(
        name, flag, world, monkeypatch, capsys):
    parser = tool_parser(name)
    overwrite = any("--overwrite" in a.option_strings for a in parser._actions)
    own = world / ("input_folder" if name in INPUT_FOLDERS else "input.yaml")
    required = [arg.format(input=own) for arg in REQUIRED.get(name, [])]
    # other required outputs of the tool: a new path, which the refusal leaves unmade
    for action in output_actions(parser):
        if action.required and flag not in action.option_strings:
            required += [action.option_strings[-1], str(world / "new_output")]
    targets = {"the user's folder": world / "mine", "a copy of docs/": world / "docs"}
    if name != "export_hf":
        targets["export_hf's output"] = world / "hf_export"
    if name in REQUIRED:
        targets["its input"] = own
        if own.is_dir():
            targets["a path inside its input"] = own / "out"
    monkeypatch.chdir(world)
    monkeypatch.setattr(subprocess, "Popen", _no_processes)
    before = tree(world)
    for what, target in targets.items():
        for extra in ([], ["--overwrite"]) if overwrite else ([],):
            argv = [*required, flag, str(target), *extra]
            with pytest.raises(SystemExit) as done:
                run_cli(tool_module(name).main, argv)
            err = capsys.readouterr().err
            assert "arguments are required" not in err, (
                f"add {name}'s required arguments to REQUIRED: {err}")
            assert done.value.code == 2, f"{name} {' '.join(argv)}: exit {done.value.code}"
            assert len(err.strip().splitlines()) == 1 and err.startswith("error:"), err
            assert re.search(re.escape(flag) + "|" + re.escape(str(target)), err), err
            assert tree(world) == before, f"{name} {flag} {what} {extra}: the folder changed"

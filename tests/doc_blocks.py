"""The fenced blocks of the documentation, for tests/unit/test_doc_examples.py: parsing, the notes
that say how the tests run a block, the text replacements of the substitution table, and running
a block (```python in-process, ```bash as a shell script) in a prepared working directory.

Conventions (README.md and docs/*.md follow them):
- a block a user runs is fenced ```bash or ```python; any other fence (```text, ```yaml, none) is
  not run;
- `*Not run by the tests: <reason>.*` directly above a fence: the block is reported as skipped
  with that reason;
- `*The tests run this with: <words>.*` directly above a fence: the block runs with the text
  replacements the test file's table holds for it (keyed by file and a distinctive snippet);
- a runnable block with neither note runs exactly as written, except that `pip install ...`
  steps are left out (the test environment has every package installed).
"""
from __future__ import annotations

import os
import re
import runpy
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import warm_launcher

REPO = Path(__file__).resolve().parents[1]
RUNNABLE = ("bash", "python")
NOT_RUN = "Not run by the tests"
RUN_WITH = "The tests run this with"
_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`\s]*)[^`]*$")
_NOTE = re.compile(r"(?:^|\s)\*(?P<kind>" + NOT_RUN + "|" + RUN_WITH + r"):\s*(?P<words>.*?)\*$")
# Paths of the repository that blocks use relative to their working directory (the rest of the
# repository stays out of reach, so a block cannot write into docs/ or megamoe/): tools/ is
# copied, since tools put their default outputs beside themselves (ROOT / "runs" / ...), the
# others are linked.
COPIED = ("tools",)
LINKED = ("configs", "launch", "tests")


@dataclass(frozen=True)
class Block:
    """One fenced block: its file (relative to the repository), the 1-based line of its opening
    fence, the fence's language, its text (dedented to the fence) and the note above it."""

    file: str
    line: int
    lang: str
    text: str
    note: Optional[str] = None  # NOT_RUN, RUN_WITH or None
    words: str = ""  # the note's words (the reason a block is not run)

    @property
    def id(self) -> str:
        return f"{self.file}:{self.line}"

    @property
    def runnable(self) -> bool:
        return self.lang in RUNNABLE


def doc_files(repo: Path = REPO) -> list[Path]:
    """README.md and docs/*.md, in that order."""
    return [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]


def _note_above(lines: list[str], fence_index: int) -> tuple[Optional[str], str]:
    """The note of the paragraph directly above line `fence_index` (one blank line between
    allowed), as (kind, words); (None, "") when there is none."""
    i = fence_index - 1
    if i >= 0 and not lines[i].strip():
        i -= 1
    paragraph: list[str] = []
    while i >= 0 and lines[i].strip() and not _FENCE.match(lines[i]):
        paragraph.insert(0, lines[i].strip())
        i -= 1
    match = _NOTE.search(" ".join(paragraph))
    if not match:
        return None, ""
    return match["kind"], match["words"].strip().rstrip(".").strip()


def parse(path: Path, repo: Path = REPO) -> list[Block]:
    """Every fenced block of the Markdown file `path`, in order."""
    lines = path.read_text().splitlines()
    name = path.relative_to(repo).as_posix()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, fence = opening["indent"], opening["fence"]
        body: list[str] = []
        j = i + 1
        while j < len(lines):
            closing = _FENCE.match(lines[j])
            if (closing and closing["fence"][0] == fence[0] and len(closing["fence"]) >= len(fence)
                    and not closing["info"]):
                break
            line = lines[j]
            body.append(line[len(indent):] if line.startswith(indent) else line.lstrip())
            j += 1
        kind, words = _note_above(lines, i)
        blocks.append(Block(name, i + 1, opening["info"].lower(), "\n".join(body) + "\n",
                            kind, words))
        i = j + 1
    return blocks


def all_blocks(repo: Path = REPO) -> list[Block]:
    return [block for path in doc_files(repo) for block in parse(path, repo)]


# ---------------------------------------------------------------------------------------------
# Substitutions

Substitutions = dict[tuple[str, str], list[tuple[str, str]]]


def entry_for(block: Block, table: Substitutions) -> Optional[tuple[str, str]]:
    """The key of `table` whose snippet is in `block` (of the same file), or None."""
    keys = [key for key in table if key[0] == block.file and key[1] in block.text]
    assert len(keys) <= 1, f"{block.id}: several substitution entries match it: {keys}"
    return keys[0] if keys else None


def substituted(block: Block, table: Substitutions) -> str:
    """The text the tests run for `block`: its own, with the table's replacements when the
    block's note says the tests substitute; a note without an entry, or an entry without the
    note, fails (the docs and the table must not drift apart), and so does a replacement whose
    text the block no longer holds."""
    key = entry_for(block, table)
    if block.note == RUN_WITH:
        assert key is not None, (
            f"{block.id} says '*{RUN_WITH}: {block.words}.*' but the substitution table of "
            f"tests/unit/test_doc_examples.py has no entry whose snippet is in it")
    else:
        assert key is None, (
            f"{block.id} has a substitution entry {key} but no '*{RUN_WITH}: ...*' note above "
            f"it: add the note, or remove the entry")
        return block.text
    text = block.text
    for old, new in table[key]:
        assert old in text, f"{block.id}: the substitution of {old!r} no longer matches the block"
        text = text.replace(old, new)
    return text


_PIP_PREFIX = re.compile(r"^(?P<indent>[ \t]*)(?:python3? -m )?pip3? install\b[^\n]*?&&\s*",
                         re.MULTILINE)
_PIP_LINE = re.compile(r"^\s*(?:python3? -m )?pip3? install\b(?:[^\n]*\\\n)*[^\n]*\n?",
                       re.MULTILINE)


def without_pip_install(script: str) -> str:
    """`script` with its `pip install ... &&` prefixes and `pip install ...` lines left out."""
    script = _PIP_PREFIX.sub(lambda m: m["indent"], script)
    return _PIP_LINE.sub("", script)


# ---------------------------------------------------------------------------------------------
# Working directories and running

@dataclass
class Workdir:
    """A file's working directory: the repository paths blocks use (COPIED, LINKED), a HOME of
    its own (the default corpus cache linked in when a block trains), files made on demand."""

    root: Path
    home: Path
    scripts: Path

    @classmethod
    def create(cls, base: Path) -> "Workdir":
        root, home, scripts = base / "work", base / "home", base / "blocks"
        for folder in (root, home, scripts):
            folder.mkdir(parents=True, exist_ok=True)
        for name in COPIED:
            shutil.copytree(REPO / name, root / name,
                            ignore=shutil.ignore_patterns("__pycache__"))
        for name in LINKED:
            (root / name).symlink_to(REPO / name, target_is_directory=True)
        return cls(root, home, scripts)

    def link_corpus_cache(self, cache: Path) -> None:
        """`~/.cache/megamoe` (the trainer's default data.cache_dir) -> the session's corpus."""
        target = self.home / ".cache" / "megamoe"
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(cache, target_is_directory=True)

    def env(self) -> dict[str, str]:
        """The environment of a bash block: this test's Python first on PATH (`python`, `pip`,
        `torchrun`), its `python` and `torchrun` run through the warm launcher
        (tests/warm_launcher.py), the working directory's HOME, offline Hugging Face and wandb,
        TorchDynamo off (as every test), a free rendezvous port for a torchrun without
        --standalone."""
        path = str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")
        shims = warm_launcher.shim_environment(self.scripts / "bin", path)
        return {**os.environ, **shims,
                "HOME": str(self.home), "TORCHDYNAMO_DISABLE": "1", "PYTHONUNBUFFERED": "1",
                "WANDB_MODE": "offline", "WANDB_SILENT": "true", "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1", "MPLBACKEND": "Agg",
                "PET_MASTER_PORT": str(warm_launcher.free_port())}


def run_bash(block: Block, script: str, workdir: Workdir, timeout: float) -> float:
    """Run `script` (the block's text as the tests run it) with `bash -euo pipefail` in the
    working directory; fails with the output's tail unless it exits 0. Returns the seconds."""
    path = workdir.scripts / f"{block.file.replace('/', '_')}_L{block.line}.sh"
    path.write_text(without_pip_install(script))
    start = time.perf_counter()
    done = subprocess.run(["bash", "-euo", "pipefail", str(path)], cwd=workdir.root,
                          env=workdir.env(), capture_output=True, text=True, timeout=timeout)
    seconds = time.perf_counter() - start
    assert done.returncode == 0, (
        f"{block.id} exited {done.returncode} after {seconds:.1f} s; the script as run "
        f"({path}):\n{path.read_text()}\n--- stdout (tail)\n{done.stdout[-4000:]}\n"
        f"--- stderr (tail)\n{done.stderr[-6000:]}")
    return seconds


def _registries() -> list:
    import megamoe.registry as registry

    return [value for value in vars(registry).values() if isinstance(value, registry.Registry)]


def _megatron_initialised() -> bool:
    if "megatron.core" not in sys.modules:
        return False
    from megatron.core import parallel_state

    return parallel_state.model_parallel_is_initialized()


def run_python(block: Block, script: str, workdir: Workdir) -> float:
    """Run `script` in-process as `python FILE.py` would (a fresh `__main__` namespace), in the
    working directory with its HOME. What a block leaves in the process is undone afterwards,
    so it leaves no trace in other tests: megamoe's registries are restored (a block may
    register a router), and Megatron's parallel state (and the process group) a block set up
    with `setup_megatron()` is torn down. Returns the seconds."""
    path = workdir.scripts / f"{block.file.replace('/', '_')}_L{block.line}.py"
    path.write_text(script)
    saved = [(registry, registry.snapshot()) for registry in _registries()]
    megatron_before = _megatron_initialised()
    cwd, home = os.getcwd(), os.environ.get("HOME")
    os.chdir(workdir.root)
    os.environ["HOME"] = str(workdir.home)
    start = time.perf_counter()
    try:
        runpy.run_path(str(path), run_name="__main__")
    finally:
        seconds = time.perf_counter() - start
        os.chdir(cwd)
        if home is None:
            os.environ.pop("HOME", None)
        else:
            os.environ["HOME"] = home
        for registry, snapshot in saved:
            registry.restore(snapshot)
        if not megatron_before and _megatron_initialised():
            from megamoe.megatron.runtime import teardown_megatron

            teardown_megatron()
    return seconds

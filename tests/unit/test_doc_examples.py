"""Every documented example runs: each ```bash and ```python block of README.md and docs/*.md
(tests/doc_blocks.py: the conventions, parsing and running).

One test per block, id FILE:LINE (the line of its opening fence). Blocks of one file run in
order in one working directory of that file, since later steps use earlier outputs (import ->
preprocess -> train -> export); the directory holds a copy of the repository's tools/ (tools
write their default outputs beside themselves) and links to configs/, launch/ and tests/, a
`my_corpus.jsonl` (and `corpus.jsonl`) of a few hundred short documents, a tiny random Hugging
Face model (tests/hf_models.py) in place of each released model the file's blocks name
(MODELS), and its own HOME, whose `~/.cache/megamoe` is the session's default corpus
(conftest.py's corpus_cache), so the trainer's default data costs nothing. `python`, `pip` and
`torchrun` are this test's interpreter's; `pip install` steps are left out. Selecting one block
of a file (-k) runs it without the blocks before it.

A block with `*Not run by the tests: <reason>.*` above it is skipped with that reason; one with
`*The tests run this with: <words>.*` runs with the replacements SUBSTITUTIONS holds for it
(a note without an entry, or an entry without its block or its note, fails). Blocks that train
or convert models are in the slow tier; python blocks and cheap commands are quick.
"""
from __future__ import annotations

import json
import random
import re

import pytest

from doc_blocks import (NOT_RUN, RUN_WITH, Block, Workdir, all_blocks, entry_for, run_bash,
                        run_python, substituted)

# (file, a snippet of the block that only it holds) -> the (old, new) text replacements the
# tests apply to it. Each block listed here carries a `*The tests run this with: ...*` note.
# The released models the docs name are tiny random ones of the same name in the working
# directory (MODELS), so a block's model names need no replacement.
STEPS = "training.train_steps=2"
INSTRUCT_EVAL = "instruct_eval.jsonl"  # in every working directory: two instruction examples
SUBSTITUTIONS: dict[tuple[str, str], list[tuple[str, str]]] = {
    ("README.md", "torchrun --standalone --nproc-per-node=2 -m megamoe.train"):
        [("configs/tiny_cpu.yaml", f"configs/tiny_cpu.yaml {STEPS}")],
    ("README.md", "tools/upcycle_ckpt.py --load Llama-3.2-1B"):
        [("output_dir=runs/llama_moe", f"output_dir=runs/llama_moe {STEPS}")],
    ("README.md", "tools/import_hf.py --load Qwen3-30B-A3B"):
        [("output_dir=runs/qwen3_cpt", f"output_dir=runs/qwen3_cpt {STEPS}")],
    ("docs/benchmarks.md", "tools/bench_moe_layer.py --json bench_layer.json"):
        [("--json bench_layer.json",
          "--json bench_layer.json --tokens 256 --warmup 0 --iters 1")],
    ("docs/continue-pretraining.md", "tools/import_hf.py --load Qwen3-30B-A3B"):
        [("output_dir=runs/qwen3_cpt", f"output_dir=runs/qwen3_cpt {STEPS}")],
    ("docs/instruction-tuning.md", "--config configs/simoe_instruct.yaml"):
        # exact match on the generated held-out set (900 generations) takes minutes: 2 examples
        [("configs/simoe_dense_seed.yaml", f"configs/simoe_dense_seed.yaml {STEPS}"),
         ("checkpoint.init_from=runs/simoe_dense_seed/checkpoints",
          f"checkpoint.init_from=runs/simoe_dense_seed/checkpoints {STEPS} "
          f"finetune.eval_data=[{INSTRUCT_EVAL}]")],
    ("docs/studies.md", "tools/study_routing.py --quick"):
        [("--quick", "--quick --variants aux_loss,bias")],
    ("docs/memory_planner.md", "--config configs/mixtral_8x7b.yaml --world 64"):
        [("--world 64", "--world 8")],
    ("docs/pretraining.md", "torchrun --standalone --nproc-per-node=2 -m megamoe.train"):
        [("configs/tiny_cpu.yaml\n", f"configs/tiny_cpu.yaml {STEPS}\n")],
    ("docs/upcycling.md", "tools/upcycle_ckpt.py --load Llama-3.2-1B"):
        [("output_dir=runs/llama_moe", f"output_dir=runs/llama_moe {STEPS}")],
    ("docs/pretraining.md", "output_dir=runs/tiny_top_p"):
        [("training.train_steps=20", STEPS)],
}

# Commands that train or convert models (tens of seconds or more on 2 cores): the slow tier.
SLOW = re.compile(r"megamoe\.train|megamoe-train|torchrun|from_pretrained|--measure|"
                  r"tools/(?:upcycle_ckpt|import_hf|export_hf|import_deepspeed_moe|"
                  r"preprocess_data|study_\w+|soak|bench_\w+|plot_expert_load)\.py")
# Released models the docs name -> (tests/hf_models.py architecture, its overrides): the working
# directory holds a tiny random one (with its release's kind of tokenizer) under that name when
# a block of the file names it. A doc naming another model adds it here.
MODELS: dict[str, tuple[str, dict]] = {
    "Qwen3-30B-A3B": ("qwen3_moe", {}),
    "Llama-3.2-1B": ("llama", {}),
}
CORPORA = ("my_corpus.jsonl", "corpus.jsonl")
BASH_TIMEOUT_S = 480

BLOCKS = [block for block in all_blocks() if block.runnable]


def _matches(key: tuple[str, str], block: Block) -> bool:
    return block.file == key[0] and key[1] in block.text


def tier(block: Block) -> str:
    """"slow" for a block that trains or converts models, else "quick"; a block that is not
    run is quick (it only reports its reason)."""
    if block.note == NOT_RUN:
        return "quick"
    text = block.text
    key = entry_for(block, SUBSTITUTIONS)
    if key is not None:
        for old, new in SUBSTITUTIONS[key]:
            text = text.replace(old, new)
    return "slow" if SLOW.search(text) else "quick"


def _param(block: Block):
    marks = [pytest.mark.slow] if tier(block) == "slow" else []
    return pytest.param(block, id=block.id, marks=marks)


def _corpus_lines(count: int = 300, seed: int = 0) -> list[str]:
    """`count` short documents of plain English, one JSON object {"text": ...} a line."""
    words = ("the expert router sends each token to the experts whose scores are highest and "
             "a balancing loss keeps the load even while the model learns to predict the next "
             "word of a sentence from the words before it in every layer of the network").split()
    rng = random.Random(seed)
    lines = []
    for index in range(count):
        sentences = [" ".join(rng.choice(words) for _ in range(rng.randint(6, 14))).capitalize()
                     + "." for _ in range(rng.randint(1, 4))]
        lines.append(json.dumps({"text": f"Document {index}. " + " ".join(sentences)}))
    return lines


@pytest.fixture(scope="session")
def doc_workdirs(tmp_path_factory):
    """file -> its Workdir, made on first use with the corpora; models are made by `_prepare`."""
    made: dict[str, Workdir] = {}

    def get(file: str) -> Workdir:
        if file not in made:
            base = tmp_path_factory.mktemp("doc-" + re.sub(r"\W", "_", file))
            workdir = Workdir.create(base)
            text = "\n".join(_corpus_lines()) + "\n"
            for name in CORPORA:
                (workdir.root / name).write_text(text)
            records = [{"prompt": "Task: Add 24 and 48.\nAnswer:", "response": " 72",
                        "task": "add"},
                       {"prompt": "Task: Subtract 8 from 36.\nAnswer:", "response": " 28",
                        "task": "subtract"}]
            (workdir.root / INSTRUCT_EVAL).write_text(
                "".join(json.dumps(record) + "\n" for record in records))
            made[file] = workdir
        return made[file]

    return get


@pytest.fixture(scope="module")
def python_imports():
    """torch, megamoe's layer and Megatron-Core with megamoe's Megatron modules imported (many
    seconds on 2 busy cores), for the python blocks: the imports are this shared fixture's cost,
    not the first block's."""
    import megatron.core.models.gpt  # noqa: F401
    import torch  # noqa: F401

    import megamoe.layer  # noqa: F401
    import megamoe.megatron.runtime  # noqa: F401
    import megamoe.megatron.specs  # noqa: F401


def _prepare(workdir: Workdir, script: str) -> None:
    """Make the tiny models `script` names that the working directory does not hold yet."""
    for name, (arch, overrides) in MODELS.items():
        target = workdir.root / name
        if re.search(r"(?<![\w./-])" + re.escape(name) + r"(?![\w.-])", script) and \
                not target.exists():
            from hf_models import save_tiny_hf_model

            save_tiny_hf_model(arch, target, tokenizer=True, **overrides)


@pytest.mark.parametrize("block", [_param(block) for block in BLOCKS])
def test_documented_block_runs(block: Block, doc_workdirs, request):
    script = substituted(block, SUBSTITUTIONS)  # first: a drifted table fails even when skipped
    if block.note == NOT_RUN:
        pytest.skip(f"{block.id}: {block.words}")
    workdir = doc_workdirs(block.file)
    _prepare(workdir, script)
    if tier(block) == "slow" or "megamoe.train" in script:
        workdir.link_corpus_cache(request.getfixturevalue("corpus_cache"))
    if block.lang == "python":
        request.getfixturevalue("python_imports")
        seconds = run_python(block, script, workdir)
    else:
        seconds = run_bash(block, script, workdir, timeout=BASH_TIMEOUT_S)
    print(f"{block.id}: {block.lang} block ran in {seconds:.1f} s ({tier(block)} tier)")


def test_substitution_table_matches_the_docs():
    """Every entry of SUBSTITUTIONS names exactly one runnable block, and each substituted
    block says so above its fence."""
    problems = []
    for key in SUBSTITUTIONS:
        found = [block for block in BLOCKS if _matches(key, block)]
        if len(found) != 1:
            problems.append(f"SUBSTITUTIONS entry {key} matches {len(found)} blocks "
                            f"({[b.id for b in found]}), not one")
        elif found[0].note != RUN_WITH:
            problems.append(f"SUBSTITUTIONS entry {key} is for {found[0].id}, which has no "
                            f"'*{RUN_WITH}: ...*' note above it")
    assert not problems, "\n".join(problems)


def test_notes_are_on_runnable_blocks():
    """A note above a block that is never run (```text, ```yaml) is a mistake in the docs."""
    misplaced = [f"{block.id} (```{block.lang or 'no language'})" for block in all_blocks()
                 if block.note and not block.runnable]
    assert not misplaced, f"test notes above blocks the tests never run: {misplaced}"


def test_parser_reads_notes_and_fences(tmp_path):
    """The parser on a small file: languages, indented fences, both notes (also wrapped over
    two lines and after a blank line), the line of each fence."""
    from doc_blocks import parse, without_pip_install

    (tmp_path / "docs").mkdir()
    doc = tmp_path / "README.md"
    doc.write_text(
        "# t\n\n*Not run by the tests: needs 8 GPUs.*\n```bash\ntorchrun x\n```\n"
        "Prose.\n*The tests run this\nwith: 2 steps.*\n\n```python\nprint(1)\n```\n"
        "- item\n\n  ```yaml\n  a: 1\n  ```\n```bash\necho ok\n```\n")
    blocks = parse(doc, tmp_path)
    assert [(b.line, b.lang, b.note, b.words) for b in blocks] == [
        (4, "bash", NOT_RUN, "needs 8 GPUs"), (11, "python", RUN_WITH, "2 steps"),
        (16, "yaml", None, ""), (19, "bash", None, "")]
    assert blocks[2].text == "a: 1\n" and blocks[1].text == "print(1)\n"
    assert without_pip_install(
        "pip install torch==2.13.0 -e '.[test]' && python -m pytest tests\n"
        "pip install -e '.[interop]'\npip install a \\\n    b\necho done\n") == \
        "python -m pytest tests\necho done\n"

"""A multi-domain instruction set megamoe generates itself: task families with checkable answers.

In the manner of Super-NaturalInstructions (Wang et al. 2022, arXiv 2204.07705), whole task
families are held out: `SEEN_FAMILIES` are for tuning, `UNSEEN_FAMILIES` only for evaluation.
Each unseen family recombines skills that seen families teach (sorting the other way, adding
three numbers, ...), so generalisation is possible but not given. Every example is a prompt and
one short answer that exact match can check; generation is seeded and needs no download.
"""
from __future__ import annotations

import datetime
import json
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from megamoe.atomic import atomic_write_text

WORDS = ("apple", "river", "stone", "cloud", "tiger", "lemon", "piano", "candle", "forest",
         "silver", "garden", "rocket", "window", "marble", "pepper", "castle", "violet", "anchor")
DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
UNITS = {("km", "m"): 1000, ("m", "cm"): 100, ("kg", "g"): 1000, ("hour", "minutes"): 60,
         ("minute", "seconds"): 60, ("litre", "ml"): 1000}
# Where a standard-library name is defined: checkable, and the corpus's own domain.
STDLIB_NAMES = {"OrderedDict": "collections", "Counter": "collections", "deque": "collections",
                "dumps": "json", "loads": "json", "sqrt": "math", "floor": "math",
                "chain": "itertools", "permutations": "itertools", "reduce": "functools",
                "lru_cache": "functools", "sub": "re", "findall": "re", "choice": "random",
                "shuffle": "random", "dataclass": "dataclasses", "Path": "pathlib",
                "deepcopy": "copy", "getcwd": "os", "argv": "sys"}


@dataclass(frozen=True)
class TaskFamily:
    name: str
    domain: str
    make: Callable[[random.Random], tuple[str, str]]
    """(instruction, answer) from a seeded generator."""


def _numbers(rng: random.Random, n: int, high: int = 50) -> list[int]:
    return [rng.randint(0, high) for _ in range(n)]


def _joined(values) -> str:
    return " ".join(str(v) for v in values)


def _date_after(rng: random.Random) -> tuple[str, str]:
    start = datetime.date(2020, 1, 1) + datetime.timedelta(days=rng.randint(0, 1500))
    days = rng.randint(1, 20)
    return (f"Which date is {days} days after {start.isoformat()}?",
            (start + datetime.timedelta(days=days)).isoformat())


def _weekday_after(rng: random.Random) -> tuple[str, str]:
    start, days = rng.randrange(7), rng.randint(1, 13)
    return f"Which day is {days} days after {DAYS[start]}?", DAYS[(start + days) % 7]


def _convert(rng: random.Random) -> tuple[str, str]:
    (big, small), factor = rng.choice(sorted(UNITS.items()))
    amount = rng.randint(1, 9)
    return f"How many {small} are in {amount} {big}?", str(amount * factor)


def _logic(rng: random.Random) -> tuple[str, str]:
    a, b, c, d = _numbers(rng, 4, 9)
    answer = "yes" if a > b and c > d else "no"
    return f"Is it true that {a} > {b} and {c} > {d}?", answer


def _stdlib(rng: random.Random) -> tuple[str, str]:
    name = rng.choice(sorted(STDLIB_NAMES))
    return f"Which standard-library module defines {name}?", STDLIB_NAMES[name]


def _find_position(rng: random.Random) -> tuple[str, str]:
    words, position = rng.sample(WORDS, 4), rng.randrange(4)
    return (f"At which position (from 1) is {words[position]} in: {_joined(words)}?",
            str(position + 1))


def _make_families() -> list[TaskFamily]:
    return [
        TaskFamily("add", "arithmetic", lambda r: (lambda a, b: (
            f"Add {a} and {b}.", str(a + b)))(*_numbers(r, 2))),
        TaskFamily("subtract", "arithmetic", lambda r: (lambda a, b: (
            f"Subtract {min(a, b)} from {max(a, b)}.", str(abs(a - b))))(*_numbers(r, 2))),
        TaskFamily("multiply", "arithmetic", lambda r: (lambda a, b: (
            f"Multiply {a} by {b}.", str(a * b)))(*_numbers(r, 2, 12))),
        TaskFamily("reverse_word", "strings", lambda r: (lambda w: (
            f"Reverse the letters of {w}.", w[::-1]))(r.choice(WORDS))),
        TaskFamily("uppercase", "strings", lambda r: (lambda w: (
            f"Write {w} in capital letters.", w.upper()))(r.choice(WORDS))),
        TaskFamily("first_letter", "strings", lambda r: (lambda w: (
            f"What is the first letter of {w}?", w[0]))(r.choice(WORDS))),
        TaskFamily("sort_ascending", "lists", lambda r: (lambda xs: (
            f"Sort in ascending order: {_joined(xs)}", _joined(sorted(xs))))(_numbers(r, 4))),
        TaskFamily("maximum", "lists", lambda r: (lambda xs: (
            f"What is the largest of {_joined(xs)}?", str(max(xs))))(_numbers(r, 4))),
        TaskFamily("find_position", "lists", _find_position),
        TaskFamily("unit_conversion", "units", _convert),
        TaskFamily("date_after", "dates", _date_after),
        TaskFamily("weekday_after", "dates", _weekday_after),
        TaskFamily("stdlib_module", "python", _stdlib),
        TaskFamily("logic_and", "logic", _logic),
        # Unseen families: the same skills, recombined.
        TaskFamily("add_three", "arithmetic", lambda r: (lambda a, b, c: (
            f"Add {a}, {b} and {c}.", str(a + b + c)))(*_numbers(r, 3, 30))),
        TaskFamily("sort_descending", "lists", lambda r: (lambda xs: (
            f"Sort in descending order: {_joined(xs)}",
            _joined(sorted(xs, reverse=True))))(_numbers(r, 4))),
        TaskFamily("minimum", "lists", lambda r: (lambda xs: (
            f"What is the smallest of {_joined(xs)}?", str(min(xs))))(_numbers(r, 4))),
        TaskFamily("last_letter", "strings", lambda r: (lambda w: (
            f"What is the last letter of {w}?", w[-1]))(r.choice(WORDS))),
    ]


FAMILIES = {family.name: family for family in _make_families()}
UNSEEN_FAMILIES = ("add_three", "sort_descending", "minimum", "last_letter")
SEEN_FAMILIES = tuple(name for name in FAMILIES if name not in UNSEEN_FAMILIES)


def render_prompt(instruction: str) -> str:
    """The one prompt template of the generated set (the answer follows after a space)."""
    return f"Task: {instruction}\nAnswer:"


def examples(families: tuple[str, ...], per_family: int, seed: int) -> Iterator[dict]:
    """`per_family` examples of each family, as jsonl records {prompt, response, task}."""
    for index, name in enumerate(families):
        rng = random.Random(seed * 1000 + index)
        for _ in range(per_family):
            instruction, answer = FAMILIES[name].make(rng)
            yield {"prompt": render_prompt(instruction), "response": f" {answer}", "task": name}


def write_instruction_set(directory: str | os.PathLike, per_family_train: int = 400,
                          per_family_eval: int = 50, seed: int = 0,
                          per_family_valid: int = 0) -> dict[str, Path]:
    """train.jsonl (seen families), eval_seen.jsonl (new examples of them) and eval_unseen.jsonl
    (held-out families), and with `per_family_valid` > 0 valid_seen.jsonl (more new examples of
    the seen families, for choosing hyperparameters without touching the evaluation sets); each
    written to a temporary file first and renamed."""
    directory = Path(directory)
    splits = {"train": (SEEN_FAMILIES, per_family_train, seed),
              "eval_seen": (SEEN_FAMILIES, per_family_eval, seed + 1),
              "eval_unseen": (UNSEEN_FAMILIES, per_family_eval, seed + 2)}
    if per_family_valid > 0:
        splits["valid_seen"] = (SEEN_FAMILIES, per_family_valid, seed + 3)
    paths = {}
    for split, (families, count, split_seed) in splits.items():
        paths[split] = directory / f"{split}.jsonl"
        atomic_write_text(paths[split], "".join(json.dumps(record) + "\n" for record in
                                                examples(families, count, split_seed)))
    return paths


def render_statement(instruction: str, answer: str) -> str:
    """A fact as pretraining prose states it: the question and its answer in one sentence,
    without the tuning template."""
    return f"{instruction} The answer is {answer}."


def write_knowledge_corpus(path: str | os.PathLike, documents: int, seed: int,
                           statements_per_document: int = 6) -> Path:
    """Pretraining text (jsonl, field `text`) stating facts of every family, seen and unseen, as
    prose (`render_statement`). Instruction tuning studies tune a language model that already
    knows how to do the held-out tasks from pretraining and test whether tuning unlocks that
    knowledge in the tuning template (FLAN, Wei et al. 2022, arXiv 2109.01652; T0, Sanh et al.
    2022, arXiv 2110.08207; the SIMoE paper's own setting): a seed model pretrained on this, and
    not only on code prose, has met the unseen families before it is tuned. Written atomically."""
    rng = random.Random(f"knowledge-{seed}")
    names = sorted(FAMILIES)

    def document() -> str:
        facts = (render_statement(*FAMILIES[rng.choice(names)].make(rng))
                 for _ in range(statements_per_document))
        return json.dumps({"text": "\n".join(facts)}) + "\n"

    atomic_write_text(path, "".join(document() for _ in range(documents)))
    return Path(path)

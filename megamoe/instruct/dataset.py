"""Instruction-tuning data: jsonl records -> padded [S] samples with the loss on responses only.

One record per line, in either form:
- `{"prompt": "...", "response": "...", "task": "..."}` (task optional, used by evaluation);
- `{"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...], "task": ...}`,
  chat turns rendered as "Role: content" lines, ending with an assistant turn; every assistant
  turn is trained on.
Each record becomes one sequence (no packing), right-padded to `seq_length`: the loss counts only
the trained (response) tokens and the end-of-sentence after each response; `prompt_mask` marks
the tokens before the first response, which is what SIMoE's router reads.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Optional

import torch
from torch.utils.data import Dataset

from megamoe.bounded import bounded_lines, parse_json
from megamoe.errors import DataError

ROLES = ("system", "user", "assistant")
MAX_RECORD_BYTES = 4 << 20
"""A jsonl line (one record) longer than this (4 MiB) is refused as soon as it is read."""


@dataclass(frozen=True)
class Record:
    segments: tuple[tuple[str, bool], ...]
    """(text, trained) in order; trained segments are responses."""
    task: Optional[str]
    prompt: str
    """The text before the first response (what generation starts from at evaluation)."""
    response: str
    """The first response (what exact match compares against)."""


class InstructionBatch(NamedTuple):
    """A micro-batch: every field is [B, S]; the first four are those of `train.data.Batch`."""

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    prompt_mask: torch.Tensor  # bool, True on the prompt's tokens


def _chat_segments(messages, where: str) -> tuple[tuple[str, bool], ...]:
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: 'messages' must be a non-empty list of {{role, content}}")
    segments = []
    for turn in messages:
        role = turn.get("role") if isinstance(turn, dict) else None
        content = turn.get("content") if isinstance(turn, dict) else None
        if role not in ROLES or not isinstance(content, str):
            raise DataError(f"{where}: each message needs a role in {ROLES} and a string "
                            f"content; got {turn!r:.80}")
        if role == "assistant":
            segments += [("Assistant:", False), (f" {content}", True), ("\n", False)]
        else:
            segments.append((f"{role.capitalize()}: {content}\n", False))
    if messages[-1]["role"] != "assistant":
        raise DataError(f"{where}: the last message must be the assistant's (the response)")
    return tuple(segments[:-1])  # no newline after the last response


def parse_record(line: str, where: str) -> Record:
    """One jsonl line as a Record; a malformed one raises DataError naming `where`."""
    raw = parse_json(line, DataError, where)
    if not isinstance(raw, dict):
        raise DataError(f"{where}: expected a JSON object with prompt/response or messages")
    task = raw.get("task")
    if "messages" in raw:
        segments = _chat_segments(raw["messages"], where)
    elif isinstance(raw.get("prompt"), str) and isinstance(raw.get("response"), str):
        segments = ((raw["prompt"], False), (raw["response"], True))
    else:
        raise DataError(f"{where}: needs string 'prompt' and 'response' fields, or 'messages'")
    first = next(i for i, (_, trained) in enumerate(segments) if trained)
    prompt = "".join(text for text, _ in segments[:first])
    if not segments[first][0].strip():
        raise DataError(f"{where}: the response is empty; every record needs something to learn")
    return Record(segments, task if isinstance(task, str) else None, prompt, segments[first][0])


def read_records(path: str | Path) -> list[Record]:
    """Every record of a jsonl file (blank lines skipped); a line is at most MAX_RECORD_BYTES
    and nests at most `bounded.MAX_DEPTH` deep."""
    try:
        records = [parse_record(line, f"{path}:{number}") for number, line in
                   bounded_lines(path, MAX_RECORD_BYTES, DataError, str(path)) if line.strip()]
    except OSError as err:
        raise DataError(f"cannot read instruction data {path} ({err.strerror})") from None
    if not records:
        raise DataError(f"{path} holds no records; write one JSON object per line")
    return records


class InstructionDataset(Dataset):
    """Records tokenized once, each one padded sample of `seq_length` positions."""

    def __init__(self, path: str | Path, tokenizer, seq_length: int) -> None:
        self.records = read_records(path)
        pad = tokenizer.pad if tokenizer.pad >= 0 else tokenizer.eod
        self.samples = [self._encode(record, tokenizer, seq_length, pad, f"{path}:{i + 1}")
                        for i, record in enumerate(self.records)]

    @staticmethod
    def _encode(record: Record, tokenizer, seq_length: int, pad: int, where: str) -> dict:
        ids, trained, prompt_length = [], [], None
        for text, is_response in record.segments:
            if is_response and prompt_length is None:
                prompt_length = len(ids)
            piece = tokenizer.tokenize(text) + ([tokenizer.eod] if is_response else [])
            ids += piece
            trained += [is_response] * len(piece)
        if len(ids) > seq_length + 1:
            raise DataError(f"{where}: {len(ids)} tokens do not fit seq_length {seq_length}; "
                            "shorten the record or raise model.seq_length")
        fill = seq_length + 1 - len(ids)
        ids, trained = ids + [pad] * fill, trained + [False] * fill
        tokens = torch.tensor(ids[:-1])
        return {"tokens": tokens, "labels": torch.tensor(ids[1:]),
                "loss_mask": torch.tensor(trained[1:], dtype=torch.float32),
                "position_ids": torch.arange(seq_length),
                "prompt_mask": torch.arange(seq_length) < prompt_length}

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict:
        return self.samples[index]


def collate(samples: list[dict]) -> InstructionBatch:
    return InstructionBatch(*(torch.stack([s[key] for s in samples])
                              for key in InstructionBatch._fields))

"""Instruction data and exact-match evaluation, against references computed here: tokens counted
piece by piece, answers recomputed from the prompts, and an oracle model that knows the answers."""
import datetime
import json
import re

import pytest
import torch

from megamoe.errors import DataError
from megamoe.instruct import tasks
from megamoe.instruct.dataset import InstructionDataset, collate, read_records
from megamoe.instruct.evaluate import exact_match
from megamoe.train.tokenizer import SentencePieceTokenizer, train_sentencepiece

SEQ = 64


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("instruct")
    paths = tasks.write_instruction_set(root, per_family_train=30, per_family_eval=10)
    lines = [r["prompt"] + r["response"] for r in map(json.loads, open(paths["train"]))]
    lines += [r["prompt"] + r["response"] for r in map(json.loads, open(paths["eval_unseen"]))]
    (root / "tok.model").write_bytes(train_sentencepiece(lines, vocab_size=400))
    return paths, SentencePieceTokenizer(root / "tok.model")


# Answers recomputed from the question, and the question's shape, for some families.
RECOMPUTE = {
    "add": lambda q: sum(map(int, re.findall(r"\d+", q))),
    "add_three": lambda q: sum(map(int, re.findall(r"\d+", q))),
    "sort_descending": lambda q: " ".join(
        map(str, sorted(map(int, q.split(":")[1].split()), reverse=True))),
    "date_after": lambda q: (lambda n, d: (datetime.date.fromisoformat(d)
                                           + datetime.timedelta(days=int(n))).isoformat())(
        *re.match(r"Which date is (\d+) days after ([\d-]+)\?", q).groups()),
    "reverse_word": lambda q: q.rsplit(" ", 1)[1].rstrip(".")[::-1],
}
QUESTION = {"add": r"Add \d+ and \d+\.$", "add_three": r"Add \d+, \d+ and \d+\.$",
            "sort_descending": r"Sort in descending order: ", "date_after": r"Which date is ",
            "reverse_word": r"Reverse the letters of "}


def test_families_split_and_answers_check():
    assert len(tasks.FAMILIES) >= 12
    assert not set(tasks.SEEN_FAMILIES) & set(tasks.UNSEEN_FAMILIES)
    assert len({tasks.FAMILIES[n].domain for n in tasks.SEEN_FAMILIES}) >= 6
    for name, answer_of in RECOMPUTE.items():
        for record in tasks.examples((name,), 20, seed=4):
            question = record["prompt"].removeprefix("Task: ").removesuffix("\nAnswer:")
            assert record["response"] == f" {answer_of(question)}"
    again = list(tasks.examples(tasks.SEEN_FAMILIES, 3, seed=9))
    assert again == list(tasks.examples(tasks.SEEN_FAMILIES, 3, seed=9))


def test_knowledge_corpus_states_facts_of_seen_and_unseen_families_as_prose(tmp_path):
    path = tasks.write_knowledge_corpus(tmp_path / "facts.jsonl", documents=80, seed=3)
    assert [p.name for p in tmp_path.iterdir()] == ["facts.jsonl"]
    statements = [line for record in map(json.loads, open(path))
                  for line in record["text"].split("\n")]
    assert len(statements) == 80 * 6
    checked = dict.fromkeys(RECOMPUTE, 0)
    for statement in statements:
        question, answer = re.fullmatch(r"(.+) The answer is (.+)\.", statement).groups()
        assert "Task:" not in question and "Answer:" not in question
        for name, shape in QUESTION.items():
            if re.match(shape, question):
                assert answer == str(RECOMPUTE[name](question)), statement
                checked[name] += 1
    assert min(checked.values()) > 0  # seen and unseen families among them
    assert any(s.startswith("What is the last letter of ") for s in statements)
    again = tasks.write_knowledge_corpus(tmp_path / "again.jsonl", documents=80, seed=3)
    other = tasks.write_knowledge_corpus(tmp_path / "other.jsonl", documents=80, seed=4)
    assert again.read_text() == path.read_text() != other.read_text()


def test_validation_split_is_a_new_draw_of_the_seen_families(tmp_path):
    paths = tasks.write_instruction_set(tmp_path, per_family_train=4, per_family_eval=6,
                                        per_family_valid=6)
    valid, seen = ([json.loads(line) for line in open(paths[split])]
                   for split in ("valid_seen", "eval_seen"))
    assert [r["task"] for r in valid] == [r["task"] for r in seen]
    assert sorted({r["task"] for r in valid}) == sorted(tasks.SEEN_FAMILIES)
    assert sum(v["prompt"] != s["prompt"] for v, s in zip(valid, seen)) > len(seen) // 2
    assert "valid_seen" not in tasks.write_instruction_set(tmp_path / "plain", 1, 1)


def test_loss_covers_exactly_the_response_and_its_end(data):
    paths, tok = data
    dataset = InstructionDataset(paths["train"], tok, SEQ)
    for record, sample in zip(dataset.records[::37], dataset.samples[::37]):
        prompt_ids = tok.tokenize(record.prompt)
        response_ids = tok.tokenize(record.response) + [tok.eos]
        n_prompt, n_all = len(prompt_ids), len(prompt_ids) + len(response_ids)
        assert sample["tokens"][:n_all - 1].tolist() == (prompt_ids + response_ids)[:-1]
        trained = [i for i, v in enumerate(sample["loss_mask"].tolist()) if v]
        assert trained == list(range(n_prompt - 1, n_all - 1))
        assert sample["labels"][trained].tolist() == response_ids
        assert sample["prompt_mask"].tolist() == [i < n_prompt for i in range(SEQ)]
    batch = collate(dataset.samples[:3])
    assert batch.tokens.shape == batch.prompt_mask.shape == (3, SEQ)


def test_chat_records_train_every_assistant_turn(tmp_path, data):
    _, tok = data
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": [
        {"role": "user", "content": "Add 1 and 2."}, {"role": "assistant", "content": "3"},
        {"role": "user", "content": "Add 2 and 2."}, {"role": "assistant", "content": "4"}]})
        + "\n")
    (record,) = read_records(path)
    assert record.prompt == "User: Add 1 and 2.\nAssistant:" and record.response == " 3"
    sample = InstructionDataset(path, tok, SEQ).samples[0]
    trained_labels = sample["labels"][sample["loss_mask"] > 0].tolist()
    assert trained_labels == tok.tokenize(" 3") + [tok.eos] + tok.tokenize(" 4") + [tok.eos]


@pytest.mark.parametrize("line, message", [
    ("not json", "not valid JSON"),
    ('{"prompt": "x"}', "needs string 'prompt' and 'response'"),
    ('{"prompt": "x", "response": "  "}', "response is empty"),
    ('{"messages": [{"role": "user", "content": "x"}]}', "last message must be the assistant"),
    ('{"messages": [{"role": "bot", "content": "x"}]}', "role in"),
])
def test_bad_records_name_file_and_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a", "response": " b"}\n' + line + "\n")
    with pytest.raises(DataError, match=f"bad.jsonl:2: .*{re.escape(message)}"):
        read_records(path)


def test_record_longer_than_the_sequence_is_refused(tmp_path, data):
    _, tok = data
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"prompt": "Add 1 and 2. " * 60, "response": " 3"}) + "\n")
    with pytest.raises(DataError, match="do not fit seq_length 64"):
        InstructionDataset(path, tok, SEQ)


def oracle(records, tok, wrong_task=None):
    """A 'model' whose next-token logits follow each record's reference answer."""
    table = {}
    for r in records:
        ids = tok.tokenize(r.prompt) + tok.tokenize(r.response) + [tok.eos]
        for cut in range(len(tok.tokenize(r.prompt)), len(ids)):
            table[tuple(ids[:cut])] = ids[cut] if r.task != wrong_task else tok.eos
    def forward(tokens_BS, prompt_mask_BS):
        logits = torch.zeros(*tokens_BS.shape, tok.vocab_size)
        for b, row in enumerate(tokens_BS.tolist()):
            logits[b, -1, table.get(tuple(row), tok.eos)] = 1.0
        return logits
    return forward


def test_exact_match_scores_per_family(data):
    paths, tok = data
    records = read_records(paths["eval_unseen"])
    assert exact_match(oracle(records, tok), tok, records)["all"] == 1.0
    scores = exact_match(oracle(records, tok, wrong_task="minimum"), tok, records)
    assert scores["minimum"] == 0.0 and scores["last_letter"] == 1.0
    assert scores["all"] == pytest.approx(1 - 1 / len(tasks.UNSEEN_FAMILIES))

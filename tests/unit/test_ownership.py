"""megamoe.ownership: a tool replaces or deletes only an empty folder or one with its own mark;
a replaced folder is whole at every moment; a mark that is a link or another tool's is no mark.
(Every tool's output flags against inputs, users' folders and docs/: tests/faults/
test_tool_outputs.py.)"""
from __future__ import annotations

import os

import pytest

from megamoe.atomic import atomic_directory
from megamoe.errors import ConfigError
from megamoe.ownership import (MARK, check_file_output, check_folder_output, claim_folder,
                               fresh_folder, outside_mark, owner, replace_folder)


def files(folder) -> dict[str, str]:
    return {str(p.relative_to(folder)): p.read_text() for p in folder.rglob("*") if p.is_file()}


def test_a_claimed_folder_is_kept_and_replaced_only_by_its_tool(tmp_path):
    out = claim_folder(tmp_path / "out", "tool_a", "--out")
    assert files(out) == {MARK: "tool_a\n"}
    (out / "result.txt").write_text("old")
    assert claim_folder(out, "tool_a", "--out") == out and (out / "result.txt").exists()
    with pytest.raises(ConfigError, match="it is tool_a's output"):
        check_folder_output(out, "tool_b", "--out")
    new = tmp_path / "new"
    new.mkdir()
    (new / "result.txt").write_text("new")
    replace_folder(new, out, "tool_a", "--out")
    assert files(out) == {MARK: "tool_a\n", "result.txt": "new"} and not new.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no leftover old folder
    assert files(fresh_folder(out, "tool_a", "--out")) == {MARK: "tool_a\n"}


@pytest.mark.parametrize("kind", ["user's folder", "linked mark", "file"])
def test_anything_else_is_refused_untouched(tmp_path, kind):
    target = tmp_path / "target"
    if kind == "file":
        target.write_text("mine")
    else:
        target.mkdir()
        (target / "thesis.txt").write_text("mine")
        if kind == "linked mark":  # a mark must be the folder's own small file
            (tmp_path / "elsewhere").write_text("tool_a\n")
            os.symlink(tmp_path / "elsewhere", target / MARK)
            assert owner(target) is None
    before = files(tmp_path)
    for attempt in (lambda: claim_folder(target, "tool_a", "--out"),
                    lambda: fresh_folder(target, "tool_a", "--out"),
                    lambda: check_folder_output(target, "tool_a", "--out")):
        with pytest.raises(ConfigError) as err:
            attempt()
        assert str(target) in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ConfigError):
        with atomic_directory(target, owner="tool_a", overwrite=True) as tmp:
            (tmp / "x").write_text("x")
    assert files(tmp_path) == before


def test_atomic_directory_marks_its_output_and_overwrites_only_its_own(tmp_path):
    target = tmp_path / "ckpt"
    with atomic_directory(target, owner="tool_a") as tmp:
        (tmp / "weights").write_text("1")
    assert files(target) == {MARK: "tool_a\n", "weights": "1"}
    with pytest.raises(ConfigError, match="exists; choose another path or pass --overwrite"):
        with atomic_directory(target, owner="tool_a"):
            pass
    with pytest.raises(ConfigError, match="did not write"):
        with atomic_directory(target, owner="tool_b", overwrite=True):
            pass
    with atomic_directory(target, owner="tool_a", overwrite=True) as tmp:
        (tmp / "weights").write_text("2")
    assert files(target) == {MARK: "tool_a\n", "weights": "2"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_an_output_that_holds_only_its_own_files_is_marked_beside_it(tmp_path):
    """A Hugging Face export (uploaded as it is) carries no mark: `.<name>.megamoe-owner` beside
    it names its tool, written before the folder is renamed in, kept by an overwrite, and it
    alone makes the folder the tool's."""
    target, beside = tmp_path / "hf", tmp_path / f".hf{MARK}"
    assert outside_mark(target) == beside
    with atomic_directory(target, owner="tool_a", outside_mark=True) as tmp:
        (tmp / "config.json").write_text("{}")
    assert files(target) == {"config.json": "{}"} and beside.read_text() == "tool_a\n"
    assert owner(target) == "tool_a"
    with pytest.raises(ConfigError, match="it is tool_a's output"):
        with atomic_directory(target, owner="tool_b", overwrite=True, outside_mark=True):
            pass
    with atomic_directory(target, owner="tool_a", overwrite=True, outside_mark=True) as tmp:
        (tmp / "config.json").write_text("{}\n")
    assert files(target) == {"config.json": "{}\n"} and beside.read_text() == "tool_a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [beside.name, "hf"]
    beside.unlink()  # without its mark the folder is anyone's: refused untouched
    with pytest.raises(ConfigError, match="did not write"):
        with atomic_directory(target, owner="tool_a", overwrite=True, outside_mark=True):
            pass
    assert files(target) == {"config.json": "{}\n"} and not beside.exists()
    # an output of before, marked inside, is replaced by one marked beside
    (target / MARK).write_text("tool_a\n")
    with atomic_directory(target, owner="tool_a", overwrite=True, outside_mark=True) as tmp:
        (tmp / "config.json").write_text("{}")
    assert files(target) == {"config.json": "{}"} and beside.read_text() == "tool_a\n"


def test_a_file_output_never_replaces_a_folder_or_an_input(tmp_path):
    (tmp_path / "folder").mkdir()
    (tmp_path / "input.yaml").write_text("a: 1\n")
    with pytest.raises(ConfigError, match="is a folder"):
        check_file_output(tmp_path / "folder", "--json")
    os.symlink(tmp_path / "input.yaml", tmp_path / "link.yaml")  # the input, through a link
    with pytest.raises(ConfigError, match="is the input"):
        check_file_output(tmp_path / "link.yaml", "--json", [tmp_path / "input.yaml"])
    assert check_file_output(tmp_path / "plan.json", "--json", [tmp_path / "input.yaml"]) == \
        (tmp_path / "plan.json").resolve()

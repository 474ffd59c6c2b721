"""Every read of an input is bounded by the file's real size (issue 46, item 3): sizes come from
`os.stat` before anything is read, devices, FIFOs and folders are refused in one line, and a
header's claims are checked against the file before anything is allocated. The memory of each
refusal is measured as the peak resident memory of a fresh process beyond what it held before
the read (`resource.getrusage`), so the bound is independent of the interpreter's own size."""
from __future__ import annotations

import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from megamoe.bounded import read_bytes_bounded, regular_file_size
from megamoe.checkpointing.layout import TRACKER, read_tracker
from megamoe.checkpointing.manifest import MANIFEST_FILE, verify_folder
from megamoe.checkpointing.safe_dcp import read_dcp_metadata
from megamoe.checkpointing.torch_files import load_torch_file
from megamoe.errors import CheckpointError, DataError

REPO = Path(__file__).resolve().parents[2]
SPARSE_BYTES = 2 << 30
MEMORY_BOUND_KIB = 8 << 10  # a few MiB beyond the interpreter
TIME_BOUND_S = 5.0

# Runs `check_indexed_dataset(PREFIX, 100)` and prints "<refused|accepted> <peak RSS growth KiB>
# <seconds> <message>"; the baseline is taken after every import.
MEASURE = """
import resource, sys, time
from megamoe.errors import DataError
from megamoe.train.indexed_check import check_indexed_dataset
before, start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, time.perf_counter()
try:
    check_indexed_dataset(sys.argv[1], 100)
    outcome, message = "accepted", ""
except DataError as err:
    outcome, message = "refused", str(err)
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(outcome, grown, time.perf_counter() - start, message)
"""


def sparse_index(prefix: Path, sequences: int, documents: int) -> None:
    """A 2 GiB `.idx` with a valid header and no data on disk (a sparse file: reading it gives
    zeros), and an empty `.bin`."""
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, sequences, documents))
        f.truncate(SPARSE_BYTES)
    Path(f"{prefix}.bin").touch()


def measure(prefix: Path) -> tuple[str, int, float, str]:
    done = subprocess.run([sys.executable, "-c", MEASURE, str(prefix)], cwd=REPO,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-2000:]
    outcome, grown, seconds, message = done.stdout.split(" ", 3)
    print(f"{prefix.name}: {outcome} in {float(seconds):.2f} s, peak RSS +{int(grown)} KiB")
    return outcome, int(grown), float(seconds), message.strip()


@pytest.mark.parametrize("name, claims, fragment", [
    # counts that fill the file exactly; the zeros are not document boundaries 0..N
    ("filled", ((SPARSE_BYTES - 34) // 20 - 1, (SPARSE_BYTES - 34) // 20), "document boundaries"),
    # counts that need more bytes than the file has (2**40 sequences)
    ("overclaimed", (1 << 40, 1), "its header describes"),
])
def test_sparse_index_is_refused_in_bounded_memory_and_time(tmp_path, name, claims, fragment):
    prefix = tmp_path / name
    sparse_index(prefix, *claims)
    outcome, grown, seconds, message = measure(prefix)
    assert outcome == "refused" and fragment in message and "\n" not in message
    assert grown < MEMORY_BOUND_KIB and seconds < TIME_BOUND_S


@pytest.mark.parametrize("kind", ["device", "fifo", "folder"])
def test_readers_refuse_what_is_not_a_regular_file(tmp_path, kind):
    """Tracker, manifest, torch file, DCP metadata and the indexed dataset: each refused in one
    line before it is opened (a FIFO would block an open, /dev/zero never ends)."""
    folder = tmp_path / "ckpt"
    folder.mkdir()

    def place(path: Path) -> Path:
        if kind == "device":
            path.symlink_to("/dev/zero")
        elif kind == "fifo":
            os.mkfifo(path)
        else:
            path.mkdir()
        return path

    readers = {
        "tracker": lambda: read_tracker(place(folder / TRACKER).parent),
        "manifest": lambda: verify_folder(place(folder / MANIFEST_FILE).parent),
        "torch file": lambda: load_torch_file(place(folder / "model.pt")),
        "DCP metadata": lambda: read_dcp_metadata(place(folder / ".metadata")),
    }
    for what, read in readers.items():
        try:
            problem = read()
        except CheckpointError as err:
            problem = str(err)
        assert problem and "regular file" in problem and "\n" not in problem, what
    prefix = tmp_path / "data"
    place(Path(f"{prefix}.idx"))
    Path(f"{prefix}.bin").touch()
    from megamoe.train.indexed_check import check_indexed_dataset

    with pytest.raises(DataError, match="regular file"):
        check_indexed_dataset(str(prefix))


def test_bounded_read_refuses_a_file_larger_than_its_limit_before_reading(tmp_path):
    big = tmp_path / "big"
    with open(big, "wb") as f:
        f.truncate(SPARSE_BYTES)
    assert regular_file_size(tmp_path / "big", SPARSE_BYTES, DataError, "big") == SPARSE_BYTES
    with pytest.raises(DataError, match="larger than 1,024"):
        read_bytes_bounded(big, 1024, DataError, "big")


# Runs the command in argv and prints its peak resident memory (KiB), passing on its stderr and
# exit code: RUSAGE_CHILDREN of a fresh process covers that one child only.
PEAK = """
import resource, subprocess, sys
done = subprocess.run(sys.argv[1:], capture_output=True, text=True)
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
sys.stderr.write(done.stderr)
sys.exit(done.returncode)
"""


def trainer_refusal(tmp_path: Path, tokenizer: str) -> tuple[int, str]:
    """(peak RSS in KiB, stderr) of `python -m megamoe.train` with `data.tokenizer=tokenizer`,
    which must refuse it: exit code 2, one line, no output folder."""
    out = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-c", PEAK, sys.executable, "-m", "megamoe.train", "--config",
         str(REPO / "configs" / "tiny_cpu.yaml"), f"output_dir={out}", "parallel.expert=1",
         f"data.tokenizer={tokenizer}"], cwd=tmp_path, capture_output=True, text=True,
        timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    lines = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert done.returncode == 2 and len(lines) == 1 and "Traceback" not in done.stderr, \
        done.stderr[-3000:]
    assert not out.exists()
    return int(done.stdout.split()[-1]), lines[0]


def test_trainer_refuses_dev_zero_tokenizer_in_the_memory_of_any_refusal(tmp_path):
    """data.tokenizer=/dev/zero grew the trainer to 22 GB before; now it costs what refusing a
    missing tokenizer costs (the same interpreter and imports), within a few MiB."""
    zero_kib, message = trainer_refusal(tmp_path, "/dev/zero")
    missing_kib, _ = trainer_refusal(tmp_path, str(tmp_path / "missing.model"))
    print(f"/dev/zero tokenizer: peak RSS {zero_kib} KiB; missing tokenizer {missing_kib} KiB")
    assert "/dev/zero" in message
    assert zero_kib - missing_kib < MEMORY_BOUND_KIB

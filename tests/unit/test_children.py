"""megamoe.children: a SIGTERM to a tool ends the children it trains in (against the plain process
tree: without the handler the children outlive the tool), and a child's stdout can be shown while
it runs."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from megamoe.children import run_child

REPO = Path(__file__).resolve().parents[2]

TOOL = textwrap.dedent("""
    import sys
    from concurrent.futures import ThreadPoolExecutor
    from megamoe.children import end_children_on_sigterm, run_child

    folder = sys.argv[1]
    child = ("import os, time; open(os.path.join({!r}, str(os.getpid())), 'w').close(); "
             "time.sleep(120)").format(folder)
    end_children_on_sigterm()
    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(lambda _: run_child([sys.executable, "-c", child]), range(4)))
""")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
def test_sigterm_ends_running_children_and_starts_no_more(tmp_path):
    tool = subprocess.Popen([sys.executable, "-c", TOOL, str(tmp_path)], cwd=REPO,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while len(os.listdir(tmp_path)) < 2:
            assert time.monotonic() < deadline and tool.poll() is None, "children never started"
            time.sleep(0.1)
        tool.send_signal(signal.SIGTERM)
        _, stderr = tool.communicate(timeout=60)
    finally:
        tool.kill()
    children = [int(name) for name in os.listdir(tmp_path)]
    assert tool.returncode == 143, stderr
    assert "stopped by SIGTERM" in stderr
    assert len(children) == 2  # the two queued runs never started
    assert not [pid for pid in children if _alive(pid)]


def test_echo_prefix_shows_each_stdout_line_while_the_child_runs(tmp_path, capsys):
    go = tmp_path / "go"
    child = textwrap.dedent(f"""
        import os, sys, time
        print("step 1/2", flush=True)
        print("a warning", file=sys.stderr, flush=True)
        deadline = time.monotonic() + 60
        while not os.path.exists({str(go)!r}) and time.monotonic() < deadline:
            time.sleep(0.05)
        print("step 2/2")
    """)
    with ThreadPoolExecutor(max_workers=1) as pool:
        done = pool.submit(run_child, [sys.executable, "-c", child], echo_prefix="[run] ")
        shown, deadline = "", time.monotonic() + 60
        while "[run] step 1/2\n" not in shown:  # echoed before the child may exit
            assert time.monotonic() < deadline and not done.done(), shown
            time.sleep(0.05)
            shown += capsys.readouterr().out
        go.touch()
        result = done.result(timeout=60)
    shown += capsys.readouterr().out
    assert shown == "[run] step 1/2\n[run] step 2/2\n"
    assert (result.returncode, result.stdout, result.stderr) == (0, "step 1/2\nstep 2/2\n",
                                                                 "a warning\n")

"""A SIGTERM to a tool ends the children it trains in (megamoe.children), against the plain
process tree: without the handler the children outlive the tool."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

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

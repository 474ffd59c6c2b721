"""A stop signal to a run whose step cannot end: the rank exits once the grace period has passed
(code 128 + the signal), whether its main thread runs Python or waits inside one native call;
a step that ends in time stops the clock. Each case is a fresh interpreter running
`megamoe.train.signals` alone (no torch), signalled as SLURM and torchrun signal a trainer."""
from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.quick(budget_s=15)

# The step a case runs after "ready": Python that never ends; a native call that does not return
# to the interpreter (the main thread blocks the signal, so another thread takes it and Python's
# handler never runs: the wakeup pipe alone must start the clock); a step that ends in time.
STEPS = {
    "python": "while True:\n        time.sleep(0.01)",
    "native": "ctypes.CDLL(None).sleep(30)",
    "ends": "while not stop.requested:\n        time.sleep(0.01)\n    stop.step_ended()\n"
            "    time.sleep(2)\n    print('saved', flush=True)",
}
SCRIPT = """
import ctypes, signal, sys, time
from megamoe.train.signals import StopRequest
with StopRequest(grace_s=1.0) as stop:
    stop.step_ended()  # a step that ended before the signal does not stop the later clock
    if {block}:
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])
    print("ready", flush=True)
    {step}
"""


def _signalled(step: str, signum: int) -> tuple[subprocess.CompletedProcess, float]:
    script = SCRIPT.format(step=STEPS[step], block=step == "native")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        sent = time.monotonic()
        proc.send_signal(signum)
        proc.send_signal(signum)  # torchrun forwards what SLURM also sends
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), \
        time.monotonic() - sent


@pytest.mark.parametrize("step", ["python", "native"])
def test_a_step_that_cannot_end_exits_after_the_grace_period(step):
    done, seconds = _signalled(step, signal.SIGTERM)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    assert 1.0 <= seconds < 10
    assert done.stderr.splitlines()[-1] == (
        "SIGTERM: this step did not end within training.stop_grace_s=1 s; exiting without a "
        "new checkpoint (the last one stays)")


def test_a_step_that_ends_in_time_is_not_cut_short():
    done, seconds = _signalled("ends", signal.SIGUSR1)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["saved"] and seconds >= 2
    assert done.stderr.splitlines() == ["received SIGUSR1: checkpointing after this step"]


def test_restore_gives_back_the_handlers_it_replaced():
    from megamoe.train.signals import STOP_SIGNALS, StopRequest

    before = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    with StopRequest(grace_s=5.0):
        assert all(signal.getsignal(signum) != before[signum] for signum in STOP_SIGNALS)
    assert {signum: signal.getsignal(signum) for signum in STOP_SIGNALS} == before
    assert signal.set_wakeup_fd(-1) == -1  # no wakeup pipe left behind

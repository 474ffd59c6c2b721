"""Pre-emption: SIGTERM, SIGUSR1 or SIGINT (Ctrl-C) asks the run to checkpoint and exit.

SLURM sends SIGUSR1 ahead of the time limit (launch/pretrain_moe.sh forwards it to every
trainer) and SIGTERM on scancel or pre-emption; torchrun forwards SIGTERM too, so one rank may
get it twice. The handler only records the first signal; the loop finishes its current step,
all ranks agree (a rank that got nothing still stops at the same step), save, and exit 0 so the
job can be requeued and resume from the checkpoint. A second SIGINT interrupts at once, as
Ctrl-C does elsewhere (a save it interrupts leaves a temporary folder, which the next run
removes).

A step that cannot end (a peer that died inside a collective, an optimizer that never
converges) would hold the run until SIGKILL. So a rank that has not reached the end of a step
`grace_s` seconds after the first stop signal exits at once, with code 128 + the signal and no
new checkpoint; the last complete one stays (saves are atomic), and so nothing is left
half-written. The end of a step comes before its checkpoint is written, so that save is never
cut short; a save already under way when the signal comes counts toward the grace. The grace
clock starts when the signal arrives, even while the main thread is inside one long native call
(Python runs its handlers only between bytecodes): the C-level handler writes the signal's
number to a wakeup pipe (`signal.set_wakeup_fd`), which a watcher thread reads.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Optional

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class StopRequest:
    """Records the first stop signal this process receives; ends the process when the step has
    not ended `grace_s` seconds later (0: never)."""

    def __init__(self, grace_s: float = 0.0) -> None:
        self.signum: Optional[int] = None
        self.grace_s = grace_s
        self._step_ended = threading.Event()
        self._signalled = False  # the watcher read a stop signal (its handler may not have run)
        self._previous: dict = {}
        self._wakeup: Optional[int] = None
        self._read_end: Optional[int] = None
        self._watcher: Optional[threading.Thread] = None
        self._previous_wakeup = -1

    def install(self) -> None:
        """Handle the stop signals in this process until `restore` (main thread only)."""
        self._previous = {signum: signal.signal(signum, self._handle) for signum in STOP_SIGNALS}
        if self.grace_s > 0:
            self._read_end, self._wakeup = os.pipe()
            os.set_blocking(self._wakeup, False)
            self._previous_wakeup = signal.set_wakeup_fd(self._wakeup, warn_on_full_buffer=False)
            self._watcher = threading.Thread(target=self._watch, name="stop-grace", daemon=True)
            self._watcher.start()

    def restore(self) -> None:
        """The handlers and wakeup pipe from before `install` (the watcher thread ends). The
        pipe stays open until then, so a later signal (torchrun forwards what SLURM also sends)
        always finds a reader end to write its byte to."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        if self._wakeup is not None:
            signal.set_wakeup_fd(self._previous_wakeup)
            self._step_ended.set()
            os.close(self._wakeup)  # the watcher, if still reading, reads the end of the pipe
            self._watcher.join(timeout=5.0)
            os.close(self._read_end)
            self._wakeup = self._read_end = None

    def _handle(self, signum: int, frame) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if self.signum is None:
            self.signum = signum
            print(f"received {signal.Signals(signum).name}: checkpointing after this step",
                  file=sys.stderr, flush=True)

    def _watch(self) -> None:
        """Wait for the first stop signal's byte on the wakeup pipe, then for the step's end."""
        stops: list[int] = []
        while not stops:
            received = os.read(self._read_end, 64)
            if not received:  # restored: the run is over
                return
            stops = [signum for signum in received if signum in STOP_SIGNALS]
        self._signalled = True
        if self._step_ended.wait(self.grace_s):
            return
        name = signal.Signals(stops[0]).name
        print(f"{name}: this step did not end within training.stop_grace_s={self.grace_s:g} s; "
              "exiting without a new checkpoint (the last one stays)", file=sys.stderr,
              flush=True)
        os._exit(128 + stops[0])

    def __enter__(self) -> StopRequest:
        self.install()
        return self

    def __exit__(self, *exc) -> None:
        self.restore()

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def step_ended(self) -> None:
        """The loop reached the end of a step (before its checkpoint is written): once a stop
        signal has come, the grace clock stops, so the save that follows is not cut short."""
        if self.signum is not None or self._signalled:
            self._step_ended.set()

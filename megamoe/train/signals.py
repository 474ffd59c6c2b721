"""Pre-emption: SIGTERM, SIGUSR1 or SIGINT (Ctrl-C) asks the run to checkpoint and exit.

SLURM sends SIGUSR1 ahead of the time limit (launch/pretrain_moe.sh forwards it to every
trainer) and SIGTERM on scancel or pre-emption; torchrun forwards SIGTERM too, so one rank may
get it twice. The handler only records the first signal; the loop finishes its current step,
all ranks agree (a rank that got nothing still stops at the same step), save, and exit 0 so the
job can be requeued and resume from the checkpoint. A second SIGINT interrupts at once, as
Ctrl-C does elsewhere (a save it interrupts leaves a temporary folder, which the next run
removes).
"""
from __future__ import annotations

import signal
import sys
from typing import Optional

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class StopRequest:
    """Records the first stop signal this process receives."""

    def __init__(self) -> None:
        self.signum: Optional[int] = None

    def install(self) -> None:
        """Handle the stop signals in this process from now on."""
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if self.signum is None:
            self.signum = signum
            print(f"received {signal.Signals(signum).name}: checkpointing after this step",
                  file=sys.stderr, flush=True)

    @property
    def requested(self) -> bool:
        return self.signum is not None

"""Training metrics: console progress, a JSONL file, TensorBoard and wandb (rank 0 only).

Every step appends one JSON object to OUTPUT_DIR/metrics.jsonl: `step`, `loss`, `lr`,
`grad_norm`, `tokens_per_s`, `step_time_s`, `consumed_samples` and the MoE metrics of
`megamoe.balancing.step_balancing` (`moe/layer{n}/maxvio_global`, `.../experts_per_token`,
`.../dropped_fraction`, `.../load` as a list of per-expert fractions, ...), and with
`model.mtp_layers` each multi-token-prediction depth's loss `mtp/depth{k}/loss`. A resumed run
appends to the same file, so a step may appear twice after a crash; readers keep the last record
of each step (tools/plot_expert_load.py does). Lines with an `event` key are not step metrics but
what happened to the run (`nonfinite`, `loss_spike`, `rollback`, see megamoe.train.guards; `setting`,
a training setting changed from the checkpoint the run started from, in effect from `step`, with
`setting`, `old` and `new`). Every `logging.interval` steps a line goes to the console
and the scalars to TensorBoard (OUTPUT_DIR/tensorboard) and wandb (online when an API key is
configured, else offline into OUTPUT_DIR/wandb).
"""
from __future__ import annotations

import json
import os
import re
import sys
import uuid
from pathlib import Path
from typing import Optional

from tqdm import tqdm

from megamoe.bounded import read_bounded, read_bytes_bounded
from megamoe.errors import ConfigError
from megamoe.train.config import TrainConfig

_LAYER = re.compile(r"moe/layer(\d+)/(\w+)$")
MAX_SMALL_FILE_BYTES = 1 << 20  # a netrc file, the wandb run id


def layer_values(metrics: dict, name: str) -> list[tuple[int, float]]:
    """(layer number, value) of per-layer MoE metric `name` (e.g. `maxvio_global`), by layer."""
    found = []
    for key, value in metrics.items():
        match = _LAYER.match(key)
        if match and match.group(2) == name:
            found.append((int(match.group(1)), value))
    return sorted(found)


def console_line(step: int, total: int, metrics: dict) -> str:
    """One progress line: step, loss, lr, throughput, grad norm and per-layer MoE balance."""
    parts = [f"step {step}/{total}", f"loss {metrics['loss']:.4f}", f"lr {metrics['lr']:.2e}",
             f"{metrics['tokens_per_s']:,.0f} tok/s", f"grad norm {metrics['grad_norm']:.3f}"]
    maxvio = layer_values(metrics, "maxvio_global")
    if maxvio:
        parts.append("maxvio " + " ".join(f"L{n}:{v:.2f}" for n, v in maxvio))
        ept = [v for _, v in layer_values(metrics, "experts_per_token")]
        parts.append("experts/token " + " ".join(f"{v:.2f}" for v in ept))
        dropped = [v for _, v in layer_values(metrics, "dropped_fraction")]
        parts.append(f"dropped {100 * max(dropped):.1f}%")
    return " | ".join(parts)


def _scalars(metrics: dict) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}


class MetricsLogger:
    """Writes each step's metrics to the sinks the config enables; a no-op off rank 0."""

    def __init__(self, config: TrainConfig, active: bool, start_step: int) -> None:
        self.active = active
        self.interval = config.logging.interval
        self.total = config.training.train_steps
        self.tensorboard = self.wandb_run = self.bar = self.jsonl = None
        if not active:
            return
        out = Path(config.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.jsonl = open(out / "metrics.jsonl", "a", encoding="utf-8")
        if config.logging.tensorboard:
            self.tensorboard = _tensorboard_writer(out / "tensorboard")
        if config.logging.wandb:
            self.wandb_run = _wandb_run(config, out)
        if config.logging.progress_bar:
            # disable=None: no bar when stderr is not a terminal (e.g. a SLURM log file)
            self.bar = tqdm(total=self.total, initial=start_step, desc="training", unit="step",
                            dynamic_ncols=True, file=sys.stderr, disable=None)

    def log(self, step: int, metrics: dict) -> None:
        if not self.active:
            return
        self.jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
        self.jsonl.flush()
        if self.bar is not None:
            self.bar.update(1)
        if step % self.interval and step != self.total:
            return
        line = console_line(step, self.total, metrics)
        if self.bar is not None:
            self.bar.write(line, file=sys.stdout)
        else:
            print(line, flush=True)
        scalars = _scalars(metrics)
        if self.tensorboard is not None:
            for key, value in scalars.items():
                self.tensorboard.add_scalar(key, value, step)
            self.tensorboard.flush()
        if self.wandb_run is not None:
            self.wandb_run.log(scalars, step=step)

    def event(self, step: int, event: str, text: str, echo: bool = True, **fields) -> None:
        """Something that happened to the run at `step` (a guard tripped, a rollback): one JSON
        line `{"step", "event", "message", ...}` in metrics.jsonl and, if `echo`, `text` on the
        console (a run that stops says it in its error line instead)."""
        if not self.active:
            return
        self.jsonl.write(json.dumps({"step": step, "event": event, "message": text,
                                     **fields}) + "\n")
        self.jsonl.flush()
        if echo:
            self.message(text)

    def setting_changed(self, step: int, name: str, old, new) -> None:
        """Training setting `name` changed from `old` (the checkpoint's) to `new` from `step` on:
        `setting NAME: OLD -> NEW (from step N)` on the console and a `setting` event."""
        self.event(step, "setting", f"setting {name}: {old} -> {new} (from step {step})",
                   setting=name, old=old, new=new)

    def message(self, text: str) -> None:
        """A line for the user (rank 0), kept clear of the progress bar."""
        if not self.active:
            return
        if self.bar is not None:
            self.bar.write(text, file=sys.stdout)
        else:
            print(text, flush=True)

    def close(self) -> None:
        for sink in (self.bar, self.tensorboard, self.jsonl):
            if sink is not None:
                sink.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()


def _tensorboard_writer(folder: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        print("logging.tensorboard: tensorboard is not installed (pip install tensorboard); "
              "skipping it", file=sys.stderr)
        return None
    return SummaryWriter(log_dir=str(folder))


def _wandb_mode() -> str:
    """WANDB_MODE if the user set it; else online when an API key is configured (WANDB_API_KEY
    or `wandb login`'s netrc entry), offline otherwise."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    netrc = Path(os.environ.get("NETRC", "~/.netrc")).expanduser()
    return "online" if netrc.is_file() and b"api.wandb.ai" in read_bytes_bounded(
        netrc, MAX_SMALL_FILE_BYTES, ConfigError, f"netrc file {netrc}") else "offline"


def _wandb_run(config: TrainConfig, out: Path) -> Optional[object]:
    """A wandb run that a resumed training continues (its id is kept in OUTPUT_DIR)."""
    try:
        import wandb
    except ImportError:
        print("logging.wandb: wandb is not installed (pip install wandb); skipping it",
              file=sys.stderr)
        return None
    id_file = out / "wandb_run_id"
    if not id_file.is_file():
        id_file.write_text(uuid.uuid4().hex[:16])
    run_id = read_bounded(id_file, MAX_SMALL_FILE_BYTES, ConfigError, str(id_file)).strip()
    return wandb.init(project=config.logging.wandb_project, dir=str(out), mode=_wandb_mode(),
                      id=run_id, resume="allow", config=config.to_dict(), name=out.name)

"""Metric sinks of a run: JSONL (one line per step), TensorBoard, Weights & Biases, and the progress bar.

Only process 0 writes (multi-host runs); a resumed run drops the records of the steps it recomputes.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import re
import tempfile

import jax
from tqdm import tqdm

from rl.config.run import RunConfig
from rl.run.wandb_sink import WandbSink


class MetricsLogger:
    """JSONL (one line per step, flushed) + TensorBoard (tensorboardX) sinks."""

    def __init__(self, cfg: RunConfig):
        primary = jax.process_index() == 0  # one writer in multi-host runs
        self.jsonl = pathlib.Path(cfg.log.metrics_jsonl) if cfg.log.metrics_jsonl and primary else None
        self.tb_dir = cfg.log.tensorboard_dir if primary else None
        self.tb = None
        self.cfg, self.wandb = cfg, None
        self.wandb_project = cfg.log.wandb_project if primary else None

    def open(self, first_step: int | None) -> None:
        """Open the sinks. `first_step` (not None): drop the records of steps >= first_step, which this run writes
        again: JSONL rewritten atomically, TensorBoard told to purge them (`purge_step`)."""
        if first_step is not None:
            self.truncate(first_step)
        if self.tb_dir:
            from tensorboardX import SummaryWriter

            self.tb = SummaryWriter(self.tb_dir, purge_step=first_step)
        if self.wandb_project:
            self.wandb = WandbSink(self.wandb_project, {**self.cfg.knobs(), "resolved": self.cfg.to_tree()},
                                   run_dir=self.jsonl.parent if self.jsonl else None)

    def truncate(self, last_step: int) -> None:
        """Keep only the records of steps < last_step (a resumed run recomputes the rest); atomic rewrite.
        A line cut short by a kill mid-write is dropped too."""
        if not self.jsonl or not self.jsonl.exists():
            return
        keep = []
        for ln in self.jsonl.read_text().splitlines():
            try:
                if json.loads(ln)["step"] < last_step:
                    keep.append(ln)
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
        fd, tmp = tempfile.mkstemp(dir=self.jsonl.parent, prefix=".metrics.")
        with os.fdopen(fd, "w") as f:
            f.write("".join(ln + "\n" for ln in keep))
        os.replace(tmp, self.jsonl)

    def log(self, step: int, metrics: dict) -> None:
        if self.jsonl:
            with open(self.jsonl, "a") as f:
                f.write(json.dumps({"step": step, **metrics}, sort_keys=True) + "\n")
        if self.tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    # TensorBoard tags allow [\w./-]: "eval/pass@k" is logged as "eval/pass_k" (the jsonl keeps it)
                    self.tb.add_scalar(re.sub(r"[^\w./-]", "_", k), v, step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(step, metrics)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.close()


def progress_bar(cfg: RunConfig, start: int):
    if not cfg.log.progress or jax.process_index() != 0:
        return None
    return tqdm(total=cfg.steps, initial=start, desc="grpo", unit="step", dynamic_ncols=True)


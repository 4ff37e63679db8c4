"""Weights & Biases as a metric sink (optional: `pip install -e '.[wandb]'`), beside JSONL and TensorBoard.

`--wandb-project NAME` opens one W&B run on the primary process at the start of the job, with the resolved
RunConfig as the run's config, and logs every step's metrics under the same names as the JSONL file
(`rollout/reward_mean`, `eval/pass@1`, ...) at the same step. wandb is imported only here, only when the flag
is given; without the package the run stops before step 1 with a one-line error naming the flag.

Offline: W&B's own switch works (`WANDB_MODE=offline`: the run is written under `wandb/` in the run directory
and needs no network; `wandb sync DIR` uploads it later). The run directory is `WANDB_DIR` if set, else the
folder of `--metrics-jsonl`, else the working directory. A resumed job starts a new W&B run (its steps continue
from the checkpoint's).
"""

from __future__ import annotations

import math
import os
import pathlib


class WandbSink:
    """One W&B run: `log(step, metrics)`, `close()`. Raises ValueError naming --wandb-project if wandb is not
    installed."""

    def __init__(self, project: str, config: dict, *, run_dir: str | os.PathLike | None = None):
        try:
            import wandb
        except ImportError:
            raise ValueError("--wandb-project needs the wandb package, which is not installed: "
                             "pip install -e '.[wandb]' (or drop --wandb-project)") from None
        kwargs = {}
        if not os.environ.get("WANDB_DIR") and run_dir is not None:
            pathlib.Path(run_dir).mkdir(parents=True, exist_ok=True)
            kwargs["dir"] = str(run_dir)
        self.run = wandb.init(project=project, config=config, **kwargs)

    def log(self, step: int, metrics: dict) -> None:
        """The finite numeric metrics of `step` (NaN / inf and strings are left out, as in TensorBoard)."""
        row = {k: v for k, v in metrics.items()
               if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
        self.run.log(row, step=step)

    def close(self) -> None:
        self.run.finish()

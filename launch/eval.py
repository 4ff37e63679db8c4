"""Evaluate a checkpoint without training: `launch/run.py --eval-only` under its own name.

    python launch/eval.py --init CKPT --config CKPT/config.json --tokenizer CKPT/tokenizer.json \
        --eval-dataset aime24.jsonl --data-format miles --prompt-field problem --answer-field answer \
        --apply-chat-template --reward aime --eval-prompts 30 --eval-samples 8 --max-new-tokens 4096 --ckpt-dir ''

Every flag of launch/run.py applies (see `python launch/run.py --help`). It prints greedy pass@1, sampled
pass@1 and pass@k (k = --eval-samples) as a table and writes them to --metrics-jsonl / TensorBoard / W&B.
Weights: with `--ckpt-dir DIR --resume auto` the newest checkpoint of a training run, else `--init` (an
official-format checkpoint folder); with neither (DIR missing or empty, and --init random) there is nothing to
evaluate: one line naming DIR, exit 2. A step folder (`DIR/3`) is refused naming DIR. Only the model and the knobs
that shape the saved state must match the checkpoint's (not lr, seed, group size, ...: rl/run/eval_source.py). It
only reads DIR: no lock, nothing created or written there (a read-only directory works), no config.yaml.
`--ckpt-dir ''` evaluates `--init` alone.
"""

from __future__ import annotations

import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # runnable as a script from a fresh clone

from launch.run import main  # noqa: E402

if __name__ == "__main__":
    if ("xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", "")
            and not any(a.startswith("--cpu-devices-per-process") for a in sys.argv)):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()
    sys.exit(main(["--eval-only", *sys.argv[1:]]))

"""Helpers for the launch tests: a BPE tokenizer small enough for the tiny model, an official-format tiny
checkpoint written by transformers, and `launch/run.py` run as a real process.

A launched job runs as `python launch/run.py ...` in a subprocess with XLA_FLAGS removed, so it splits the host
into 2 devices itself (actor 1 + rollout 1), exactly as a user's run. All launched jobs of a session share one
JAX persistent compilation cache: the first job compiles (about 1-3 minutes on 2 busy cores), later jobs with the
same shapes load the executables (tens of seconds). Loading an executable does not change the numbers.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import random
import signal
import subprocess
import sys
import time

import numpy as np
import portpicker
import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
RUN_PY = REPO / "launch" / "run.py"
CONFIGS = REPO / "launch" / "configs"

# The smallest sensible job: 4 prompts x 4 samples, 4 new tokens, 8 eval prompts x 2 samples. The sampler compiles
# one program per batch bucket (rl/rollout/engine.py: powers of two): 8 x 2 sampled eval rows are the training batch's
# 16, so a job with eval compiles 2 generate programs (16, greedy 8), not 3 (16, 4, 8) as with 4 eval prompts.
TINY = ["--prompts-per-step", "4", "--group-size", "4", "--max-new-tokens", "4", "--eval-prompts", "8",
        "--eval-samples", "2", "--no-progress"]
SPECIALS = ["<|pad|>", "<|endoftext|>", "<unk>"]  # rl.data.tokenizer finds PAD and EOS by these names; no BOS


def outputs(d: pathlib.Path) -> list[str]:
    """Checkpoint, metrics and TensorBoard flags, all under `d`."""
    return ["--ckpt-dir", str(d / "ckpt"), "--metrics-jsonl", str(d / "metrics.jsonl"),
            "--tensorboard-dir", str(d / "tb")]


def train_bpe(texts: list[str], path: pathlib.Path, vocab_size: int = 256) -> pathlib.Path:
    """A BPE `tokenizer.json` (Metaspace pre-tokenizer, `<unk>` for unseen characters) with at most
    `vocab_size` ids, specials first: 0 `<|pad|>`, 1 `<|endoftext|>` (EOS), 2 `<unk>`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS))
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    assert 1 + max(tok.get_vocab(with_added_tokens=True).values()) <= vocab_size
    return path


SENTENCES = [f"Tom has {a} apples and buys {b} more. How many apples does Tom have now? #### {a + b}"
             for a, b in [(3, 4), (12, 7), (25, 30), (8, 1), (60, 5), (14, 9)]]


@pytest.fixture(scope="session")
def small_tokenizer(tmp_path_factory) -> pathlib.Path:
    """A BPE tokenizer.json (<= 256 ids) trained on GSM8K-like sentences (no shared data needed)."""
    return train_bpe(SENTENCES * 4, tmp_path_factory.mktemp("tok") / "tokenizer.json", vocab_size=128)


def processes(n: int) -> list[list[str]]:
    """The flags of an `n`-process run on this host, one list per process: a free coordinator port and a free
    `--transfer-address` port each. The default transfer port (coordinator port + 1 + process id) is a neighbour of
    an OS-assigned port, so it can be another socket's ephemeral port while tests run side by side (a fresh-clone run
    saw `bind: Address already in use` on the rollout's first weight transfer)."""
    coordinator = f"127.0.0.1:{portpicker.pick_unused_port()}"
    return [["--coordinator", coordinator, "--num-processes", str(n), "--process-id", str(i),
             "--transfer-address", f"127.0.0.1:{portpicker.pick_unused_port()}"] for i in range(n)]


def write_jsonl(path: pathlib.Path, records: list, raw_lines: dict[int, str] | None = None) -> pathlib.Path:
    """`records` as JSON lines; `raw_lines` {line number (1-based): text} replaces those lines verbatim."""
    lines = [json.dumps(r) for r in records]
    for n, text in (raw_lines or {}).items():
        lines[n - 1] = text
    path.write_text("\n".join(lines) + "\n")
    return path


def gsm8k_records(n: int) -> list[dict]:
    return [{"question": s.split(" #### ")[0], "answer": "Add them. #### " + s.split(" #### ")[1]}
            for s in (SENTENCES * (n // len(SENTENCES) + 1))[:n]]


_THIS = sys.modules[__name__]


@pytest.fixture(scope="session")
def lt():
    """This module: the helpers above, for the tests (`lt.launch(...)`, `lt.TINY`); a non-package conftest cannot
    be imported reliably by name (pytest drops `conftest` from sys.modules between conftest files)."""
    return _THIS


def _hf_checkpoint(d: pathlib.Path, **config) -> pathlib.Path:
    sys.path.insert(0, str(REPO / "tests" / "dsv4"))
    try:
        from hf_ref import hf_model
    finally:
        sys.path.pop(0)
    from dsv4 import DSV4Config

    hf_model(DSV4Config.tiny(**config)).save_pretrained(str(d))
    return d


@pytest.fixture(scope="session")
def hf_tiny_checkpoint(tmp_path_factory) -> pathlib.Path:
    """An official-format tiny DeepSeek-V4 checkpoint (config.json + model.safetensors) saved by transformers."""
    return _hf_checkpoint(tmp_path_factory.mktemp("hf_tiny"))


@pytest.fixture(scope="session")
def hf_tiny16_checkpoint(tmp_path_factory) -> pathlib.Path:
    """The same with the built-in digit task's 16-id vocabulary (what a random init is resized to), so that a job
    started from it samples the task's ids and gets a learning signal in its first steps."""
    return _hf_checkpoint(tmp_path_factory.mktemp("hf_tiny16"), vocab_size=16)


@pytest.fixture(scope="session")
def run_env(tmp_path_factory) -> dict:
    """Environment of a launched job: no forced device count (run.py sets 2), CPU, the suite's XLA:CPU compile
    options, a shared compile cache
    (a session temp dir shared by the pytest-xdist workers, or $DSV4RL_TEST_JAX_CACHE to keep it between
    sessions). Concurrent writers are safe: a torn cache entry fails to load and is recompiled (JAX warns)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    # the in-process tests' compile options (tests/conftest.py): the same HLO compiled faster (optimisation level 0
    # alone: a 6-step tiny job in 68 s instead of 88 s); every launched run of a test gets the same flags
    env["XLA_FLAGS"] = os.environ["DSV4RL_TEST_XLA_FLAGS"]
    cache = os.environ.get("DSV4RL_TEST_JAX_CACHE")
    if not cache:
        base = tmp_path_factory.getbasetemp()
        if os.environ.get("PYTEST_XDIST_WORKER"):  # per-worker basetemp: its parent is the session's
            base = base.parent
        (base / "jax_cache").mkdir(exist_ok=True)
        cache = str(base / "jax_cache")
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", JAX_COMPILATION_CACHE_DIR=cache,
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")
    return env


def start(args: list[str], env: dict, log: pathlib.Path) -> subprocess.Popen:
    """`python launch/run.py *args` in the background, stdout + stderr to `log`."""
    f = open(log, "ab")
    return subprocess.Popen([sys.executable, str(RUN_PY), *map(str, args)], cwd=REPO, env=env, stdout=f,
                            stderr=subprocess.STDOUT)


def launch(args: list[str], env: dict, log: pathlib.Path, timeout: float = 900) -> tuple[int, str]:
    """Run `python launch/run.py *args` to the end -> (exit status, this run's output)."""
    offset = log.stat().st_size if log.exists() else 0
    proc = start(args, env, log)
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    return rc, log.read_bytes()[offset:].decode(errors="replace")


def ckpt_steps(ckpt_dir: pathlib.Path) -> list[int]:
    """Completed checkpoint steps (orbax renames `<step>.orbax-checkpoint-tmp-*` to `<step>` when done)."""
    if not ckpt_dir.is_dir():
        return []
    return sorted(int(p.name) for p in ckpt_dir.iterdir() if p.name.isdigit())


def read_metrics(path: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def load_state(ckpt_dir: pathlib.Path, step: int) -> dict[str, np.ndarray]:
    """The learner state of checkpoint `step` as {keystr path: numpy array} (no target needed)."""
    import orbax.checkpoint as ocp

    path = ckpt_dir / str(step) / "state"
    with ocp.PyTreeCheckpointer() as c:
        tree = c.metadata(path).item_metadata.tree
        return c.restore(path, restore_args={k: ocp.RestoreArgs(restore_type=np.ndarray) for k in tree})


def wait_for_checkpoint_after(proc, ckpt_dir: pathlib.Path, after: int, timeout: float = 900) -> int:
    """Poll until a checkpoint newer than `after` is complete or the process ends; the newest step."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        newest = max(ckpt_steps(ckpt_dir), default=0)
        if newest > after or proc.poll() is not None:
            return newest
        time.sleep(0.05)
    proc.kill()
    raise TimeoutError(f"no checkpoint after step {after} in {ckpt_dir} within {timeout} s")


def same_value(a, b) -> bool:
    """Bitwise-equal metric values (NaN equals NaN; 1 and 1.0 differ)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


CTRL_C_TWICE = "Ctrl-C twice"  # a pseudo-signal of `interrupted_starts`: SIGINT, 0.05 s, SIGINT


def interrupted_starts(cmd: list[str], env: dict, log: pathlib.Path, ckpt_dir: pathlib.Path, steps: int,
                       step_s: float, seed: int, signals=(signal.SIGKILL, signal.SIGTERM, signal.SIGKILL)):
    """Start the checkpointing run `cmd` once per signal: wait until a checkpoint newer than the last one is
    complete, sleep a random fraction (`seed`) of one step (`step_s` seconds), send the signal. Each start after
    the first must resume; SIGKILL must kill it; SIGTERM must finish the step and exit 0; SIGINT (Ctrl-C) likewise
    with exit 130 and one line; `CTRL_C_TWICE` must exit at once with 130 ("interrupted again"). No signal may
    print a traceback. Yields (signal, newest completed checkpoint step) after each start, for the caller's checks."""
    rng = random.Random(seed)
    newest = 0
    for sig in signals:
        offset = log.stat().st_size if log.exists() else 0
        proc = start(cmd, env, log)
        newest = wait_for_checkpoint_after(proc, ckpt_dir, newest)
        assert proc.poll() is None and newest < steps, ("ended before it could be interrupted", log.read_text()[-3000:])
        pause = rng.uniform(0.0, step_s)
        # Ctrl-C twice: early in a step, so that the step is still running when the second one comes (the loop's
        # watcher sees it at once even while the main thread waits in a device call: rl/run/loop.py)
        time.sleep(0.0 if sig == CTRL_C_TWICE else pause)
        proc.send_signal(signal.SIGINT if sig == CTRL_C_TWICE else sig)
        if sig == CTRL_C_TWICE:
            time.sleep(0.05)
            proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=600)
        text = log.read_bytes()[offset:].decode(errors="replace")
        if offset:  # a restart: it resumed from the newest checkpoint the previous process completed
            assert "resumed from" in text, text[-3000:]
        newest = max(ckpt_steps(ckpt_dir))
        if sig != signal.SIGKILL:
            assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
        if sig == signal.SIGKILL:
            assert rc == -signal.SIGKILL, text[-3000:]
        elif sig == signal.SIGTERM:  # the current step is finished and checkpointed, exit 0
            assert rc == 0 and "SIGTERM" in text, text[-3000:]
        elif sig == signal.SIGINT:  # likewise, exit 130 with one line
            assert rc == 130 and "SIGINT" in text and "interrupted (Ctrl-C)" in text, text[-3000:]
        else:  # the second Ctrl-C: out at once, the newest complete checkpoint kept
            assert rc == 130 and "interrupted again" in text, text[-3000:]
        yield sig, newest


def assert_same_run(ref: pathlib.Path, got: pathlib.Path, steps: int, ignore=()) -> tuple[dict, list[dict]]:
    """Bitwise: every array of the final (step `steps`) checkpoint of the run directories `ref` and `got`, and
    every non-perf metric of every step except the keys in `ignore` (counters of a process, e.g. MPMD's
    `mpmd/rollout_generate_calls`, restart with it). Returns (ref's final state, ref's metrics) for further checks."""
    assert ckpt_steps(ref / "ckpt")[-1] == ckpt_steps(got / "ckpt")[-1] == steps
    a, b = load_state(ref / "ckpt", steps), load_state(got / "ckpt", steps)
    assert sorted(a) == sorted(b) and len(a) > 100
    differ = [k for k in a if a[k].dtype != b[k].dtype or a[k].shape != b[k].shape
              or a[k].tobytes() != b[k].tobytes()]
    assert not differ, f"{len(differ)} arrays differ, e.g. {differ[:5]}"
    ma, mb = read_metrics(ref / "metrics.jsonl"), read_metrics(got / "metrics.jsonl")
    assert [r["step"] for r in ma] == [r["step"] for r in mb] == list(range(steps))
    for ra, rb in zip(ma, mb):
        keys = {k for k in ra if not k.startswith("perf/") and k not in ignore}
        assert keys == {k for k in rb if not k.startswith("perf/") and k not in ignore}
        bad = {k: (ra[k], rb[k]) for k in keys if not same_value(ra[k], rb[k])}
        assert not bad, (ra["step"], bad)
    return a, ma

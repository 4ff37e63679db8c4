"""Reward functions: pure `reward_fn(response_text, reference) -> float`, and a time-limited runner.

Functions:
- `gsm8k_reward`: 1.0 if the response's final answer equals the reference final answer, else 0.0.
  The final answer is the text after the last `####`, else the last `\\boxed{...}`, else the last
  number (`rl.data.answers.extract_final_answer`, cleaned as the math rewards clean theirs). Plain decimals on both
  sides are compared exactly in Python (`decimal.Decimal`) after normalisation (`rl.data.answers.plain_decimal`:
  Unicode minus, spaced signs, currency, thousands separators, scientific notation, trailing units); anything else
  (fractions, LaTeX) goes to math-verify: `rl.data.answers.answers_equal`, the one comparison of every math reward
  (`math_verify.parse` + `math_verify.verify`, which parse with latex2sympy / sympy). Model output is never
  evaluated as code.
- `format_reward`: 1.0 if the response ends with a GSM8K answer line `#### <number>`.
- `combine_rewards`: a weighted sum of reward functions, itself a reward function.

Time limit (why a process): math-verify's own timeout is `signal.alarm`, which works only in the main
thread, has 1-second resolution, and cannot interrupt sympy while it is inside C code: an answer such
as `\\boxed{9^{9^{9^{9}}}}` makes `verify` build a number with billions of digits and never return.
So `safe_reward` / `compute_rewards` run the reward function in a `RewardPool` worker process
(multiprocessing "spawn": no fork of a process that holds JAX threads), wait on its pipe with a
per-sample deadline, and on a miss kill the worker (SIGKILL) and start a fresh one. The verdict is
0.0 with status "timeout"; an exception inside the function is 0.0 with status "error". math-verify
runs inside the worker with its signal timeouts off (the worker deadline replaces them). A direct
call of `gsm8k_reward` has no time limit. A function that returns something other than a real number (the
string "0.7", None) is a bug of the function, not of a sample: `RewardTypeError` names it.

Requirements: a function run under a time limit must be picklable (a module-level function, or a
`functools.partial` / `CombinedReward` of them), because it is sent to the worker. `timeout_s=None`
runs it in-process (errors are still caught), for cheap trusted rewards.

Metrics: `RewardStats` counts statuses; `.metrics()` -> {"reward/errors", "reward/timeouts"}.

Run the tests: `.venv/bin/python -m pytest -q tests/rl/test_rewards.py`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import multiprocessing
import numbers
import multiprocessing.connection
import pickle
import re
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from multiprocessing.reduction import ForkingPickler
from typing import Any, Protocol

import numpy as np

from rl.data.answers import answers_equal, extract_final_answer, reference_answer

logger = logging.getLogger(__name__)

TextRewardFn = Callable[[str, str], float]  # (response_text, reference) -> reward, picklable for the pool


class RewardFn(Protocol):
    """The loop's one reward interface (`rl.run.loop.score`): a whole batch of responses scored at once.

    `reward(references, responses)` with references [N] str (one per row) and responses [N] token-id lists
    (unpadded; a stop token, when generated, is included) returns (rewards [N] float32, exact [N] bool: the
    row fully solves its prompt (pass@k counts these), metrics {name: float} of this batch). Implementations:
    `TextReward` (dataset rewards on decoded text, in the time-limited worker pool) and `rl.data.tasks.TaskReward`
    (the built-in task's exact partial credit)."""

    def __call__(self, references: Sequence[str],
                 responses: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray, dict[str, float]]: ...


@dataclasses.dataclass(frozen=True)
class TextReward:
    """`RewardFn` of a text reward `fn(response_text, reference) -> float` (rl/data/math_rewards.py's table): each
    response is decoded (stop token dropped) and scored by `compute_rewards` under `timeout_s` seconds.
    exact = reward >= 0.999 (a full-credit answer). Metrics: reward/errors, reward/timeouts."""

    fn: TextRewardFn
    tokenizer: Any  # rl.data.tokenizer.TokenizerLike: eos_id, decode
    timeout_s: float | None = 5.0  # None: in this process (cheap trusted rewards, tests)

    def __call__(self, references, responses):
        eos = self.tokenizer.eos_id
        texts = [self.tokenizer.decode([t for t in x if t != eos]) for x in responses]
        r, m = compute_rewards(self.fn, texts, list(references), timeout_s=self.timeout_s)
        return r, r >= 0.999, m

_FORMAT_RE = re.compile(r"(?:^|\n)[ \t]*####[ \t]*\$?-?\d[\d,]*(?:\.\d+)?[ \t]*\Z")


# -- reward functions -------------------------------------------------------------------------------

def gsm8k_reward(response_text: str, reference: str) -> float:
    """1.0 if the final answer of `response_text` equals `reference` (a final answer, e.g. "18"), else 0.0.

    `reference` may also be a whole GSM8K answer field; its text after `####` is used. Plain numbers
    are compared exactly; other answers through math-verify. No time limit here: run it through
    `safe_reward` / `compute_rewards`. Raises TypeError if either argument is not a string.
    """
    if not isinstance(response_text, str) or not isinstance(reference, str):
        raise TypeError(f"gsm8k_reward takes two strings, got {type(response_text).__name__}, "
                        f"{type(reference).__name__}")
    reference = reference_answer(reference)
    found = extract_final_answer(response_text)
    if found is None or not reference:
        return 0.0
    return float(answers_equal(found[0], reference))


def format_reward(response_text: str, reference: str | None = None) -> float:
    """1.0 if `response_text` ends with a line `#### <number>` (GSM8K layout), else 0.0; `reference` is unused."""
    return float(bool(_FORMAT_RE.search(response_text.rstrip())))


@dataclasses.dataclass(frozen=True)
class CombinedReward:
    """sum_i weights[i] * fns[i](response_text, reference); picklable when its functions are."""

    fns: tuple[TextRewardFn, ...]
    weights: tuple[float, ...]

    def __call__(self, response_text: str, reference: str) -> float:
        return float(sum(w * fn(response_text, reference) for fn, w in zip(self.fns, self.weights)))


def combine_rewards(fns: Sequence[TextRewardFn], weights: Sequence[float] | None = None) -> CombinedReward:
    """A reward function that is the weighted sum of `fns` (default weights: equal, summing to 1).

    Raises ValueError on an empty list, a length mismatch, or a non-finite weight.
    """
    fns = tuple(fns)
    if not fns:
        raise ValueError("combine_rewards needs at least one reward function")
    weights = tuple(float(w) for w in (weights if weights is not None else [1.0 / len(fns)] * len(fns)))
    if len(weights) != len(fns):
        raise ValueError(f"combine_rewards: {len(fns)} functions but {len(weights)} weights")
    if not all(math.isfinite(w) for w in weights):
        raise ValueError(f"combine_rewards: weights must be finite, got {weights}")
    return CombinedReward(fns, weights)


# -- statuses -------------------------------------------------------------------------------------

STATUSES = ("ok", "error", "timeout")


@dataclasses.dataclass
class RewardStats:
    """Counts of reward statuses; `metrics()` gives the logged numbers (as floats)."""

    ok: int = 0
    errors: int = 0
    timeouts: int = 0

    def add(self, status: str) -> None:
        if status == "ok":
            self.ok += 1
        elif status == "error":
            self.errors += 1
        elif status == "timeout":
            self.timeouts += 1
        else:
            raise ValueError(f"unknown reward status {status!r}; expected one of {STATUSES}")

    def metrics(self) -> dict[str, float]:
        return {"reward/errors": float(self.errors), "reward/timeouts": float(self.timeouts)}


class RewardTypeError(ValueError):
    """A reward function returned something that is not a real number (the string "0.7", None, a list): a bug of
    the function, not of one sample, so the batch stops with one line naming the reward and the value."""


class _NotANumber(Exception):
    pass


def _is_real(value) -> bool:
    """int, float, bool, numpy numbers and 0-d numeric arrays; not str / bytes / None / containers."""
    if isinstance(value, numbers.Real):
        return True
    return isinstance(value, (np.generic, np.ndarray)) and value.ndim == 0 and value.dtype.kind in "biuf"


def _reward_name(fn: Callable) -> str:
    inner = getattr(fn, "func", fn)  # functools.partial
    return getattr(inner, "__qualname__", None) or getattr(inner, "__name__", None) or repr(fn)[:80]


def _type_error(fn: Callable, what: str) -> RewardTypeError:
    return RewardTypeError(f"reward {_reward_name(fn)} returned {what}: a reward must be a real number (int, float, "
                           "bool or a numpy number), e.g. return float(score)")


def _as_reward(value) -> tuple[float, str]:
    """A function's return value -> (float, "ok"), or (0.0, "error") if it is a non-finite number. Raises
    _NotANumber (text: the value and its type) when it is not a real number at all."""
    if not _is_real(value):
        raise _NotANumber(f"{value!r} ({type(value).__name__})"[:200])
    v = float(value)
    return (v, "ok") if math.isfinite(v) else (0.0, "error")


def _call_in_process(fn: Callable, args: tuple) -> tuple[float, str]:
    try:
        value = fn(*args)
    except Exception as e:  # noqa: BLE001  a broken reward costs one sample, not the run
        logger.debug("reward %r raised %s: %s", fn, type(e).__name__, e)
        return 0.0, "error"
    try:
        return _as_reward(value)
    except _NotANumber as e:
        raise _type_error(fn, str(e)) from None


# -- worker processes -----------------------------------------------------------------------------

def _worker_main(conn) -> None:
    """Worker loop: receive (fn, args), send (status, value or error text); None stops it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # its "timeout is disabled" notice: we know
    import math_verify  # noqa: F401  preload, so the first sample's deadline does not pay for sympy

    conn.send("ready")
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        except Exception as e:  # noqa: BLE001  the function could not be unpickled here
            conn.send(("error", f"unpickling the reward call failed: {type(e).__name__}: {e}"))
            continue
        if msg is None:
            return
        fn, args = msg
        try:
            value, status = _as_reward(fn(*args))
            conn.send((status, value))
        except _NotANumber as e:  # the parent raises RewardTypeError
            conn.send(("type", str(e)))
        except Exception as e:  # noqa: BLE001  reported to the parent as status "error"
            conn.send(("error", f"{type(e).__name__}: {e}"[:500]))


class _Worker:
    def __init__(self, ctx, startup_timeout_s: float):
        self.conn, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=_worker_main, args=(child,), daemon=True, name="reward-worker")
        self.proc.start()
        child.close()
        if not self.conn.poll(startup_timeout_s) or self.conn.recv() != "ready":
            self.kill()
            raise RuntimeError(f"reward worker did not start within {startup_timeout_s} s")

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=10)
        self.conn.close()

    def stop(self) -> None:
        try:
            self.conn.send(None)
            self.proc.join(timeout=2)
        except OSError:
            pass
        self.kill()


class RewardPool:
    """Worker processes that run reward functions with a per-call deadline (see module docstring).

    n_workers: processes working in parallel (each ~100 MB with sympy loaded; 1 suits 2 cores).
    A worker starts when there is work for it (about a second: a fresh interpreter importing sympy,
    not charged to any deadline); a worker that misses a deadline or dies is killed at once and
    replaced when next needed, so a timed-out call returns right at its deadline. Thread-safe (one run
    at a time). `close()` stops the workers; the pool is also a context manager.
    """

    def __init__(self, n_workers: int = 1, *, startup_timeout_s: float = 120.0):
        if n_workers < 1:
            raise ValueError(f"RewardPool needs n_workers >= 1, got {n_workers}")
        self.n_workers = n_workers
        self.startup_timeout_s = startup_timeout_s
        self._ctx = multiprocessing.get_context("spawn")
        self._workers: list[_Worker | None] = [None] * n_workers  # None: not started, or killed
        self._lock = threading.Lock()

    def run(self, fn: Callable, calls: Sequence[tuple], timeout_s: float) -> list[tuple[float, str]]:
        """fn(*args) for each args in `calls`, each under `timeout_s` -> [(value, status)] in order.

        Raises TypeError if `fn` cannot be pickled (e.g. a lambda or a closure).
        """
        try:
            pickle.dumps(fn)
        except Exception as e:  # noqa: BLE001  pickle raises several types
            raise TypeError(f"reward function {fn!r} cannot be sent to a worker process ({e}); use a module-level "
                            f"function or functools.partial of one, or timeout_s=None to run it in-process") from None
        with self._lock:
            return self._run_locked(fn, calls, timeout_s)

    def _run_locked(self, fn, calls, timeout_s):
        results: list[tuple[float, str] | None] = [None] * len(calls)
        not_a_number: list[str] = []  # values that are not numbers (RewardTypeError once every call is back)
        pending = deque(range(len(calls)))
        busy: dict[int, tuple[_Worker, int, float]] = {}  # slot -> (worker, call index, deadline)
        while pending or busy:
            for slot in range(self.n_workers):
                if slot in busy or not pending:
                    continue
                if self._workers[slot] is None:  # started when there is work for it
                    self._workers[slot] = _Worker(self._ctx, self.startup_timeout_s)
                worker = self._workers[slot]
                i = pending.popleft()
                try:
                    payload = ForkingPickler.dumps((fn, tuple(calls[i])))
                except Exception as e:  # noqa: BLE001  an unpicklable argument fails this call only
                    logger.warning("reward call %d could not be sent to a worker: %s", i, e)
                    results[i] = (0.0, "error")
                    continue
                try:
                    worker.conn.send_bytes(payload)
                except OSError:  # the idle worker died (e.g. killed for memory): retry on a fresh one
                    pending.appendleft(i)
                    self._discard(slot)
                    continue
                busy[slot] = (worker, i, time.monotonic() + timeout_s)
            if not busy:
                continue
            wait_s = max(0.0, min(d for _, _, d in busy.values()) - time.monotonic())
            ready = multiprocessing.connection.wait([w.conn for w, _, _ in busy.values()], timeout=wait_s)
            now = time.monotonic()
            for slot, (worker, i, deadline) in list(busy.items()):
                if worker.conn in ready:
                    try:
                        status, value = worker.conn.recv()
                    except (EOFError, OSError):  # the worker died (e.g. out of memory)
                        status, value = "error", "worker died"
                        self._discard(slot)
                    if status == "type":
                        not_a_number.append(value)
                        status = "error"
                    results[i] = (float(value), "ok") if status == "ok" else (0.0, status)
                    if status != "ok":
                        logger.debug("reward call %d: %s", i, value)
                    del busy[slot]
                elif now >= deadline:
                    results[i] = (0.0, "timeout")
                    logger.warning("reward call %d missed its %.1f s deadline; killing the worker", i, timeout_s)
                    self._discard(slot)
                    del busy[slot]
        if not_a_number:
            raise _type_error(fn, not_a_number[0])
        return results

    def _discard(self, slot: int) -> None:
        """Kills the worker in `slot`; a fresh one starts when the slot next gets work."""
        self._workers[slot].kill()
        self._workers[slot] = None

    def close(self) -> None:
        with self._lock:
            for w in self._workers:
                if w is not None:
                    w.stop()
            self._workers = [None] * self.n_workers

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


_DEFAULT_POOL: RewardPool | None = None
_DEFAULT_POOL_LOCK = threading.Lock()


def default_pool() -> RewardPool:
    """The process-wide one-worker pool, made on first use (no process is started at import)."""
    global _DEFAULT_POOL
    with _DEFAULT_POOL_LOCK:
        if _DEFAULT_POOL is None:
            _DEFAULT_POOL = RewardPool(1)
        return _DEFAULT_POOL


# -- entry points ---------------------------------------------------------------------------------

def safe_reward(fn: Callable, *args, timeout_s: float | None = 2.0, pool: RewardPool | None = None,
                stats: RewardStats | None = None) -> tuple[float, str]:
    """fn(*args) -> (value, status): (0.0, "error") if it raises or returns a non-finite / non-number,
    (0.0, "timeout") if it runs past `timeout_s` seconds (in a worker of `pool`, default
    `default_pool()`); `timeout_s=None` runs it in-process without a limit. Counts into `stats`.
    """
    if timeout_s is None:
        value, status = _call_in_process(fn, args)
    else:
        ((value, status),) = (pool or default_pool()).run(fn, [args], timeout_s)
    if stats is not None:
        stats.add(status)
    return value, status


def compute_rewards(fn: TextRewardFn, responses: Sequence[str], references: Sequence[str], *, timeout_s: float | None = 2.0,
                    pool: RewardPool | None = None, stats: RewardStats | None = None
                    ) -> tuple[np.ndarray, dict[str, float]]:
    """Rewards of a batch: fn(responses[i], references[i]) for i < N, each under `timeout_s`.

    Returns (float32 [N], metrics of this batch {"reward/errors", "reward/timeouts"}); failed calls
    score 0.0. `stats`, if given, accumulates across batches. Raises ValueError on a length mismatch.
    """
    if len(responses) != len(references):
        raise ValueError(f"compute_rewards: {len(responses)} responses but {len(references)} references")
    calls = list(zip(responses, references))
    if timeout_s is None:
        results = [_call_in_process(fn, c) for c in calls]
    else:
        results = (pool or default_pool()).run(fn, calls, timeout_s) if calls else []
    batch = RewardStats()
    for _, status in results:
        batch.add(status)
        if stats is not None:
            stats.add(status)
    return np.array([v for v, _ in results], dtype=np.float32), batch.metrics()

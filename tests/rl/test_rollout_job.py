"""rl/rollout_job.py without processes: the restart policy of `JobRollout._recover` (a rollout that keeps dying ends
the run with one line naming its last log line). The launched two-job runs: tests/launch/test_two_jobs.py."""

from __future__ import annotations

import collections

import pytest

from rl import rollout_job
from rl.rollout_job import JobRollout, RolloutJobError
from sharding.job_link import LinkLost


class _DyingLink:
    """A rollout that registers and dies at its first message."""

    def __init__(self, n):
        self.n, self.name, self.closed = n, f"the rollout job h pid {n}", None

    def send(self, key, payload=None):
        raise LinkLost(self.name, "closed the connection (EOFError)", last_line=f"out of memory on prompt {self.n}")

    def close(self):
        pass


def _service():
    r = JobRollout.__new__(JobRollout)  # no listener, no pusher: only the recovery's bookkeeping
    r.link, r.rollout_name, r.last_line, r._served = None, "the rollout job h pid 0", "", None
    r._pending = {"train/0/0": object()}
    r._losses, r.restarts, r.recovery_s, r.restart_timeout_s = collections.deque(), 0, 0.0, 5.0
    return r


def test_a_rollout_that_keeps_dying_ends_the_run_with_one_line(monkeypatch):
    r = _service()
    born = iter(range(1, 100))

    def register(deadline_s, first=False):
        r.link = _DyingLink(next(born))
        r.rollout_name = r.link.name

    monkeypatch.setattr(r, "_register", register)
    with pytest.raises(RolloutJobError) as e:
        r._recover(LinkLost("the rollout job h pid 0", "closed the connection (EOFError)"))
    msg = str(e.value)
    assert r.restarts == rollout_job.MAX_RESTARTS + 1  # the first loss + MAX_RESTARTS replacements that died
    assert f"died {rollout_job.MAX_RESTARTS + 1} times within" in msg and "\n" not in msg
    assert f"the rollout job h pid {rollout_job.MAX_RESTARTS}" in msg  # the last one, by host and pid
    assert f"its last log line: 'out of memory on prompt {rollout_job.MAX_RESTARTS}'" in msg


def test_losses_outside_the_window_are_forgiven(monkeypatch):
    r = _service()
    r._version = 3
    clock = iter(range(0, 10**6, 1000))  # every clock read 1000 s later: each loss outside the previous' window
    monkeypatch.setattr(rollout_job.time, "monotonic", lambda: float(next(clock)))
    monkeypatch.setattr(rollout_job, "MAX_RESTARTS", 1)
    registered = []

    class _Live:
        name, closed = "the rollout job h pid 9", None

        def send(self, key, payload=None):
            pass

        def close(self):
            pass

    def register(deadline_s, first=False):
        registered.append(deadline_s)
        r.link = _Live()

    monkeypatch.setattr(r, "_register", register)
    for _ in range(3):
        r._recover(LinkLost("the rollout job h pid 9", "closed the connection (EOFError)"))
    assert r.restarts == 3 and registered == [5.0, 5.0, 5.0] and len(r._losses) == 1 and r.recovery_s > 0

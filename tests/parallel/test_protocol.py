"""The one push interface (`parallel/push/protocol.py`): every transport is a `Pusher` (`push(params, version) ->
PushStats`), checked structurally on the classes (nothing is built or compiled), and `PushStats.metrics()` gives the
loop's metric names (contracts). The pushes themselves: test_push.py (in one process), test_mpmd_wire.py (MPMD),
tests/rl/test_rollout_job.py and tests/launch/test_two_jobs.py (two jobs)."""

import inspect

import pytest

from parallel.push.job import JobPusher
from parallel.push.local import SamplerPusher, WeightPusher
from parallel.push.mpmd import MpmdPusher
from parallel.push.protocol import Pusher, PushStats


@pytest.mark.parametrize("cls", [WeightPusher, SamplerPusher, MpmdPusher, JobPusher])
def test_every_transport_is_a_pusher(cls):
    assert issubclass(cls, Pusher)
    params = list(inspect.signature(cls.push).parameters.values())
    assert [p.name for p in params[:3]] == ["self", "params", "version"]
    assert all(p.default is not inspect.Parameter.empty for p in params[3:])  # push(params, version) suffices


def test_push_stats_metrics():
    s = PushStats(version=3, seconds=0.5, bytes=2_000_000_000)
    assert s.metrics() == {"perf/weight_push_s": 0.5, "perf/weight_push_gbps": 4.0}
    assert s.gbps == 4.0 and not s.verified and s.wire_bytes_per_param == 2e9
    with pytest.raises(Exception):
        s.seconds = 1.0  # frozen

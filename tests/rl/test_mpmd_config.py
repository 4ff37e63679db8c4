"""MPMD settings checked before step 1 (`rl.roles.check_mpmd_config`): checkpoints and --init from a checkpoint
are accepted with the rollout on its own processes; checkpoints together with --max-staleness are refused with
one line naming the flags."""

import pytest

from rl.config import RunConfig
from rl.roles import check_mpmd_config


class Layout:
    rollout_processes = (2,)


def test_checkpoints_and_init_accepted_in_mpmd():
    check_mpmd_config(RunConfig(ckpt_dir="/tmp/ckpt", init="/path/to/checkpoint"), Layout())


def test_checkpoints_with_staleness_refused_in_mpmd():
    with pytest.raises(ValueError, match=r"--ckpt-dir with --max-staleness 1 and the rollout on its own") as err:
        check_mpmd_config(RunConfig(ckpt_dir="/tmp/ckpt", async_rollout=True), Layout())
    assert len(str(err.value).splitlines()) == 1

"""rl/agent/sandbox.py: code that tries the network, forks a lot, writes 1 GB, loops forever, sleeps, allocates
too much or prints too much is stopped and reported as a tool error; the caller never sees an exception. Each case
starts one short child Python (small limits: the whole file takes a few seconds)."""

from __future__ import annotations

import os

import pytest

from rl.agent.env import ToolError
from rl.agent.python_math import python_math_env
from rl.agent import env as envlib
from rl.agent.sandbox import SandboxLimits, python_tool, run_python, sandbox_mode

SMALL = SandboxLimits(cpu_s=1, memory_bytes=256 << 20, file_bytes=1 << 20, processes=8, wall_s=10, output_bytes=256)

FORK_BOMB = """import os, time
for _ in range(500):
    if os.fork() == 0:
        time.sleep(60)
        os._exit(0)
"""
WRITE_1GB = """with open("big", "wb") as f:
    for _ in range(1024):
        f.write(b"0" * (1 << 20))
"""


@pytest.mark.parametrize("code, error", [
    (FORK_BOMB, "exit status 1: BlockingIOError"),
    (WRITE_1GB, "exit status 1: OSError: [Errno 27] File too large"),
    ("x = bytearray(1 << 30)", "exit status 1: MemoryError"),
    ("print('x' * 1000)", "output longer than 256 bytes (cut)"),
    ("raise SystemExit(3)", "exit status 3"),
])
def test_stopped_and_reported(code, error):
    res = run_python(code, SMALL)
    assert res.error is not None and res.error.startswith(error), res
    assert len(res.output.encode()) <= SMALL.output_bytes


def test_busy_loop_is_stopped():
    """1 s of CPU time; on a loaded machine (this suite shares 2 cores) the 3 s wall limit may come first."""
    res = run_python("while True:\n    pass\n", SandboxLimits(cpu_s=1, wall_s=3))
    assert res.error in ("stopped by CPU time limit", "wall time limit: stopped after 3 s"), res


def test_wall_timeout_kills_a_sleeper():
    res = run_python("import time\ntime.sleep(60)", SandboxLimits(wall_s=1))
    assert res.error == "wall time limit: stopped after 1 s" and res.seconds < 30


def test_no_network():
    if sandbox_mode() == "rlimits":
        pytest.skip("no bubblewrap and no unprivileged unshare here: the sandbox runs under rlimits only")
    res = run_python("import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=5)", SMALL)
    assert res.error is not None and "Network is unreachable" in res.error


def test_ok_output_scratch_dir_and_tool_errors():
    res = run_python("import os\nopen('f', 'w').write('hi')\nprint(sorted(os.listdir('.')), 6 * 7)", SMALL)
    assert (res.error, res.output) == (None, "['f', 'main.py'] 42\n")
    assert os.getcwd() != res.output  # ran in its own scratch folder
    tool = python_tool(SMALL)
    assert tool({"code": "print(1 + 1)"}, "") == "2\n"
    with pytest.raises(ToolError, match="ZeroDivisionError"):
        tool({"code": "1 / 0"}, "")
    with pytest.raises(ToolError, match="'code'"):
        tool({}, "")
    env = python_math_env(limits=SMALL)
    call = ('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="python">\n<｜DSML｜parameter name="code" string="true">'
            'print(2 ** 10)</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls><｜end▁of▁sentence｜>')
    assert envlib.step(env, call, "1024").contents == ["1024\n"]
    assert envlib.reward(env, "So \\boxed{1024}<｜end▁of▁sentence｜>", "1024") == 1.0
    with pytest.raises(ValueError, match="SandboxLimits.cpu_s"):
        SandboxLimits(cpu_s=0)

"""rl/run/stages.py `learn` + `push`: a step without learning signal changes nothing (issue 15 class 6).

After a step with signal (Adam has momentum), a batch whose advantages are all 0 (every group zero-std or
filtered) must not move the params, the optimizer state or the step counter, must not push, and must say so in
`train/skipped_no_signal`. Tiny 2-layer model, fp32 everywhere, no pusher (the sampler's `update_weights`).

rl/run/loop.py's signals: a second Ctrl-C exits at once even while the main thread is inside one long C call, and a
forked child's signals do not count as the parent's.
"""

import os
import subprocess
import sys

import jax
import numpy as np
from flax import nnx

from dsv4 import DSV4Config, DSV4ForCausalLM
from rl.config.algo import LearnerConfig
from rl.config.run import RunConfig
from rl.algo.learner import Learner
from rl.run.wiring import RunWiring
from rl.rollout.service import LocalRollout
from rl.run.stages import learn, push
from rl.rollout.engine import Sampler, SamplingParams

CFG = DSV4Config.tiny(num_hidden_layers=2, compress_ratios=(4, 8), num_nextn_predict_layers=0)


def _host(state):
    return [np.array(x) for x in jax.tree.leaves(state)]


def test_no_signal_step_skips_update_and_push():
    model = DSV4ForCausalLM(CFG, rngs=nnx.Rngs(0))
    learner = Learner(model, LearnerConfig(lr=1e-2, compute_dtype="float32", routing_replay=True))
    sampler = Sampler(model, weights="fp32", max_prompt_len=16)
    rs = np.random.RandomState(0)
    prompts = [list(map(int, rs.randint(3, CFG.vocab_size, n))) for n in (5, 7, 3, 6)]
    rb = sampler.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=4), seed=0)
    wiring = RunWiring(cfg=RunConfig(**{"learner.routing_replay": True}), model_cfg=CFG, plan=None, tokenizer=None,
                       task=None, train_data=None, eval_prompts=[], eval_refs=[], reward=None, learner=learner,
                       rollout=LocalRollout(sampler, learner.params_for_push), iterator=None, ckpt=None, logger=None)

    def learn_and_push(wiring, rb, adv):
        return {**learn(wiring, rb, adv), **push(wiring)}

    m1 = learn_and_push(wiring, rb, np.array([1.0, -1.0, 0.5, -0.5], np.float32))
    assert m1["train/skipped_no_signal"] == 0.0 and wiring.weight_version == 1 and sampler.weight_version == 1
    before = _host(learner.state)
    w_before = _host(sampler.weight_state())

    m2 = learn_and_push(wiring, rb, np.zeros(4, np.float32))
    assert m2["train/skipped_no_signal"] == 1.0
    assert wiring.weight_version == 1 and sampler.weight_version == 1  # no push, no new version
    after = _host(learner.state)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(before, after))  # params, Adam moments, step
    assert all(a.tobytes() == b.tobytes() for a, b in zip(w_before, _host(sampler.weight_state())))
    assert int(learner.state.step) == 1


SECOND_CTRL_C = """
import os, signal, sys, threading, time
import numpy as np
from rl.run import loop
calls = []
signal.signal(signal.SIGINT, lambda *a: calls.append(a[0]))
loop._SecondInterrupt((signal.SIGTERM, signal.SIGINT))
a = np.random.RandomState(0).rand(1200, 1200)
np.linalg.eigvals(a)  # warm up: the threads of the BLAS, the pages
def two_ctrl_c():
    time.sleep(0.3)
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.1)
    os.kill(os.getpid(), signal.SIGINT)
threading.Thread(target=two_ctrl_c).start()
t = time.monotonic()
while time.monotonic() - t < 30:  # C calls of ~1 s each: the main thread runs Python only between them
    np.linalg.eigvals(a)
print("not interrupted", calls)
"""


def test_second_ctrl_c_exits_while_the_main_thread_is_in_c(tmp_path):
    """Two Ctrl-C within one long C call (a device step) reach Python's handler as one call; the loop's watcher
    of the wakeup fd sees both as they come and exits at once with 130 (CI saw a second Ctrl-C only finish the
    step)."""
    script = tmp_path / "two_ctrl_c.py"
    script.write_text(SECOND_CTRL_C)
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 130 and "interrupted again" in p.stderr, (p.returncode, p.stdout, p.stderr[-2000:])
    assert "not interrupted" not in p.stdout


FORKED_CHILD_CTRL_C = """
import os, signal, time
from rl.run import loop
signal.signal(signal.SIGINT, lambda *a: None)
loop._SecondInterrupt((signal.SIGTERM, signal.SIGINT))
pid = os.fork()  # a fork-started worker: a terminal's Ctrl-C reaches it too (the process group)
if pid == 0:
    os.kill(os.getpid(), signal.SIGINT)
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.3)
    os._exit(0)
os.waitpid(pid, 0)
os.kill(os.getpid(), signal.SIGINT)  # the parent's own first Ctrl-C
time.sleep(0.5)
print("finishing the step")
"""


def test_a_forked_childs_signals_do_not_count_as_the_parents(tmp_path):
    """A child forked without exec inherits the wakeup fd; its signals must not reach the parent's watcher (the
    parent's one Ctrl-C would have been its second and exited it)."""
    script = tmp_path / "forked_child.py"
    script.write_text(FORKED_CHILD_CTRL_C)
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "finishing the step" in p.stdout, (p.returncode, p.stdout, p.stderr[-2000:])

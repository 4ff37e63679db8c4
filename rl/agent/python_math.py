"""Math with a Python tool: the model may run code in the sandbox (rl/agent/sandbox.py) before it answers.

Tools: `python(code)` -> the code's stdout + stderr (at most `SandboxLimits.output_bytes`), or "error: ..." when it
fails, runs too long or prints too much. The reward is the math reward named by `reward`
(`rl.data.math_rewards.make_reward`: "math" = last \\boxed{}, "gsm8k", "dapo", "aime") on the final answer, i.e. the
content of the last assistant turn, against the row's data (the dataset's reference answer), exactly as a single-turn
run scores its responses. `rl.agent.env.reward` calls it in this process (a run: `rl.run.env_task.EnvReward`, whose
prompts `rl.run.env_task.load_python_math_data` reads from --dataset).
"""

from __future__ import annotations

from rl.agent.env import Environment
from rl.agent.sandbox import SandboxLimits, python_tool
from rl.data.math_rewards import make_reward

PYTHON_TOOL = {"type": "function", "function": {
    "name": "python", "description": "Run Python 3 code and return what it prints (stdout and stderr). No network; "
                                     "numpy and sympy may be imported.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string", "description": "the program"}},
                   "required": ["code"]}}}
SYSTEM = "Solve the problem. You may run Python to compute. Put the final answer in \\boxed{}."


def python_math_env(reward: str = "math", limits: SandboxLimits = SandboxLimits(), thinking: bool = False,
                    system: str = SYSTEM) -> Environment:
    """The python-math Environment (module docstring). Raises ValueError naming --reward for an unknown reward."""
    return Environment(name="python_math", tools=(PYTHON_TOOL,), handlers={"python": python_tool(limits)},
                       reward_fn=make_reward(reward), system=system, thinking=thinking)

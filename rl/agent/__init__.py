"""Agentic environments: tools the model calls in DeepSeek-V4's chat format during a multi-turn rollout.

    env.py          the interface (`Environment`: reset with the prompt's data, step with the model's message, reward
                    at the end) and the registry (`ENVIRONMENTS`, `make_env`, `--rollout.env`)
    pieces.py       `PieceTokenizer`: a tiny tokenizer of whole markup pieces + characters (the key-lookup task)
    key_lookup.py   a deterministic key -> value lookup tool the tiny model can learn from random init
    sandbox.py      the sandboxed Python tool (a child process under rlimits, no network, a wall timeout)
    python_math.py  math with a Python tool, reward from the final answer as the math rewards

The multi-turn rollout that drives them is rl/rollout/multiturn.py. Import the modules themselves.
"""

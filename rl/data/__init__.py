"""The data: what a prompt is and how its answer is scored.

    prompts.py       prompt records (jsonl / parquet) -> tokenised prompts -> a resumable grain iterator
    formats.py       the dataset layouts (gsm8k, verl, ...), field paths and chat templates of `--data-format`
    tokenizer.py     the `TokenizerLike` protocol and a Hugging Face `tokenizer.json` wrapper
    chat.py          a checkpoint's own Jinja chat template; chat_dsv4.py: DeepSeek-V4's chat format with tools
    tasks.py         the built-in digit task of the default run and its reward
    answers.py       the one answer parser of the math rewards
    rewards.py       reward functions and the time-limited reward worker (`RewardPool`)
    math_rewards.py  the math rewards (math, dapo, aime) and the `--reward` table

Import the modules themselves (nothing is re-exported here), e.g. `from rl.data.prompts import PromptDataset`.
"""

"""wmrl in TRL: a reward function for GRPOTrainer's `reward_funcs`.

Runs here: `make_reward_func` (only the client is needed). TRL itself is
not installed here; the trainer lines below are documentation.

    from trl import GRPOConfig, GRPOTrainer
    from wmrl_trl import make_reward_func

    trainer = GRPOTrainer(model=..., reward_funcs=[make_reward_func("http://host:8080")],
                          args=GRPOConfig(...), train_dataset=...)

TRL normalises rewards within each group, which cancels any per-group
weight: this gives debiasing only. For denoising as well, use the fused
advantages of the update (see examples/verl/wmrl_verl.py for the pattern).
Ungraded solutions come back as None, which TRL accepts and ignores.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
from wmrl_client import WMRLClient  # noqa: E402


def make_reward_func(url, run="default", token=None, retry_for=120.0, ca_file=None):
    """retry_for: how long a batch waits out the gateway's 503s (the world
    model down for the moment) before the error is raised; ca_file: the CA
    of an HTTPS gateway's certificate (None: the system's)."""
    client = WMRLClient(url, run=run, token=token, retry_for=retry_for, ca_file=ca_file)

    def wmrl_reward(prompts, completions, **columns):
        texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
        ps = [p if isinstance(p, str) else p[-1]["content"] for p in prompts]
        labels = columns.get("task_id") or [None] * len(texts)
        return client.openrlhf_rewards([p + t for p, t in zip(ps, texts)], prompts=ps, labels=labels)

    wmrl_reward.__name__ = "wmrl_reward"
    return wmrl_reward

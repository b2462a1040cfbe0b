"""wmrl in verl: debiased rewards, or fused advantages in place of GRPO's.

Runs here: `compute_score` (only the client is needed). `apply_fused_advantages`
needs torch and verl's DataProto (no GPU stack on this machine): it is
written against verl's GRPO trainer as of 2026, and run here against a
live gateway with stand-ins for the few things it takes from them
(examples/python/check_integrations.py).

1. Debiased rewards only (a config change): in the verl config,

       reward_model:
         reward_manager: batch
       custom_reward_function:
         path: examples/verl/wmrl_verl.py
         name: compute_score_batch

   verl's batch reward manager hands the whole batch to
   `compute_score_batch`, which sends it as one request: the gateway asks
   the world model for every solution at once (up to its
   --wm-concurrency). With verl's default manager (naive) use `name:
   compute_score`, which verl calls one solution at a time: a batch then
   waits for the world model once per solution, one after another.

   and export WMRL_URL=http://host:8080 (or several gateways of the run,
   comma-separated; WMRL_RUN, WMRL_HTTP_TOKEN optional;
   WMRL_RETRY_FOR, default 120: how many seconds a reward waits out the
   gateway's 503s while the world model is down, before it raises; WMRL_CA,
   the CA of an HTTPS gateway's certificate, when not the system's).
   GRPO's per-group normalisation cancels any per-group weight, so this
   gives debiasing only.

2. Debiasing and denoising: after verl computed rewards for a batch, call
   `apply_fused_advantages(batch, step)` in place of
   `compute_grpo_outcome_advantage` (verl/trainer/ppo/core_algos.py, called
   from compute_advantage in verl/trainer/ppo/ray_trainer.py). It submits
   the batch's trajectories, closes the step, waits for the update and
   writes fused_advantage into batch["advantages"] over each response's
   tokens. It numbers wmrl's steps by the run's next (GET .../steps), not
   by verl's: a trainer resumed from a checkpoint goes on where the run is
   (steps the run has closed take no more trajectories), and verl's step
   is kept as each trajectory's policy_version. Give it verl's
   `algorithm.norm_adv_by_std_in_grpo`: with false (Dr. GRPO) start the
   run with `--advantage-norm center`; it raises at the first update
   when the run forms its advantages otherwise than verl would.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
from wmrl_client import WMRLClient  # noqa: E402

_client = None


def client():
    global _client
    if _client is None:
        _client = WMRLClient(os.environ.get("WMRL_URL", "http://127.0.0.1:8080"),
                             run=os.environ.get("WMRL_RUN", "default"),
                             token=os.environ.get("WMRL_HTTP_TOKEN"),
                             retry_for=float(os.environ.get("WMRL_RETRY_FOR", "120")),
                             ca_file=os.environ.get("WMRL_CA"))
    return _client


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's custom reward: the debiased world-model score (the real one
    once this solution was executed as an anchor). verl wants a number; an
    ungraded solution has none, so it is reported as such instead of 0."""
    prompt = (extra_info or {}).get("prompt", "")
    score = client().slime_reward(prompt, solution_str, label=str(ground_truth))
    if score is None:
        return {"score": 0.0, "wmrl_ungraded": True}  # verl needs a float; flagged, not hidden
    return {"score": score, "wmrl_ungraded": False}


def compute_score_batch(data_sources, solution_strs, ground_truths, extra_infos=None, **kwargs):
    """verl's batch reward manager's custom reward: compute_score for a
    whole batch in one request (the gateway's OpenRLHF endpoint), so the
    world model scores the batch concurrently, not one solution after
    another. The same solution twice in a batch is scored once."""
    extra_infos = extra_infos if extra_infos is not None else [None] * len(solution_strs)
    prompts = [(e or {}).get("prompt", "") for e in extra_infos]
    scores = client().openrlhf_rewards([p + s for p, s in zip(prompts, solution_strs)], prompts=prompts,
                                       labels=[str(g) for g in ground_truths])
    return [{"score": 0.0, "wmrl_ungraded": True} if x is None else {"score": x, "wmrl_ungraded": False} for x in scores]


def check_advantage_norm(update, norm_adv_by_std_in_grpo=True):
    """Raise ValueError when the run formed the update's advantages
    otherwise than verl's GRPO would: standardised within the group
    (norm_adv_by_std_in_grpo true, the update's advantage_norm absent or
    "std") or only centred (false, Dr. GRPO: "center")."""
    got = update.get("advantage_norm", "std")
    want = "std" if norm_adv_by_std_in_grpo else "center"
    if got != want:
        raise ValueError(f"wmrl run {update.get('run')!r} forms its advantages as {got!r}; verl's "
                         f"norm_adv_by_std_in_grpo={norm_adv_by_std_in_grpo} wants {want!r}: start the run with --advantage-norm {want}")


def apply_fused_advantages(batch, step, tokenizer, norm_adv_by_std_in_grpo=True):  # pragma: no cover - needs verl + torch
    """Replace GRPO advantages with wmrl's fused advantages for one step;
    norm_adv_by_std_in_grpo is verl's setting of that name."""
    import torch  # noqa: F401  (verl's tensors)

    uids = batch.non_tensor_batch["uid"]  # verl's group id per sample
    prompts = tokenizer.batch_decode(batch.batch["prompts"], skip_special_tokens=True)
    responses = tokenizer.batch_decode(batch.batch["responses"], skip_special_tokens=True)
    wstep = client().next_step()
    trajs = [{
        "group_id": f"{wstep}-{u}", "traj_id": f"{wstep}-{i}",
        "task_id": str(batch.non_tensor_batch.get("data_source", ["task"] * len(uids))[i]),
        "prompt": p, "response": r, "policy_version": step, "meta": {},
    } for i, (u, p, r) in enumerate(zip(uids, prompts, responses))]
    client().send_step(wstep, trajs)  # each group's size as sent
    update = client().update(wstep, wait=3600)
    check_advantage_norm(update, norm_adv_by_std_in_grpo)
    fused = {it["traj_id"]: it["fused_advantage"] for it in update["items"]}
    scores = torch.tensor([fused[t["traj_id"]] for t in trajs], dtype=torch.float32)
    mask = batch.batch["response_mask"]
    batch.batch["advantages"] = scores.unsqueeze(-1) * mask
    batch.batch["returns"] = batch.batch["advantages"]
    return batch

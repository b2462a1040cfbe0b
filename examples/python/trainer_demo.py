"""Plays a trainer against `wmrl run --source external --http ADDR`.

For each step it submits groups of trajectories, closes the step, fetches the
update, and checks the fused advantages against its own computation of
WMRL's fusion from the update's rewards and rho:

    fused_i = A_i * w_i * m / (rho*|A| + |W|)

with A_i formed within the group as the update's advantage_norm says:
(r - mean) / (std + 1e-4) (GRPO, absent or "std"), or r - mean
(Dr. GRPO, "center", a run started with --advantage-norm center).

Exits non-zero on any mismatch. Standard library only.

    python3 examples/python/trainer_demo.py --url http://127.0.0.1:8080 --steps 3
"""

import argparse
import json
import math
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from wmrl_client import WMRLClient, WMRLError  # noqa: E402


def advantages(rewards, norm="std"):
    """GRPO: (r - mean) / (population std + 1e-4) over graded entries;
    Dr. GRPO (norm "center"): r - mean."""
    graded = [r for r in rewards if r is not None]
    if len(graded) < 2:
        return None
    mean = sum(graded) / len(graded)
    sd = math.sqrt(sum((r - mean) ** 2 for r in graded) / len(graded))
    scale = 1.0 if norm == "center" else 1 / (sd + 1e-4)
    return [0.0 if r is None else (r - mean) * scale for r in rewards]


def check(update):
    groups = {}
    for it in update["items"]:
        groups.setdefault(it["group_id"], []).append(it)
    rho, norm = update["rho"], update.get("advantage_norm", "std")
    adv = {gid: advantages([it["reward"] for it in items], norm) for gid, items in groups.items()}
    contributing = [gid for gid in groups if adv[gid] is not None]
    n_anchor = sum(1 for gid in contributing if groups[gid][0]["source"] == "anchor")
    n_wm = len(contributing) - n_anchor
    assert (len(contributing), n_anchor) == (update["groups"], update["anchors"]), "group counts differ"
    scale = len(contributing) / (rho * n_anchor + n_wm)
    for gid, items in groups.items():
        for i, it in enumerate(items):
            if adv[gid] is None or it["reward"] is None:
                want = 0.0
            else:
                w = rho if it["source"] == "anchor" else 1.0
                want = adv[gid][i] * w * scale
            if abs(want - it["fused_advantage"]) > 1e-9:
                raise AssertionError(f"step {update['step']} {it['traj_id']}: fused {it['fused_advantage']}, recomputed {want}")
    return len(update["items"])


def pad(code, n):
    """code, with a comment that makes it n bytes long (or as it is)."""
    return code if len(code) + 3 > n else code + "\n# " + "x" * (n - len(code) - 3)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True, help="the gateway, or several of the run, comma-separated")
    ap.add_argument("--run", default="default")
    ap.add_argument("--token", default=os.environ.get("WMRL_HTTP_TOKEN"))
    ap.add_argument("--ca", default=os.environ.get("WMRL_CA"), help="CA of an HTTPS gateway's certificate")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--first-step", type=int, default=None,
                    help="default: the run's next step, as a trainer resumed from a checkpoint numbers its steps")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--drop-one", action="store_true",
                    help="drop one trajectory of each step, as a trainer drops a rollout that failed")
    ap.add_argument("--response-bytes", type=int, default=0,
                    help="pad each solution with a comment to this length, as long generated code is")
    args = ap.parse_args()
    client = WMRLClient(args.url, run=args.run, token=args.token, ca_file=args.ca)
    rng = random.Random(7)
    first = client.next_step() if args.first_step is None else args.first_step
    if args.first_step is None:
        print(f"starting at step {first}, the run's next")
    for step in range(first, first + args.steps):
        trajs = []
        for g in range(args.groups):
            task = rng.randrange(10)
            for i in range(args.group_size):
                trajs.append({
                    "schema": 1, "run": args.run, "step": step, "group_id": f"py{step}-g{g}",
                    "traj_id": f"py{step}-g{g}-t{i}", "group_size": args.group_size, "task_id": f"task-{task}",
                    "prompt": f"Solve task {task}.", "response": pad(f"print({rng.random()})", args.response_bytes),
                    "policy_version": step, "meta": {},
                })
        if args.drop_one:
            trajs.pop(1)  # a rollout that failed: its group is sent one short
        assert client.send_step(step, trajs) == args.groups
        update = client.update(step, wait=60)
        n = check(update)
        assert n == len(trajs), f"update has {n} items for {len(trajs)} trajectories"
        mb = sum(len(json.dumps(t)) for t in trajs) / 1e6
        norm = update.get("advantage_norm", "std")
        print(f"step {step}: {n} fused advantages match ({norm}), rho {update['rho']:.3f}, anchors {update['anchors']}, {mb:.1f} MB of trajectories")
    try:
        client.update(10**9, wait=0)
        raise AssertionError("an unknown step returned an update")
    except WMRLError as e:
        assert e.status == 404, e
    cal = client.calibration()
    print(f"calibration v{cal['version']}, rho {cal['rho']:.3f}")
    r = client.slime_reward("Solve task 1.", "print(1)", label="task-1")
    assert r is None or 0.0 <= r <= 1.0, r
    print("ok")


if __name__ == "__main__":
    main()

"""Calls the runnable parts of the verl and TRL examples against a gateway."""

import os
import sys
import types

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "verl"))
sys.path.insert(0, os.path.join(here, "..", "trl"))
import wmrl_trl  # noqa: E402
import wmrl_verl  # noqa: E402

url, token = sys.argv[1], sys.argv[2]
ca = sys.argv[3] if len(sys.argv) > 3 else None  # an HTTPS gateway's CA
os.environ["WMRL_URL"], os.environ["WMRL_HTTP_TOKEN"] = url, token
if ca:
    os.environ["WMRL_CA"] = ca
s = wmrl_verl.compute_score("sim", "print(42)", "task-3", {"prompt": "Solve task 3."})
assert isinstance(s["score"], float) and 0.0 <= s["score"] <= 1.0 and s["wmrl_ungraded"] is False, s
f = wmrl_trl.make_reward_func(url, token=token, ca_file=ca)
r = f(prompts=["Solve task 1.", "Solve task 2."], completions=["print(1)", [{"role": "assistant", "content": "print(2)"}]],
      task_id=["task-1", "task-2"])
assert len(r) == 2 and all(x is None or 0.0 <= x <= 1.0 for x in r), r
# verl's batch reward manager: one request for the batch, the same scores
# as one at a time (the same solution twice scored alike).
b = wmrl_verl.compute_score_batch(["sim"] * 3, ["print(42)", "print(43)", "print(42)"], ["task-3", "task-3", "task-3"],
                                  [{"prompt": "Solve task 3."}, {"prompt": "Solve task 3."}, {"prompt": "Solve task 3."}])
assert len(b) == 3 and b[0] == s and b[2] == s, (b, s)
assert b[1] == wmrl_verl.compute_score("sim", "print(43)", "task-3", {"prompt": "Solve task 3."}), b
print("verl compute_score", s["score"], "compute_score_batch", [x["score"] for x in b], "trl rewards", r)


# verl's apply_fused_advantages, with stand-ins for what it takes from
# verl and torch: a DataProto's two dicts, a tokenizer's batch_decode, and
# torch.tensor, unsqueeze and * over plain lists.
class Tensor(list):
    def unsqueeze(self, dim):
        assert dim == -1
        return Tensor([[x] for x in self])

    def __mul__(self, mask):
        return Tensor([[row[0] * m for m in ms] for row, ms in zip(self, mask)])


torch = types.ModuleType("torch")
torch.tensor = lambda xs, dtype=None: Tensor(xs)
torch.float32 = "float32"
sys.modules["torch"] = torch


class Tokenizer:
    def batch_decode(self, rows, skip_special_tokens=True):
        return list(rows)


class Batch:
    pass


# Two groups of verl's uids; the second lost a rollout that failed.
uids = ["u0", "u0", "u0", "u0", "u1", "u1", "u1"]
batch = Batch()
batch.non_tensor_batch = {"uid": uids, "data_source": ["task-%d" % (i // 4) for i in range(len(uids))]}
batch.batch = {"prompts": ["Solve task %d." % (i // 4) for i in range(len(uids))],
               "responses": ["print(%d)" % i for i in range(len(uids))],
               "response_mask": [[1, 1, 0]] * len(uids)}
wstep = wmrl_verl.client().next_step()
out = wmrl_verl.apply_fused_advantages(batch, 7, Tokenizer())
update = wmrl_verl.client().update(wstep, wait=0)
fused = {it["traj_id"]: it["fused_advantage"] for it in update["items"]}
assert len(fused) == len(uids), update
for i, row in enumerate(out.batch["advantages"]):
    want = fused[f"{wstep}-{i}"]
    assert row == [want, want, 0], (i, row, want)
assert out.batch["returns"] is out.batch["advantages"]
print("verl apply_fused_advantages: step", wstep, "groups", update["groups"], "advantages", [r[0] for r in out.batch["advantages"]])

# verl set for Dr. GRPO against this run, which standardises: refused at
# its first update, saying what to start the run with.
try:
    wmrl_verl.apply_fused_advantages(batch, 8, Tokenizer(), norm_adv_by_std_in_grpo=False)
    raise AssertionError("verl's Dr. GRPO took a run's standardised advantages")
except ValueError as e:
    assert "--advantage-norm center" in str(e), e
    print("verl norm_adv_by_std_in_grpo=False against a std run:", e)
print("ok")

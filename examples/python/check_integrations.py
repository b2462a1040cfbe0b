"""Calls the runnable parts of the verl and TRL examples against a gateway."""

import os
import sys

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
print("verl compute_score", s["score"], "trl rewards", r)
print("ok")

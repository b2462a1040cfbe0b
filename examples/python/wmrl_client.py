"""A client for wmrl's HTTP gateway, standard library only.

    client = WMRLClient("http://127.0.0.1:8080", run="default", token=None)
    # a gateway that speaks HTTPS (wmrl --http-cert) under a CA of your own:
    client = WMRLClient("https://wmrl.internal:8443", token=..., ca_file="ca.pem")
    client.send_step(step, trajectories)  # dicts in the NATS contract's shape; sets
                                          # step, run and each group's size, then closes it
    # (or client.submit(trajectories) and client.close_step(step, groups=16))
    update = client.update(step, wait=60)  # the step's fused update (long poll)
    adv = {it["traj_id"]: it["fused_advantage"] for it in update["items"]}

Use fused_advantage where your trainer would use the GRPO advantage. The
update's "advantage_norm" says how it was formed within its group:
"center" (r - mean, Dr. GRPO) for a run started with --advantage-norm
center; absent, GRPO's (r - mean) / (std + 1e-4).

A 503 (the world model or NATS is down for the moment) or 429 is asked
again for up to `retry_for` seconds (default 120; 0: never), waiting what
its Retry-After says; after that WMRLError is raised, with the status and
the gateway's reason. So is a gateway that cannot be reached (refused,
reset, timed out: a wmrl run being restarted, a gateway not up yet),
asked again every second or so and said once on the "wmrl" logger; after
`retry_for` WMRLError is raised with status None and the cause. A TLS
certificate error is raised at once: asking again would not change it.
Asking again is safe: a trajectory or watermark sent twice within the
stream's dedup window (10 minutes) is stored once.

Several gateways of one run (the `wmrl run --http` processes of a run
with a standby, each serves one; `wmrl serve`) can be given, as a list or
separated by commas: `WMRLClient("http://a:8080,http://b:8080")`. A
request goes to the one that answered last; one that cannot be reached,
or answers 503 or 429, is left at once for the next, and only once every
gateway was tried does the client wait as above.
"""

import concurrent.futures
import json
import logging
import ssl
import time
import urllib.error
import urllib.request

RETRIED = (429, 503)
# Seconds between attempts to reach a gateway that does not answer.
UNREACHABLE_WAIT = 1.0

log = logging.getLogger("wmrl")
# A request's body at most: the gateway takes 16 MiB; half leaves room.
MAX_REQUEST_BYTES = 8 << 20


class WMRLError(Exception):
    """An error answered by the gateway: status code, its message, and the
    seconds its Retry-After asked to wait (None: it did not say)."""

    def __init__(self, status, message, retry_after=None):
        super().__init__(f"wmrl gateway {status}: {message}")
        self.status = status
        self.message = message
        self.retry_after = retry_after


class WMRLClient:
    def __init__(self, base_url, run="default", token=None, timeout=30.0, retry_for=120.0, ca_file=None, reward_timeout=600.0):
        urls = base_url.split(",") if isinstance(base_url, str) else list(base_url)
        self.bases = [u.strip().rstrip("/") + f"/v1/runs/{run}" for u in urls if u.strip()]
        if not self.bases:
            raise ValueError(f"no gateway URL in {base_url!r}")
        self._at = 0  # the gateway that answered last
        self.run = run
        self.token = token
        self.timeout = timeout
        # reward_timeout: how long a reward request may take. The gateway
        # asks the world model, an LLM that may take a minute under load,
        # and retries it itself (--wm-timeout, --wm-retries): the client
        # waits for its answer (a score, or a 502/503 saying why) rather
        # than asking again the whole batch after `timeout`.
        self.reward_timeout = reward_timeout
        self.retry_for = retry_for
        # ca_file: the CA that signed an HTTPS gateway's certificate (None:
        # the system's).
        self.ssl = ssl.create_default_context(cafile=ca_file) if ca_file else None

    @property
    def base(self):
        """The gateway in use (its run's URL)."""
        return self.bases[self._at % len(self.bases)]

    def _call(self, method, path, body=None, timeout=None):
        start = time.monotonic()
        deadline = start + self.retry_for
        said = False
        tried = 0  # gateways that failed since the last wait
        while True:
            base = self.base
            try:
                result = self._once(base, method, path, body, timeout)
                if said:
                    log.warning("wmrl gateway %s answers again, after %.0f s", base, time.monotonic() - start)
                return result
            except WMRLError as e:
                if e.status not in RETRIED:
                    raise
                wait = e.retry_after if e.retry_after is not None else 1.0
                answer, cause, unanswered = e, f"{e.status}: {e.message}", None
            except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
                # Not answered: refused or not resolved (URLError), or cut
                # off while the answer was read.
                cause = unreachable(e)
                if cause is None:
                    raise  # a TLS certificate error: asking again would not change it
                wait, unanswered = UNREACHABLE_WAIT, cause
            tried += 1
            if tried < len(self.bases):  # another gateway may answer at once
                self._at += 1
                if not said:
                    log.warning("wmrl gateway %s: %s; asking %s", base, cause, self.base)
                    said = True
                continue
            tried = 0
            if len(self.bases) > 1:
                self._at += 1
            now = time.monotonic()
            if unanswered is None:
                if now + wait > deadline:
                    raise answer
            else:
                if now >= deadline:
                    where = base if len(self.bases) == 1 else "any of " + ", ".join(self.bases)
                    raise WMRLError(None, f"could not reach {where} for {now - start:.0f} s: {unanswered}") from None
                if not said:
                    log.warning("wmrl gateway %s: %s; asking again for up to %.0f s", base, unanswered, self.retry_for)
                    said = True
                wait = min(wait, deadline - now)  # the last attempt at the deadline
            time.sleep(wait)

    def _once(self, base, method, path, body, timeout):
        # body: JSON-able, or bytes already encoded
        data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(base + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.timeout, context=self.ssl) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as e:
            try:
                msg = json.loads(e.read()).get("error", e.reason)
            except ValueError:
                msg = e.reason
            raise WMRLError(e.code, msg, retry_after(e.headers.get("Retry-After"))) from None

    def submit(self, trajectories, max_bytes=MAX_REQUEST_BYTES):
        """Publish a list of trajectories; returns how many were accepted.

        A step of long prompts and solutions can be larger than one request
        may be (the gateway takes 16 MiB): it goes in requests of at most
        max_bytes each. Each request is taken whole or not at all; if one is
        refused, those before it are stored, and sending the whole list
        again once the cause is fixed (within the stream's de-duplication
        window, 10 minutes) stores each trajectory once."""
        accepted, parts, size = 0, [], 2
        for t in trajectories:
            b = json.dumps(t).encode()
            if len(b) + 2 > max_bytes:
                raise ValueError(f"trajectory {t.get('traj_id')!r} is {len(b)} bytes of JSON, over the {max_bytes} a request may take")
            if parts and size + len(b) + 1 > max_bytes:
                accepted += self._call("POST", "/trajectories", b"[" + b",".join(parts) + b"]")["accepted"]
                parts, size = [], 2
            parts.append(b)
            size += len(b) + 1
        if parts:
            accepted += self._call("POST", "/trajectories", b"[" + b",".join(parts) + b"]")["accepted"]
        return accepted

    def send_step(self, step, trajectories):
        """Send a whole step and close it: every trajectory, with `step`,
        the client's run and its group's size as sent (`group_size`: how
        many of the list share its `group_id`), then the watermark with the
        number of groups. A rollout dropped because it failed thus shrinks
        its group instead of holding the step for the pipeline's
        --step-timeout. Returns the number of groups."""
        sizes = {}
        for t in trajectories:
            sizes[t["group_id"]] = sizes.get(t["group_id"], 0) + 1
        sent = [dict(t, schema=t.get("schema", 1), run=self.run, step=step, group_size=sizes[t["group_id"]]) for t in trajectories]
        self.submit(sent)
        self.close_step(step, groups=len(sizes))
        return len(sizes)

    def close_step(self, step, groups):
        """Publish the step's watermark: it has `groups` groups, no more will come."""
        return self._call("POST", f"/steps/{step}/close", {"groups": groups})

    def update(self, step, wait=60.0, poll=50.0):
        """The step's fused update, waiting up to `wait` seconds for it.

        It asks in long polls of at most `poll` seconds each: the gateway
        holds one for 10 minutes at most, and a load balancer in between
        may cut a request idle for a minute (AWS's default is 60 s). A
        step whose anchors execute for 20 minutes takes `wait` of more than
        that. After `wait`, the gateway's 404 ("has no update yet") is
        raised as WMRLError."""
        deadline = time.monotonic() + wait
        while True:
            ask = max(0.0, min(poll, deadline - time.monotonic()))
            try:
                return self._call("GET", f"/steps/{step}/update?wait={ask:.3f}", timeout=ask + self.timeout)
            except WMRLError as e:
                if e.status != 404 or "has no update yet" not in e.message or time.monotonic() >= deadline:
                    raise

    def steps(self):
        """Where the run is: the newest step planned and fused (None before
        any), and `next`, the first step number no trajectory has used."""
        return self._call("GET", "/steps")

    def next_step(self):
        """The step a trainer starts at, or resumes at after a checkpoint:
        steps the run planned already take no more trajectories (409), and
        a step it sent to before its crash keeps the rollouts it had."""
        return self.steps()["next"]

    def calibration(self):
        """The current isotonic map, its version, rho and D."""
        return self._call("GET", "/calibration")

    def openrlhf_rewards(self, query, prompts=None, labels=None, max_bytes=MAX_REQUEST_BYTES):
        """Rewards of a batch, in its order (None: ungraded). A batch of
        long prompts and solutions can be larger than one request may be
        (the gateway takes 16 MiB): it goes in requests of at most max_bytes
        each, sent at once, so that the world model still scores the whole
        batch together."""
        prompts = prompts or [""] * len(query)
        labels = labels or [None] * len(query)
        if not (len(prompts) == len(labels) == len(query)):
            raise ValueError(f"query, prompts and labels differ in length ({len(query)}, {len(prompts)}, {len(labels)})")
        chunks, start, size = [], 0, 0
        for i, item in enumerate(zip(query, prompts, labels)):
            n = len(json.dumps(item).encode()) + 3
            if n + 64 > max_bytes:
                raise ValueError(f"solution {i} is {n} bytes of JSON, over the {max_bytes} a request may take")
            if i > start and size + n + 64 > max_bytes:
                chunks.append((start, i))
                start, size = i, 0
            size += n
        chunks.append((start, len(query)))

        def ask(chunk):
            a, b = chunk
            body = {"query": query[a:b], "prompts": prompts[a:b], "labels": labels[a:b]}
            return self._call("POST", "/rewards/openrlhf", body, timeout=max(self.timeout, self.reward_timeout))["rewards"]

        if len(chunks) == 1:
            return ask(chunks[0])
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(8, len(chunks))) as pool:
            return [r for part in pool.map(ask, chunks) for r in part]

    def slime_reward(self, prompt, response, label=None):
        return self._call("POST", "/rewards/slime", {"prompt": prompt, "response": response, "label": label},
                          timeout=max(self.timeout, self.reward_timeout))


def unreachable(err):
    """What kept a request from the gateway, when asking again may get
    through (refused, reset, timed out, name not resolved yet); None for a
    TLS error or anything else, which asking again would not change."""
    reason = err.reason if isinstance(err, urllib.error.URLError) else err
    if isinstance(reason, ssl.SSLError) or not isinstance(reason, OSError):
        return None
    return str(reason)


def retry_after(value):
    """Seconds from a Retry-After of seconds (its HTTP-date form, which the
    gateway does not send, is taken as unknown)."""
    try:
        return max(0.0, float(value))
    except (TypeError, ValueError):
        return None

// abstain.js is an extra wmrl stage written in Node.js: it needs nothing
// from wmrl but the wire contract (schemas/*.schema.json and the README's
// rules for a stage of your own).
//
// A world model asked for several samples per trajectory (--wm-samples k)
// reports their standard deviation as each prediction's `spread`. Where the
// samples disagree by more than --max-spread, this stage withdraws the
// score: the item becomes `ungraded` with the reason, so wmrl drops it
// (never scoring it as 0) instead of training on a guess.
//
//   wmrl run --topology examples/node-abstain/topology.yaml \
//     --world-model openai --wm-samples 4 --wm-temperature 0.7 ...
//   (cd examples/node-abstain && npm install)
//   node examples/node-abstain/abstain.js --nats nats://127.0.0.1:4222 --max-spread 0.15
//
// A server that asks who it is gets what wmrl's own commands give: a
// token, or a user and password, from WMRL_NATS_TOKEN, WMRL_NATS_USER and
// WMRL_NATS_PASSWORD (the environment, which ps does not show); TLS files
// with --nats-ca, --nats-cert and --nats-key.
"use strict";

const { isIP } = require("node:net");
const { connect } = require("@nats-io/transport-node");
const { jetstream, jetstreamManager, AckPolicy } = require("@nats-io/jetstream");

function flags(argv) {
  const f = { nats: "nats://127.0.0.1:4222", prefix: "wmrl", run: "default", "max-spread": "0.15",
    "nats-ca": "", "nats-cert": "", "nats-key": "" };
  for (let i = 0; i < argv.length; i += 2) {
    const name = argv[i].replace(/^--/, "");
    if (!(name in f) || i + 1 >= argv.length) {
      throw new Error("usage: abstain.js [--nats URL] [--prefix P] [--run R] [--max-spread S] " +
        `[--nats-ca FILE] [--nats-cert FILE --nats-key FILE]; got ${argv[i]}`);
    }
    f[name] = argv[i + 1];
  }
  const maxSpread = Number(f["max-spread"]);
  if (!(maxSpread >= 0)) {
    throw new Error(`--max-spread ${f["max-spread"]}: want a number >= 0`);
  }
  return { ...f, maxSpread };
}

// abstain withdraws the scores of a prediction's items whose samples
// disagree; every other field passes through untouched. It throws on a
// message that is not a prediction.
function abstain(pred, maxSpread) {
  if (pred === null || typeof pred !== "object" || !Array.isArray(pred.items)) {
    throw new Error("not a prediction: no items array");
  }
  let withdrawn = 0;
  for (const it of pred.items) {
    if (it === null || typeof it !== "object") {
      throw new Error("not a prediction: an item is not an object");
    }
    const spread = it.spread ?? 0;
    if (typeof spread !== "number") {
      throw new Error(`item ${it.traj_id}: spread ${JSON.stringify(it.spread)} is not a number`);
    }
    if (it.score === null || it.score === undefined || spread <= maxSpread) {
      continue; // ungraded stays ungraded; agreeing samples keep their score
    }
    it.score = null;
    it.status = "ungraded";
    it.reason = `world model unsure: its samples' spread ${spread.toFixed(3)} > ${maxSpread}`;
    withdrawn++;
  }
  return withdrawn;
}

// connectOptions are nats.js's options for what the server asks.
function connectOptions(f, env) {
  // A stage runs for days: it waits for its server through a restart of
  // the run (nats.js gives up after 10 tries, about 20 s, by default, and
  // the stage would end while its steps wait for it).
  const opts = { servers: f.nats, name: "node-abstain", maxReconnectAttempts: -1 };
  if (env.WMRL_NATS_TOKEN) {
    opts.token = env.WMRL_NATS_TOKEN;
  }
  if (env.WMRL_NATS_USER) {
    opts.user = env.WMRL_NATS_USER;
    opts.pass = env.WMRL_NATS_PASSWORD || "";
  }
  if (f["nats-ca"] || f["nats-cert"] || f["nats-key"]) {
    opts.tls = {};
    if (f["nats-ca"]) opts.tls.caFile = f["nats-ca"];
    if (f["nats-cert"]) opts.tls.certFile = f["nats-cert"];
    if (f["nats-key"]) opts.tls.keyFile = f["nats-key"];
    // nats.js gives TLS no server name for a URL whose host is an IP
    // address, and Node then checks the certificate against "localhost":
    // name the address.
    const host = new URL(f.nats.replace(/^[a-z]+:/, "http:")).hostname;
    if (isIP(host)) opts.tls.host = host;
  }
  return opts;
}

// connectHint says what a refused connection may lack. A server that asks
// every client for a certificate (wmrl run --listen-client-ca) ends the
// TLS session of one without a certificate, and nats.js only times out.
function connectHint(f) {
  if ((f["nats-ca"] || /^tls:/.test(f.nats)) && !f["nats-cert"]) {
    return " (a server that asks for a client certificate, as wmrl run --listen-client-ca does, closes the connection without a word: give --nats-cert and --nats-key)";
  }
  return "";
}

async function main() {
  const f = flags(process.argv.slice(2));
  let nc;
  try {
    nc = await connect(connectOptions(f, process.env));
  } catch (err) {
    throw new Error(`could not connect to ${f.nats}: ${err.message || err}${connectHint(f)}`);
  }
  const jsm = await jetstreamManager(nc);
  const js = jetstream(nc);
  const stream = "WMRL_" + f.prefix.toUpperCase();
  const input = `${f.prefix}.${f.run}.pred_raw`;
  const output = `${f.prefix}.${f.run}.pred`;
  const dlq = `${f.prefix}.${f.run}.dlq`;
  const durable = `node_abstain_${f.run}`;
  // A durable pull consumer with explicit acks: a restart resumes where it
  // stopped, and nothing is acknowledged before its output is stored.
  await jsm.consumers.add(stream, { durable_name: durable, filter_subject: input, ack_policy: AckPolicy.Explicit });
  const consumer = await js.consumers.get(stream, durable);
  const messages = await consumer.consume();
  let stopping = false;
  const stop = async () => {
    stopping = true;
    await messages.close();
    await nc.drain();
  };
  (async () => {
    for await (const s of nc.status()) {
      if (s.type === "disconnect") console.error(`abstain: lost the server at ${s.server}; reconnecting`);
      if (s.type === "reconnect") console.error(`abstain: reconnected to ${s.server}`);
    }
  })();
  process.on("SIGTERM", stop);
  process.on("SIGINT", stop);
  console.error(`abstain: ${input} -> ${output}, withdrawing scores whose samples spread over ${f.maxSpread}`);

  for await (const m of messages) {
    // De-duplication IDs are stream-wide: derive this stage's from the input's.
    const id = (m.headers?.get("Nats-Msg-Id") || `${m.seq}`) + "/node-abstain";
    let pred;
    try {
      pred = JSON.parse(new TextDecoder().decode(m.data));
      const n = abstain(pred, f.maxSpread);
      if (n > 0) {
        console.error(`abstain: step ${pred.step} group ${pred.group_id}: withdrew ${n} of ${pred.items.length} scores`);
      }
    } catch (err) {
      // Malformed input can never be used: dead-letter it with the reason,
      // then terminate it so it is not redelivered.
      try {
        const letter = { schema: 1, subject: m.subject, stage: "node-abstain", reason: String(err.message || err),
          payload: new TextDecoder().decode(m.data), time: new Date().toISOString() };
        await js.publish(dlq, JSON.stringify(letter), { msgID: id + "/dlq" });
        m.term();
      } catch (perr) {
        console.error(`abstain: dead-lettering failed, retrying: ${perr.message}`);
        m.nak(1000);
      }
      continue;
    }
    try {
      await js.publish(output, JSON.stringify(pred), { msgID: id });
      m.ack(); // only once the output is stored
    } catch (err) {
      console.error(`abstain: publish failed, retrying: ${err.message}`);
      m.nak(1000); // retried; the ID makes the retry safe
    }
  }
  if (!stopping) {
    // The messages ended without a signal: the connection closed for good
    // (a server that refused the credentials). Exit non-zero, for a
    // supervisor to see and restart, rather than as if asked to stop.
    const err = await nc.closed();
    throw new Error(`the connection to ${f.nats} closed for good${err ? ": " + (err.message || err) : ""}`);
  }
}

if (require.main === module) {
  main().catch((err) => {
    console.error(`abstain: ${err.message || err}`);
    process.exit(1);
  });
}

module.exports = { abstain };

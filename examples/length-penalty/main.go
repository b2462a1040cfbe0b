// Command length-penalty is an extra wmrl stage: it lowers world-model
// scores of overlong solutions. It shows that a stage needs nothing from
// wmrl but the wire contract (schemas/ and the README): it uses only
// nats.go and its own JSON structs.
//
// Wire it in with topology.yaml (predict writes pred_raw; this stage reads
// pred_raw and writes pred, which pair and fuse read):
//
//	wmrl run --topology examples/length-penalty/topology.yaml
//	go run ./examples/length-penalty --nats nats://127.0.0.1:4222
//
// A server that asks who it is gets what wmrl's own commands give: a
// token, or a user and password, from WMRL_NATS_TOKEN, WMRL_NATS_USER and
// WMRL_NATS_PASSWORD; --nats-creds, --nats-ca, --nats-cert and --nats-key.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"log"
	"math"
	"os"
	"os/signal"
	"syscall"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// prediction mirrors the fields of schemas/pred.schema.json this stage
// touches; every other field passes through untouched.
type prediction map[string]json.RawMessage

type predItem map[string]json.RawMessage

func main() {
	url := flag.String("nats", nats.DefaultURL, "NATS server")
	var auth access
	flag.StringVar(&auth.creds, "nats-creds", "", "user credentials file (JWT and NKey seed)")
	flag.StringVar(&auth.ca, "nats-ca", "", "PEM file of the CA that signed the server's certificate")
	flag.StringVar(&auth.cert, "nats-cert", "", "client certificate (PEM), with --nats-key")
	flag.StringVar(&auth.key, "nats-key", "", "key (PEM) of --nats-cert")
	prefix := flag.String("prefix", "wmrl", "subject prefix")
	run := flag.String("run", "default", "run name")
	limit := flag.Int("limit", 4000, "responses longer than this many bytes are penalised")
	perChar := flag.Float64("per-char", 0.0005, "score lost per byte over the limit")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := serve(ctx, *url, auth.options(), *prefix, *run, *limit, *perChar); err != nil {
		log.Fatal(err)
	}
}

// penalty is what a response of n bytes loses.
func penalty(n, limit int, perChar float64) float64 {
	return perChar * math.Max(0, float64(n-limit))
}

// access is what a server may ask of this stage; secrets come from the
// environment, where ps does not show them.
type access struct{ creds, ca, cert, key string }

func (a access) options() []nats.Option {
	// A stage runs for days: it waits for its server through a restart of
	// the run (nats.go gives up after 60 tries, about 2 minutes, by default).
	opts := []nats.Option{nats.Name("length-penalty"), nats.MaxReconnects(-1)}
	if tok := os.Getenv("WMRL_NATS_TOKEN"); tok != "" {
		opts = append(opts, nats.Token(tok))
	}
	if user := os.Getenv("WMRL_NATS_USER"); user != "" {
		opts = append(opts, nats.UserInfo(user, os.Getenv("WMRL_NATS_PASSWORD")))
	}
	if a.creds != "" {
		opts = append(opts, nats.UserCredentials(a.creds))
	}
	if a.ca != "" {
		opts = append(opts, nats.RootCAs(a.ca))
	}
	if a.cert != "" || a.key != "" {
		opts = append(opts, nats.ClientCert(a.cert, a.key))
	}
	return opts
}

func serve(ctx context.Context, url string, opts []nats.Option, prefix, run string, limit int, perChar float64) error {
	// Say when the server goes and comes back, and leave when the
	// connection is closed for good (a server that refused the
	// credentials), for a supervisor to see, rather than wait for ever.
	closed := make(chan struct{})
	nc, err := nats.Connect(url, append(opts,
		nats.DisconnectErrHandler(func(nc *nats.Conn, err error) {
			log.Printf("lost the server at %s (%v); reconnecting", url, err)
		}),
		nats.ReconnectHandler(func(nc *nats.Conn) { log.Printf("reconnected to %s", nc.ConnectedUrlRedacted()) }),
		nats.ClosedHandler(func(*nats.Conn) { close(closed) }),
	)...)
	if err != nil {
		return err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	in := fmt.Sprintf("%s.%s.pred_raw", prefix, run)
	out := fmt.Sprintf("%s.%s.pred", prefix, run)
	cons, err := js.CreateOrUpdateConsumer(ctx, "WMRL_"+upper(prefix), jetstream.ConsumerConfig{
		Durable: "length_penalty_" + run, FilterSubject: in, AckPolicy: jetstream.AckExplicitPolicy,
	})
	if err != nil {
		return fmt.Errorf("consumer on %s: %w", in, err)
	}
	cc, err := cons.Consume(func(m jetstream.Msg) {
		b, err := shape(m.Data(), limit, perChar)
		if err != nil {
			log.Printf("skipping malformed prediction: %v", err)
			_ = m.Term()
			return
		}
		msg := nats.NewMsg(out)
		msg.Data = b
		// De-duplication IDs are stream-wide: derive a new one.
		msg.Header.Set(jetstream.MsgIDHeader, m.Headers().Get(jetstream.MsgIDHeader)+"/length-penalty")
		if _, err := js.PublishMsg(ctx, msg); err != nil {
			_ = m.Nak() // retried; the ID makes the retry safe
			return
		}
		_ = m.Ack()
	})
	if err != nil {
		return err
	}
	defer cc.Stop()
	select {
	case <-ctx.Done():
		return nil
	case <-closed:
		return fmt.Errorf("the connection to %s closed for good: %v", url, nc.LastError())
	}
}

// shape lowers each graded item's score by the penalty for its length.
func shape(data []byte, limit int, perChar float64) ([]byte, error) {
	var p prediction
	if err := json.Unmarshal(data, &p); err != nil {
		return nil, err
	}
	var items []predItem
	if err := json.Unmarshal(p["items"], &items); err != nil {
		return nil, fmt.Errorf("items: %w", err)
	}
	for _, it := range items {
		var score *float64
		var chars int
		if err := json.Unmarshal(it["score"], &score); err != nil {
			return nil, fmt.Errorf("score: %w", err)
		}
		if err := json.Unmarshal(it["response_chars"], &chars); err != nil {
			return nil, fmt.Errorf("response_chars: %w", err)
		}
		if score == nil {
			continue // ungraded stays ungraded
		}
		it["score"], _ = json.Marshal(math.Max(0, *score-penalty(chars, limit, perChar)))
	}
	var err error
	if p["items"], err = json.Marshal(items); err != nil {
		return nil, err
	}
	return json.Marshal(p)
}

func upper(s string) string {
	b := []byte(s)
	for i, c := range b {
		if c >= 'a' && c <= 'z' {
			b[i] = c - 'a' + 'A'
		}
	}
	return string(b)
}

package pipeline

import (
	"fmt"
	"slices"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/wmrl/wmrl/connectors/openai"
	"github.com/wmrl/wmrl/connectors/sandbox"
	"github.com/wmrl/wmrl/connectors/sim"
	"github.com/wmrl/wmrl/stages/breaker"
	"github.com/wmrl/wmrl/stages/predict"
)

// This file builds the process's world model, once, and the breaker that
// stops calling it while it is down.

// worldModelBreaker is the world model's breaker, one per process: the
// predict stage and the gateway's reward endpoints call the same world
// model, so what one finds down is down for the other.
func (p *Pipeline) worldModelBreaker() *breaker.Breaker {
	if p.wmBreaker != nil {
		return p.wmBreaker
	}
	stage, then := "gateway", "the gateway's reward endpoints answer 503 at once"
	if slices.Contains(p.cfg.Stages, StagePredict) {
		stage, then = StagePredict, "its groups are given up at once (recorded ungraded: their steps train on the anchors)"
		if p.cfg.HTTPAddr != "" {
			then += ", and the gateway's reward endpoints answer 503"
		}
	}
	p.wmBreaker = p.breaker(stage, "the world model", p.cfg.WMDownAfter, p.cfg.WMProbeEvery, p.metrics.WMDown, then)
	// Requests count too (the OpenAI-compatible client reports each): a
	// server that takes them and never answers fails calls only when
	// every retry of every request has timed out, all at once. Two waves
	// of the requests in flight failing, with no answer between, is down.
	inFlight := p.cfg.WMConcurrency
	if inFlight == 0 {
		inFlight = openai.DefaultConcurrency
	}
	p.wmBreaker.AttemptsAfter = 2 * inFlight
	return p.wmBreaker
}

// worldModelReplies is the process's one watch on what the world model's
// answers come to, so that predict and the gateway do not each say it.
func (p *Pipeline) worldModelReplies() *replies {
	if p.wmReplies == nil {
		p.wmReplies = &replies{notef: p.notef}
	}
	return p.wmReplies
}

// breaker gives a stage's work up at once while the service it calls keeps
// failing (then says what becomes of the work meanwhile), shows it on
// gauge, and says so when it starts and stops.
func (p *Pipeline) breaker(stage, name string, after int, probe time.Duration, gauge prometheus.Gauge, then string) *breaker.Breaker {
	return &breaker.Breaker{Name: name, After: after, Probe: probe, OnChange: func(st breaker.State) {
		if st.Open {
			gauge.Set(1)
			failed := fmt.Sprintf("%d calls in a row failed", st.Failures)
			if st.Requests > 0 {
				failed = fmt.Sprintf("%d requests in a row failed", st.Requests)
			}
			p.notef("%s: %s is down: %s, the last: %v; %s until a call succeeds, tried once every %v",
				stage, name, failed, st.Last, then, probe)
			return
		}
		gauge.Set(0)
		down := st.At.Sub(st.Since)
		if down >= time.Second {
			down = down.Round(time.Second)
		}
		where := fmt.Sprintf(" (wmrl dlq --stage %s)", stage)
		if stage == "gateway" {
			where = " (answered 503)"
		}
		p.notef("%s: %s is back after %v; %d calls were not made meanwhile%s",
			stage, name, down.Round(time.Millisecond), st.Refused, where)
	}}
}

// worldModel builds the configured world model once per process.
func (p *Pipeline) worldModel() (predict.WorldModel, error) {
	if p.wm != nil {
		return p.wm, nil
	}
	wm := p.cfg.WorldModelImpl
	if wm == nil {
		var onAttempt func(error)
		if p.cfg.WorldModel == "openai" {
			onAttempt = p.worldModelBreaker().Attempt
		}
		var err error
		if wm, err = NewWorldModel(p.cfg, onAttempt, p.metrics.ObserveWMRequest); err != nil {
			return nil, err
		}
	}
	p.wm = wm
	p.metrics.WorldModel.WithLabelValues(wm.Name()).Set(1)
	return wm, nil
}

// NewWorldModel builds the world model cfg configures (WorldModel and the
// WM* fields; the task's limits from TaskDir): the simulated one, or an
// OpenAI-compatible server's client, which tells onAttempt and onRequest,
// if set, how each request ended (openai.Config's OnAttempt, OnRequest).
func NewWorldModel(cfg Config, onAttempt func(error), onRequest func(openai.Request)) (predict.WorldModel, error) {
	if cfg.WorldModel != "openai" {
		return sim.DefaultWorldModel(), nil
	}
	oc := cfg.openaiConfig()
	oc.OnAttempt, oc.OnRequest = onAttempt, onRequest
	if cfg.TaskDir != "" && cfg.executor() != "sim" {
		// What an execution may take is part of its outcome. task.json
		// alone: a world model's process needs no private answers.
		tasks, err := sandbox.ReadTasksJSON(cfg.TaskDir)
		if err != nil {
			return nil, err
		}
		// And what data it has: where this process has the public data,
		// its files, rows and columns.
		if len(tasks) == 1 {
			oc.Limits = cfg.execLimits(tasks[0]).For(tasks[0]).ForCode()
			oc.DataSummary, _ = tasks[0].DataSummary()
		} else {
			oc.TaskLimits, oc.TaskData = map[string]string{}, map[string]string{}
			for _, t := range tasks {
				oc.TaskLimits[t.Name] = cfg.execLimits(t).For(t).ForCode()
				if d, err := t.DataSummary(); err == nil {
					oc.TaskData[t.Name] = d
				}
			}
		}
	}
	if cfg.WMTemplateFile != "" {
		var err error
		if oc.Template, err = openai.LoadTemplate(cfg.WMTemplateFile); err != nil {
			return nil, err
		}
	}
	wm, err := openai.New(oc)
	if err != nil {
		return nil, err
	}
	return wm, nil
}

// openaiConfig is the OpenAI-compatible world model's client config.
func (c *Config) openaiConfig() openai.Config {
	retries := c.WMRetries
	if retries == 0 {
		retries = -1 // the client's 0 is its default
	}
	return openai.Config{BaseURL: c.WMURL, Model: c.WMModel, APIKey: c.WMAPIKey, Samples: c.WMSamples,
		Temperature: c.WMTemperature, MaxTokens: c.WMMaxTokens, Concurrency: c.WMConcurrency,
		Timeout: c.WMTimeout, Retries: retries}
}

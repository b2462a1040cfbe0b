package main

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/wmrl/wmrl/connectors/sim/rl"
)

func simCommand() *cobra.Command {
	cfg := rl.DefaultConfig()
	var scenarios, out string
	var seeds int
	var asJSON, noSweep bool
	cmd := &cobra.Command{
		Use:   "sim",
		Short: "Benchmark the corrections on a synthetic RL problem: every method on the same seeds, tables, plots, a sweep",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			var scs []rl.Scenario
			if scenarios == "all" {
				scs = rl.Scenarios
			} else {
				for _, name := range strings.Split(scenarios, ",") {
					sc, err := rl.ScenarioByName(strings.TrimSpace(name))
					if err != nil {
						return err
					}
					scs = append(scs, sc)
				}
			}
			if seeds < 2 {
				return fmt.Errorf("sim: --seeds %d: intervals need at least 2", seeds)
			}
			if err := os.MkdirAll(out, 0o755); err != nil {
				return err
			}
			bar := newProgressBar(cmd.ErrOrStderr())
			res, err := rl.Run(rl.Options{Config: cfg, Seeds: seeds, Scenarios: scs, Methods: rl.Methods, Progress: bar.set("training")})
			if err != nil {
				return err
			}
			var cells []rl.SweepCell
			if !noSweep {
				if cells, err = rl.Sweep(cfg, seeds, bar.set("sweep")); err != nil {
					return err
				}
			}
			bar.done()
			var pngs []string
			for _, r := range res {
				p, err := rl.PlotCurves(out, r, rl.Methods[:6])
				if err != nil {
					return err
				}
				pngs = append(pngs, p)
			}
			if cells != nil {
				p, err := rl.PlotSweep(out, cells)
				if err != nil {
					return err
				}
				pngs = append(pngs, p)
			}
			w := cmd.OutOrStdout()
			if asJSON {
				return writeSimJSON(w, cfg, seeds, res, cells)
			}
			fmt.Fprintf(w, "cost model (units of one generation): generation %g, world-model call %g, execution %g\n",
				cfg.Costs.Generate, cfg.Costs.WorldModel, cfg.Costs.Execute)
			fmt.Fprintf(w, "%d seeds, %d steps, %d groups of %d, anchor fraction %.2f, %s policy; intervals are 95%% (Student t)\n",
				seeds, cfg.Steps, cfg.Groups, cfg.GroupSize, cfg.AnchorFraction, map[bool]string{false: "tabular softmax", true: "linear"}[cfg.Linear])
			for _, r := range res {
				rl.WriteTable(w, r, rl.Methods)
			}
			if cells != nil {
				rl.WriteSweep(w, cells)
			}
			fmt.Fprintf(w, "\nplots: %s\n", strings.Join(pngs, ", "))
			return nil
		},
	}
	fs := cmd.Flags()
	fs.StringVar(&scenarios, "scenario", "all", "scenarios, comma-separated, or all")
	fs.IntVar(&seeds, "seeds", 8, "seeds per method (paired across methods)")
	fs.IntVar(&cfg.Steps, "steps", cfg.Steps, "training steps")
	fs.IntVar(&cfg.Groups, "groups", cfg.Groups, "groups per step")
	fs.Float64Var(&cfg.AnchorFraction, "anchor-fraction", cfg.AnchorFraction, "share of groups executed")
	fs.BoolVar(&cfg.Linear, "linear", false, "a linear policy over shared style features instead of a softmax per task")
	fs.Float64Var(&cfg.Costs.WorldModel, "cost-wm", cfg.Costs.WorldModel, "cost of a world-model call, in generations")
	fs.Float64Var(&cfg.Costs.Execute, "cost-exec", cfg.Costs.Execute, "cost of an execution, in generations")
	fs.StringVar(&out, "out", "sim-out", "folder for the PNG plots")
	fs.BoolVar(&asJSON, "json", false, "print JSON instead of tables")
	fs.BoolVar(&noSweep, "no-sweep", false, "skip the noise x anchor-fraction sweep")
	return cmd
}

func writeSimJSON(w io.Writer, cfg rl.Config, seeds int, res []rl.ScenarioResult, cells []rl.SweepCell) error {
	doc := map[string]any{
		"cost_model": cfg.Costs, "seeds": seeds, "steps": cfg.Steps, "groups": cfg.Groups, "group_size": cfg.GroupSize,
		"anchor_fraction": cfg.AnchorFraction, "linear_policy": cfg.Linear, "sweep": cells,
	}
	scs := map[string]any{}
	for _, r := range res {
		scs[r.Scenario] = r.Methods
	}
	doc["scenarios"] = scs
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(doc)
}

// progressBar draws one line on a terminal (stderr), redrawn as work is done.
type progressBar struct {
	w     io.Writer
	start time.Time
	last  time.Time
}

func newProgressBar(w io.Writer) *progressBar { return &progressBar{w: w, start: time.Now()} }

func (b *progressBar) set(label string) func(done, total int) {
	return func(done, total int) {
		if time.Since(b.last) < 100*time.Millisecond && done < total {
			return
		}
		b.last = time.Now()
		const width = 30
		n := width * done / total
		fmt.Fprintf(b.w, "\r%-8s [%s%s] %3d%% %5d/%d  %s ", label, strings.Repeat("#", n), strings.Repeat(".", width-n),
			100*done/total, done, total, time.Since(b.start).Round(time.Second))
	}
}

func (b *progressBar) done() { fmt.Fprintln(b.w) }

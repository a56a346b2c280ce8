package checkback

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/txoutbox/txoutbox/outbox"
)

// A schedule is read the same everywhere, white space around it ignored: " off" turns its job
// off for RunOnce as for Run (RunOnce compared the raw string and ran it), and Config shows
// the trimmed value. White space alone is still refused.
func TestScheduleOffWithSpaces(t *testing.T) {
	t.Parallel()
	d := (&Config{ResolveSchedule: " off", StaleSchedule: "off\t", PurgeSchedule: " @every 1m "}).WithDefaults()
	if d.ResolveSchedule != ScheduleOff || d.StaleSchedule != ScheduleOff || d.PurgeSchedule != "@every 1m" {
		t.Fatalf("schedules with defaults: %q %q %q", d.ResolveSchedule, d.StaleSchedule, d.PurgeSchedule)
	}
	if err := ValidateConfig(&Config{ResolveSchedule: "   "}); err == nil {
		t.Error("a schedule of white space accepted")
	}

	e := newEnv(t)
	h := e.prepare(outbox.Message{}, &outbox.PrepareOptions{Fence: true})
	e.backdate(time.Hour, h.ID)
	reg := prometheus.NewRegistry()
	cfg := fastConfig()
	cfg.ResolveSchedule, cfg.StaleSchedule, cfg.Registerer = " off", "\toff ", reg
	cb := e.checkback(cfg)
	if got := cb.Config(); got.ResolveSchedule != ScheduleOff || got.StaleSchedule != ScheduleOff {
		t.Fatalf("Config(): schedules %q and %q, want off", got.ResolveSchedule, got.StaleSchedule)
	}
	if _, err := cb.RunOnce(context.Background()); err != nil {
		t.Fatal(err)
	}
	if st, _ := e.state(h.ID); st != "prepared" {
		t.Errorf("the fenced row due for a check is %s: the resolve job ran although off", st)
	}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	ran := map[string]bool{}
	for _, mf := range mfs {
		if mf.GetName() != "txoutbox_checkback_job_duration_seconds" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "job" && m.GetHistogram().GetSampleCount() > 0 {
					ran[l.GetValue()] = true
				}
			}
		}
	}
	if ran["resolve"] || ran["stale"] || !ran["purge"] {
		t.Errorf("jobs run: %v, want purge alone", ran)
	}
}

package checkback

import (
	"context"
	"maps"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/txoutbox/txoutbox/outbox"
)

// The per-group gauges of the stale job: open half messages by group and state, the oldest
// prepared one's age; a group with no open half message left loses its series.
func TestHalfMessagesByGroupGauges(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	reg := prometheus.NewRegistry()
	cfg := fastConfig()
	cfg.Registerer = reg
	cb := e.checkback(cfg)
	ctx := context.Background()
	e.prepare(outbox.Message{}, &outbox.PrepareOptions{Group: "payments"})
	e.prepare(outbox.Message{}, &outbox.PrepareOptions{Group: "payments"})
	refund := e.prepare(outbox.Message{}, &outbox.PrepareOptions{Group: "refunds"})
	e.backdate(90*time.Second, refund.ID)

	read := func() (map[string]float64, map[string]float64) {
		mfs, err := reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		half, oldest := map[string]float64{}, map[string]float64{}
		for _, mf := range mfs {
			for _, m := range mf.GetMetric() {
				l := m.GetLabel()
				switch mf.GetName() {
				case "txoutbox_checkback_half_messages":
					half[l[0].GetValue()+" "+l[1].GetValue()] = m.GetGauge().GetValue()
				case "txoutbox_checkback_oldest_prepared_age_seconds":
					oldest[l[0].GetValue()] = m.GetGauge().GetValue()
				}
			}
		}
		return half, oldest
	}
	if _, err := cb.staleOnce(ctx); err != nil {
		t.Fatal(err)
	}
	half, oldest := read()
	want := map[string]float64{"payments prepared": 2, "payments check_exhausted": 0, "refunds prepared": 1, "refunds check_exhausted": 0}
	if !maps.Equal(half, want) {
		t.Fatalf("half messages by group = %v, want %v", half, want)
	}
	if oldest["refunds"] < 89 || oldest["refunds"] > 120 || oldest["payments"] > 60 {
		t.Fatalf("oldest prepared by group = %v, want refunds about 90s and payments fresh", oldest)
	}

	if err := e.client.Rollback(ctx, e.db.Pool, refund.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := cb.staleOnce(ctx); err != nil {
		t.Fatal(err)
	}
	half, oldest = read()
	if _, ok := oldest["refunds"]; ok || len(half) != 2 || half["payments prepared"] != 2 {
		t.Fatalf("after the refund was rolled back: half %v, oldest %v; want payments only", half, oldest)
	}
}

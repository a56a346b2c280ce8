package relay

import (
	"errors"
	"log/slog"
	"testing"

	"github.com/nats-io/nats.go/jetstream"
)

// A lost quorum is told by what the stream's info said, carried as a flag from outageReason
// to the outage, not read back from the reason's words: a reason that merely begins like the
// lost-quorum text (a decorated one, a reworded one) no longer decides, and one that says it
// another way still does.
func TestLostQuorumIsAFlagNotText(t *testing.T) {
	t.Parallel()
	lost := &jetstream.StreamInfo{Cluster: &jetstream.ClusterInfo{Leader: "n1", Replicas: []*jetstream.PeerInfo{
		{Name: "n2", Current: false}, {Name: "n3", Current: false},
	}}}
	healthy := &jetstream.StreamInfo{Cluster: &jetstream.ClusterInfo{Leader: "n1", Replicas: []*jetstream.PeerInfo{
		{Name: "n2", Current: true}, {Name: "n3", Current: true},
	}}}
	timeout := errors.New("timeout")
	if reason, q := outageReason(timeout, lost, nil); !q || reason == "" {
		t.Errorf("outageReason for a leader without its quorum = %q, %v; want lostQuorum", reason, q)
	}
	for name, info := range map[string]*jetstream.StreamInfo{"healthy": healthy, "leaderless": {Cluster: &jetstream.ClusterInfo{}}} {
		if reason, q := outageReason(timeout, info, nil); q {
			t.Errorf("outageReason for a %s stream = %q, lostQuorum; want not", name, reason)
		}
	}

	e := newEnv(t)
	logs := newEventLog()
	r := e.relay(&Config{Logger: slog.New(logs)})
	const lostLine = "stream ORDERS "
	// Known already, then found to have lost its quorum: one warning naming the reason.
	r.outages.begin(r, "ORDERS", []string{"orders.>"}, "orders.created", "has no leader (test)", false)
	r.outages.begin(r, "ORDERS", []string{"orders.>"}, "orders.created", "its replicas are gone (reworded)", true)
	r.outages.begin(r, "ORDERS", []string{"orders.>"}, "orders.created", "its replicas are gone (reworded)", true)
	if n := logs.count(slog.LevelWarn, lostLine); n != 1 {
		t.Errorf("%d lost-quorum warnings for a flagged reason, want 1", n)
	}
	// A reason worded like a lost quorum but not flagged is not one.
	r.outages.begin(r, "OTHER", []string{"other.>"}, "other.x", "has no leader (test)", false)
	r.outages.begin(r, "OTHER", []string{"other.>"}, "other.x", "has lost its quorum (words only)", false)
	if n := logs.count(slog.LevelWarn, "stream OTHER "); n != 0 {
		t.Errorf("%d lost-quorum warnings for an unflagged reason, want 0", n)
	}
	r.outages.mu.Lock()
	defer r.outages.mu.Unlock()
	if !r.outages.m["ORDERS"].lostQuorum || r.outages.m["OTHER"].lostQuorum {
		t.Errorf("lostQuorum: ORDERS %v, OTHER %v; want true, false", r.outages.m["ORDERS"].lostQuorum, r.outages.m["OTHER"].lostQuorum)
	}
}

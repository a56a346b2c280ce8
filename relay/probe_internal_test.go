package relay

import (
	"context"
	"errors"
	"fmt"
	"net"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// A publish answered with an outage code (10158, "duplicate message id is in process") while
// the stream's info answers with a leader and a quorum is an outage for leaderGraceWaves waves
// of that leader and at least leaderGraceMin, then the subject's own failure (errNoPubAck: an
// attempt is counted), so that a copy stuck at the leader never holds its key for ever.
// However many waves come sooner (they come every few hundred milliseconds, and a leader whose
// replicas just went still reports them current for seconds), they stay an outage. Without a
// quorum it stays an outage.
func TestOutageCodeWithAHealthyLeaderIsBounded(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	r := e.relay(nil)
	inProcess := &jetstream.APIError{Code: 409, ErrorCode: 10158, Description: "duplicate message id is in process"}
	healthy := &jetstream.StreamInfo{Config: jetstream.StreamConfig{Name: "ORDERS", Subjects: []string{"orders.>"}},
		Cluster: &jetstream.ClusterInfo{Leader: "n1", Replicas: []*jetstream.PeerInfo{{Name: "n2", Current: true}, {Name: "n3", Current: true}}}}
	for wave := 1; wave <= 3*leaderGraceWaves; wave++ {
		var so *streamOutageError
		if err := r.verdict("orders.x", &streamProbe{name: "ORDERS", info: healthy}, inProcess); !errors.As(err, &so) {
			t.Fatalf("wave %d within %s of the first: %v, want a stream outage", wave, leaderGraceMin, err)
		}
	}
	// The series began leaderGraceMin ago (back-dated): the next wave is the subject's own.
	r.strikes.mu.Lock()
	r.strikes.m["ORDERS"].first = time.Now().Add(-leaderGraceMin)
	r.strikes.mu.Unlock()
	if err := r.verdict("orders.x", &streamProbe{name: "ORDERS", info: healthy}, inProcess); !errors.Is(err, errNoPubAck) {
		t.Fatalf("a wave %s after the first: %v, want the subject's own failure (errNoPubAck)", leaderGraceMin, err)
	}
	noQuorum := &jetstream.StreamInfo{Config: healthy.Config,
		Cluster: &jetstream.ClusterInfo{Leader: "n1", Replicas: []*jetstream.PeerInfo{{Name: "n2", Offline: true}, {Name: "n3", Offline: true}}}}
	for wave := 1; wave <= 2*leaderGraceWaves; wave++ {
		var so *streamOutageError
		if err := r.verdict("orders.y", &streamProbe{name: "ORDERS", info: noQuorum}, inProcess); !errors.As(err, &so) {
			t.Fatalf("wave %d without a quorum: %v, want a stream outage", wave, err)
		}
	}
}

// A publish that times out while the leader has not heard from a quorum of its replicas for
// replicaSuspectAfter (not yet replicaSeenWithin: the stream still counts as able to store)
// is an outage wave that counts no strike, however many there are: the quorum may be going.
func TestSuspectQuorumCountsNoStrike(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	r := e.relay(nil)
	slow := replicaSuspectAfter + (replicaSeenWithin-replicaSuspectAfter)/2
	info := &jetstream.StreamInfo{Config: jetstream.StreamConfig{Name: "ORDERS", Subjects: []string{"orders.>"}},
		Cluster: &jetstream.ClusterInfo{Leader: "n1", Replicas: []*jetstream.PeerInfo{{Name: "n2", Current: true, Active: slow}, {Name: "n3", Current: true, Active: slow}}}}
	if !canStore(info) || !mayLackQuorum(info) {
		t.Fatalf("replicas heard from %s ago: canStore %v, mayLackQuorum %v; want true, true", slow, canStore(info), mayLackQuorum(info))
	}
	for wave := 1; wave <= 3*leaderGraceWaves; wave++ {
		var so *streamOutageError
		if err := r.verdict("orders.x", &streamProbe{name: "ORDERS", info: info}, jetstream.ErrAsyncPublishTimeout); !errors.As(err, &so) {
			t.Fatalf("wave %d: %v, want a stream outage (no strike)", wave, err)
		}
	}
}

// When a wave's probe time is spent (another stream's info timed out: its leader is being
// elected), a stream the relay knows that was not asked yet counts as a stream outage, as the
// one that timed out did, not as a broker outage that stops the whole batch and marks the
// relay nats_unavailable: two streams whose leaders were on one node elect at once. A subject
// of no known stream is still a broker outage (nothing says which stream it is).
func TestUnaskedKnownStreamIsAStreamOutage(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	r := e.relay(nil)
	r.known.learn(&jetstream.StreamConfig{Name: "PAYMENTS", Subjects: []string{"payments.>"}})
	spent, cancel := context.WithCancel(context.Background())
	cancel()
	byStream := map[string]*streamProbe{}
	timeout := fmt.Errorf("publish: %w", jetstream.ErrNoStreamResponse)
	p := r.probeSubject(spent, "payments.charged", byStream, false)
	var so *streamOutageError
	if err := r.verdict("payments.charged", p, timeout); !errors.As(err, &so) {
		t.Fatalf("a known stream not asked for lack of time: %v, want a stream outage", err)
	}
	if byStream["PAYMENTS"] != p {
		t.Fatal("the stream's probe is not kept for the wave's other subjects")
	}
	p = r.probeSubject(spent, "unknown.subject", byStream, false)
	if !p.skipped || !isBrokerError(r.verdict("unknown.subject", p, timeout)) {
		t.Fatalf("a subject of no known stream, not asked: %+v, want skipped and a broker outage", p)
	}
}

// A stream info that did not answer because the relay's own connection went down (closed by
// the write fence after a pause, reconnecting) makes the publish a broker outage, not a stream
// without a leader: the stream's gauge and its "has no leader" line were wrong after every
// fenced wake. A timeout stays the stream's (what an election gives).
func TestStreamInfoFailingOnTheConnectionIsABrokerOutage(t *testing.T) {
	t.Parallel()
	r := &Relay{cfg: (&Config{}).WithDefaults()}
	for _, infoErr := range []error{nats.ErrReconnectBufExceeded, nats.ErrConnectionClosed, nats.ErrConnectionReconnecting,
		fmt.Errorf("stream info: %w", ErrStaleWrite), net.ErrClosed} {
		p := &streamProbe{name: "ACC", infoErr: infoErr}
		if got := r.verdict("acc.x", p, jetstream.ErrAsyncPublishTimeout); !isBrokerError(got) {
			t.Errorf("info error %v: verdict %v, want a broker outage", infoErr, got)
		}
	}
	for _, infoErr := range []error{context.DeadlineExceeded, nats.ErrTimeout} {
		if connectionLost(infoErr) {
			t.Errorf("connectionLost(%v) = true: a timeout is what a stream electing a leader gives", infoErr)
		}
	}
}

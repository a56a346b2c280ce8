package demo

import (
	"bytes"
	"context"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/txoutbox/txoutbox/internal/testsvc"
)

// chaosMessagesEnv sets the size of TestChaos: 2,000 messages by default (about a minute),
// 500 with -short; the full proof is TXOUTBOX_CHAOS_MESSAGES=10000.
const chaosMessagesEnv = "TXOUTBOX_CHAOS_MESSAGES"

// chaosClusterEnv=1 runs TestChaosCluster.
const chaosClusterEnv = "TXOUTBOX_CHAOS_CLUSTER"

// The chaos proof: messages from producers in this process go through the outbox, three
// processes of the real relay binary sharing the partitions, and JetStream to an ordered
// consumer process while the processes are SIGKILLed at random and at their fault points,
// relays are frozen with SIGSTOP (shorter than the lease interval, and past the fence delay so
// that the others take their partitions), NATS restarts and their PostgreSQL backends are
// terminated. Every invariant must hold (per key, the effects applied in commit order with no
// gap and no duplicate, among them), and every kind of fault must have happened.
func TestChaos(t *testing.T) {
	t.Parallel()
	testChaos(t, false)
}

// The chaos proof on a three-node JetStream cluster with R3 streams: the NATS fault is a
// SIGKILL-like kill of the stream leader's node (restarted with its store a little later) or a
// leader step-down; the relay and the consumer connect with every node's URL.
func TestChaosCluster(t *testing.T) {
	if os.Getenv(chaosClusterEnv) != "1" {
		t.Skipf("%s is not 1: the cluster chaos run (three nodes, a leader election per kill) would take "+
			"go test ./internal/demo past its time budget; run it with %s=1 (size: %s, default 2000)",
			chaosClusterEnv, chaosClusterEnv, chaosMessagesEnv)
	}
	t.Parallel()
	testChaos(t, true)
}

func testChaos(t *testing.T, cluster bool) {
	messages := 2000
	if testing.Short() {
		messages = 500
	}
	if v := os.Getenv(chaosMessagesEnv); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 {
			t.Fatalf("%s=%q: want a positive number", chaosMessagesEnv, v)
		}
		messages = n
	}
	var out bytes.Buffer
	res, err := RunChaos(context.Background(), ChaosConfig{
		DSN:         testsvc.PostgresDSN(t),
		Messages:    messages,
		RelayBin:    relayBinary(t),
		ConsumerExe: demoBinary(t),
		Out:         &out,
		Timeout:     time.Duration(messages)*10*time.Millisecond + 10*time.Minute,
		Cluster:     cluster,
	})
	t.Log("\n" + out.String())
	if err != nil {
		t.Fatalf("chaos: %v", err)
	}
	if !res.Tally.OK() {
		t.Fatalf("an invariant did not hold (children's logs in %s)", res.WorkDir)
	}
	switch {
	case res.Messages < int64(messages):
		t.Errorf("%d messages went through the chain, want at least %d", res.Messages, messages)
	case res.Relays < 2:
		t.Errorf("%d relay processes: want several sharing the partitions", res.Relays)
	case res.RelayKills == 0 || res.RelayFaultKills == 0:
		t.Errorf("relay kills: %d at random, %d between publish and settle; want both", res.RelayKills, res.RelayFaultKills)
	case res.ShortFreezes == 0 || res.LongFreezes == 0 || res.Fences == 0:
		t.Errorf("relay freezes: %d shorter than the lease interval, %d past the fence delay, %d frozen relays' partitions taken over; want each",
			res.ShortFreezes, res.LongFreezes, res.Fences)
	case res.ConsumerKills == 0 || res.ConsumerFaultKills == 0:
		t.Errorf("consumer kills: %d at random, %d between commit and ack; want both", res.ConsumerKills, res.ConsumerFaultKills)
	case !cluster && res.NATSRestarts == 0:
		t.Error("NATS was never restarted")
	case cluster && (res.LeaderKills == 0 || res.StepDowns == 0):
		t.Errorf("stream leader kills %d, step-downs %d: want both", res.LeaderKills, res.StepDowns)
	case res.RelayBackendsTerminated == 0 || res.ConsumerBackendsTerminated == 0:
		t.Errorf("backends terminated: %d of the relay, %d of the consumer; want both", res.RelayBackendsTerminated, res.ConsumerBackendsTerminated)
	case res.Tally.Poisoned == 0 || res.Tally.RolledBackOrders == 0 || res.Tally.HalfCommittedByCheckback == 0 || res.Tally.HalfRolledBackByCheckback == 0:
		t.Errorf("poisoned %d, rolled back %d, check-back commits %d and rollbacks %d: want each", res.Tally.Poisoned,
			res.Tally.RolledBackOrders, res.Tally.HalfCommittedByCheckback, res.Tally.HalfRolledBackByCheckback)
	}
}

// The fence count reads the fenced relay's id from the relay's log line, which starts with the
// fencing relay's own.
func TestChaosRelayLineCountsFences(t *testing.T) {
	c := &chaos{}
	c.frozenIDs.Store("chaos-relay-2-3", true)
	c.relayLine(1, `time=2026-12-03T19:16:21.584Z level=WARN msg="ended the lease session of a relay that stopped heartbeating; its partitions are free" `+
		`component=relay relay_id=chaos-relay-3-1 relay_id=chaos-relay-2-3 backend_pid=15110 partitions=2 silent_for=2.992s`)
	c.relayLine(1, `time=2026-12-03T19:16:21.584Z level=WARN msg="ended the lease session of a relay that stopped heartbeating; its partitions are free" `+
		`component=relay relay_id=chaos-relay-2-3 relay_id=chaos-relay-1-1 backend_pid=15111 partitions=2 silent_for=2.992s`)
	c.relayLine(1, `time=2026-12-03T19:16:22Z level=WARN msg="this relay's partition lease ended before it could publish its whole batch (a pause, or partitions released or lost): `+
		`the rest is left to the relay that holds the partitions now" component=relay relay_id=chaos-relay-2-3 withheld=3 published=1`)
	if c.fences.Load() != 1 || c.otherFences.Load() != 1 || c.withheld.Load() != 1 {
		t.Errorf("fences of frozen relays %d, of others %d, withheld batches %d; want 1, 1, 1", c.fences.Load(), c.otherFences.Load(), c.withheld.Load())
	}
}

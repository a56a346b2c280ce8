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

// The chaos proof: messages from producers in this process go through the outbox, the real
// relay binary and JetStream to a consumer process while both processes are SIGKILLed at
// random and at their fault points, NATS restarts and their PostgreSQL backends are
// terminated. Every invariant must hold, and every kind of fault must have happened.
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
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	res, err := RunChaos(context.Background(), ChaosConfig{
		DSN:         testsvc.PostgresDSN(t),
		Messages:    messages,
		RelayBin:    relayBinary(t),
		ConsumerExe: exe,
		ConsumerEnv: []string{childEnvVar + "=1"},
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
	case res.RelayKills == 0 || res.RelayFaultKills == 0:
		t.Errorf("relay kills: %d at random, %d between publish and settle; want both", res.RelayKills, res.RelayFaultKills)
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

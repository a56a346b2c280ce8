package testsvc

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/txoutbox/txoutbox/internal/embedded"
)

// Cluster is a three-node JetStream cluster on loopback for one test (see embedded.Cluster),
// with a connection to every node and a JetStream context.
type Cluster struct {
	*embedded.Cluster
	Conn *nats.Conn
	JS   jetstream.JetStream
}

// JetStreamCluster starts a three-node JetStream cluster for the test (random ports, stores
// under the test's temporary directory) and shuts it down when the test ends.
func JetStreamCluster(tb testing.TB) *Cluster {
	tb.Helper()
	c, err := embedded.StartCluster(embedded.ClusterOptions{StoreDir: tb.TempDir()})
	if err != nil {
		tb.Fatalf("testsvc: %v", err)
	}
	tb.Cleanup(c.Shutdown)
	nc, err := Connect(c.URLs())
	if err != nil {
		tb.Fatalf("testsvc: connect to the nats cluster: %v", err)
	}
	tb.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		tb.Fatalf("testsvc: jetstream: %v", err)
	}
	return &Cluster{Cluster: c, Conn: nc, JS: js}
}

// Stream creates a file-storage stream with three replicas and a two-minute duplicate window,
// and waits until it has a leader.
func (c *Cluster) Stream(tb testing.TB, name string, subjects ...string) jetstream.Stream {
	tb.Helper()
	var s jetstream.Stream
	var err error
	// Right after start the meta leader may still be settling; ask again for a moment.
	for deadline := time.Now().Add(60 * time.Second); ; {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		s, err = c.JS.CreateStream(ctx, jetstream.StreamConfig{
			Name:       name,
			Subjects:   subjects,
			Storage:    jetstream.FileStorage,
			Replicas:   3,
			Duplicates: 2 * time.Minute,
		})
		cancel()
		if err == nil || time.Now().After(deadline) {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	if err != nil {
		tb.Fatalf("testsvc: create stream %s: %v", name, err)
	}
	if _, err := c.WaitStreamLeader(name, nil, 30*time.Second); err != nil {
		tb.Fatalf("testsvc: %v", err)
	}
	return s
}

// KillLeader kills the node leading stream (see embedded.ClusterNode.Kill: it hands nothing
// over) and returns it; the stream has no leader until the other replicas elect one, after
// an election timeout.
func (c *Cluster) KillLeader(tb testing.TB, stream string) *embedded.ClusterNode {
	tb.Helper()
	l, err := c.WaitStreamLeader(stream, nil, 30*time.Second)
	if err != nil {
		tb.Fatalf("testsvc: %v", err)
	}
	l.Kill()
	return l
}

// Restart starts a stopped node again and waits until stream is current on every node.
func (c *Cluster) Restart(tb testing.TB, n *embedded.ClusterNode, stream string) {
	tb.Helper()
	if err := n.Start(); err != nil {
		tb.Fatalf("testsvc: %v", err)
	}
	if err := c.WaitStreamCurrent(stream, 60*time.Second); err != nil {
		tb.Fatalf("testsvc: %v", err)
	}
}

// StepDown asks the leader of stream to step down and returns the node that led it.
func (c *Cluster) StepDown(tb testing.TB, stream string) *embedded.ClusterNode {
	tb.Helper()
	l, err := c.WaitStreamLeader(stream, nil, 30*time.Second)
	if err != nil {
		tb.Fatalf("testsvc: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := embedded.StepDown(ctx, c.Conn, stream); err != nil {
		tb.Fatalf("testsvc: %v", err)
	}
	return l
}

// StartForQuorum starts node again, after two of the three nodes went down (the stream has no
// quorum until one is back), and waits until stream has a leader. Rarely (about once in 30
// runs of the suite on a loaded 2-core machine) the two nodes up elect no leader for a minute
// or more: then, after wait, the state of every node is logged and the nodes still down are
// started too, since what the callers test is what their component does once the stream is
// back, not how nats-server gets it back.
func (c *Cluster) StartForQuorum(tb testing.TB, stream string, node *embedded.ClusterNode, wait time.Duration) {
	tb.Helper()
	if err := node.Start(); err != nil {
		tb.Fatalf("testsvc: start %s: %v", node.Name, err)
	}
	if _, err := c.WaitStreamLeader(stream, nil, wait); err == nil {
		return
	}
	tb.Logf("testsvc: no leader for %s %s after %s was started again: %s; starting the other nodes too", stream, wait, node.Name, c.Describe(stream))
	for _, n := range c.Nodes {
		if !n.Running() {
			if err := n.Start(); err != nil {
				tb.Fatalf("testsvc: start %s: %v", n.Name, err)
			}
		}
	}
	if _, err := c.WaitStreamLeader(stream, nil, 60*time.Second); err != nil {
		tb.Fatalf("testsvc: %v, with every node up: %s", err, c.Describe(stream))
	}
}

package embedded

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
)

// Cluster is a JetStream cluster of in-process nats-servers on 127.0.0.1 (three nodes by
// default), for tests that claim cluster behaviour: stream leader elections, a node killed
// and restarted, a leader asked to step down. Each node has its own client and route ports
// (chosen free at start, kept across restarts) and its own store directory.
//
// Every route between two nodes goes through a TCP relay of the cluster's own, so that a
// node can be killed: its routes are cut before it is shut down. An in-process server that is
// merely shut down hands its raft leaderships over first (nats-server steps down every leader
// at shutdown), so its peers elect a new stream leader at once; a killed node's peers, like
// those of a process killed with SIGKILL, hear nothing more and elect one only after an
// election timeout (4–9 s in nats-server).
//
// Every node carries two kinds of server tags for stream placement: "node:<name>" (only that
// node) and "not:<name>" for every other node's name (every node but that one). A test that
// must know where a stream's replicas live places it with them: Placement{Tags:
// []string{"node:n0"}} puts an R1 stream on n0, Placement{Tags: []string{"not:n0"}} an R2
// stream on the two other nodes of three.
type Cluster struct {
	// Name is the cluster name the nodes share.
	Name string
	// Nodes are the cluster's servers, in start order.
	Nodes []*ClusterNode

	root    string
	ownRoot bool
	proxies []*routeProxy
}

// ClusterNode is one server of a Cluster.
type ClusterNode struct {
	// Name is the server name (n0, n1, ...), as JetStream reports it in stream cluster info.
	Name string
	// Port is the client port; ClusterPort the route port. Both fixed for the node's life.
	Port, ClusterPort int
	// StoreDir is the node's JetStream store, kept across Stop and Start.
	StoreDir string

	mu      sync.Mutex
	srv     *server.Server
	opts    server.Options
	proxies []*routeProxy // every route from or to this node
	killed  bool          // its routes are cut
}

// ClusterOptions configures StartCluster.
type ClusterOptions struct {
	// Size is the number of nodes. Defaults to 3.
	Size int
	// StoreDir is the directory under which each node keeps its store (one subdirectory per
	// node). Defaults to a new temporary directory, removed by Shutdown.
	StoreDir string
	// Name is the cluster name. Defaults to "txoutbox-test".
	Name string
}

// StartCluster starts a JetStream cluster on 127.0.0.1 and waits until it has a meta leader
// (JetStream answers API requests).
func StartCluster(opts ClusterOptions) (*Cluster, error) {
	if opts.Size == 0 {
		opts.Size = 3
	}
	if opts.Name == "" {
		opts.Name = "txoutbox-test"
	}
	c := &Cluster{Name: opts.Name, root: opts.StoreDir}
	if c.root == "" {
		dir, err := os.MkdirTemp("", "txoutbox-nats-cluster-")
		if err != nil {
			return nil, fmt.Errorf("embedded nats cluster: %w", err)
		}
		c.root, c.ownRoot = dir, true
	}
	// The nodes' ports stay reserved (listened on) until the nodes start, so that the route
	// relays, which listen on ports the kernel chooses, cannot be given one of them.
	var reserved []net.Listener
	release := func() {
		for _, l := range reserved {
			_ = l.Close()
		}
		reserved = nil
	}
	defer release()
	reserve := func() (int, error) {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return 0, fmt.Errorf("embedded nats cluster: free port: %w", err)
		}
		reserved = append(reserved, l)
		return l.Addr().(*net.TCPAddr).Port, nil
	}
	for i := 0; i < opts.Size; i++ {
		p, err := reserve()
		if err != nil {
			c.Shutdown()
			return nil, err
		}
		cp, err := reserve()
		if err != nil {
			c.Shutdown()
			return nil, err
		}
		n := &ClusterNode{Name: fmt.Sprintf("n%d", i), Port: p, ClusterPort: cp, StoreDir: filepath.Join(c.root, fmt.Sprintf("n%d", i))}
		c.Nodes = append(c.Nodes, n)
	}
	// A port nobody listens on, advertised as every node's route address: the nodes learn
	// each other's route address from each other (gossip) and would connect directly,
	// around the relays; this way only the relays connect them.
	nowhere, err := reserve()
	if err != nil {
		c.Shutdown()
		return nil, err
	}
	for _, n := range c.Nodes {
		var routes []string
		for _, to := range c.Nodes {
			if to == n {
				continue
			}
			p, err := startRouteProxy(fmt.Sprintf("127.0.0.1:%d", to.ClusterPort))
			if err != nil {
				c.Shutdown()
				return nil, err
			}
			c.proxies = append(c.proxies, p)
			n.proxies = append(n.proxies, p)
			to.proxies = append(to.proxies, p)
			routes = append(routes, "nats-route://"+p.addr())
		}
		tags := jwt.TagList{"node:" + n.Name}
		for _, o := range c.Nodes {
			if o != n {
				tags = append(tags, "not:"+o.Name)
			}
		}
		n.opts = server.Options{
			ServerName:             n.Name,
			Tags:                   tags,
			Host:                   "127.0.0.1",
			Port:                   n.Port,
			JetStream:              true,
			StoreDir:               n.StoreDir,
			NoLog:                  true,
			NoSigs:                 true,
			DisableJetStreamBanner: true,
			Cluster: server.ClusterOpts{Name: c.Name, Host: "127.0.0.1", Port: n.ClusterPort,
				Advertise: fmt.Sprintf("127.0.0.1:%d", nowhere)},
			Routes: server.RoutesFromStr(strings.Join(routes, ",")),
		}
	}
	release()
	// Start every node before waiting for any: a node is ready for connections only once its
	// JetStream has started, which in a cluster needs the routes to its peers.
	errs := make(chan error, len(c.Nodes))
	for _, n := range c.Nodes {
		go func() { errs <- n.start() }()
	}
	var first error
	for range c.Nodes {
		if err := <-errs; err != nil && first == nil {
			first = err
		}
	}
	if first != nil {
		c.Shutdown()
		return nil, first
	}
	if err := c.WaitRoutes(30 * time.Second); err != nil {
		c.Shutdown()
		return nil, err
	}
	if err := c.WaitMetaLeader(30 * time.Second); err != nil {
		c.Shutdown()
		return nil, err
	}
	return c, nil
}

// WaitRoutes waits until every running node has a route to every other running node.
func (c *Cluster) WaitRoutes(timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		running := 0
		for _, n := range c.Nodes {
			if n.Running() {
				running++
			}
		}
		ok := true
		for _, n := range c.Nodes {
			if s := n.Server(); s != nil && s.NumRemotes() < running-1 {
				ok = false
			}
		}
		if ok {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("embedded nats cluster: nodes not all routed to each other within %s", timeout)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func (n *ClusterNode) start() error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.srv != nil {
		return nil
	}
	var lastErr error
	// The ports may be briefly unavailable right after a stop; retry a little.
	for i := 0; i < 3; i++ {
		o := n.opts // NewServer keeps and edits the options it is given
		o.Routes = append([]*url.URL(nil), n.opts.Routes...)
		srv, err := server.NewServer(&o)
		if err != nil {
			return fmt.Errorf("embedded nats cluster: node %s: %w", n.Name, err)
		}
		go srv.Start()
		if srv.ReadyForConnections(20 * time.Second) {
			n.srv = srv
			return nil
		}
		srv.Shutdown()
		srv.WaitForShutdown()
		lastErr = fmt.Errorf("embedded nats cluster: node %s not ready for connections within 20s", n.Name)
		time.Sleep(100 * time.Millisecond)
	}
	return lastErr
}

// URL is the node's client URL.
func (n *ClusterNode) URL() string { return fmt.Sprintf("nats://127.0.0.1:%d", n.Port) }

// Server returns the node's running server (nil while it is stopped).
func (n *ClusterNode) Server() *server.Server {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.srv
}

// Running reports whether the node is up.
func (n *ClusterNode) Running() bool { return n.Server() != nil }

// Kill stops the node as SIGKILL would, as far as its peers can tell: its routes are cut
// first, so the leaderships it hands over while it shuts down reach nobody, and its peers
// elect new leaders only after an election timeout. The store is kept.
func (n *ClusterNode) Kill() {
	n.mu.Lock()
	if !n.killed {
		n.killed = true
		for _, p := range n.proxies {
			p.cut()
		}
	}
	n.mu.Unlock()
	n.Stop()
}

// Stop shuts the node down gracefully (nats-server steps its raft leaderships down first, so
// its streams get new leaders at once) and keeps its store.
func (n *ClusterNode) Stop() {
	n.mu.Lock()
	srv := n.srv
	n.srv = nil
	n.mu.Unlock()
	if srv != nil {
		srv.Shutdown()
		srv.WaitForShutdown()
	}
}

// Start starts a stopped (or killed) node again, on the same ports and store.
func (n *ClusterNode) Start() error {
	n.mu.Lock()
	if n.killed {
		n.killed = false
		for _, p := range n.proxies {
			p.restore()
		}
	}
	n.mu.Unlock()
	return n.start()
}

// URLs is the comma-separated list of the nodes' client URLs, the form nats.Connect takes.
func (c *Cluster) URLs() string {
	urls := make([]string, len(c.Nodes))
	for i, n := range c.Nodes {
		urls[i] = n.URL()
	}
	return strings.Join(urls, ",")
}

// Node returns the node named name (nil if none is).
func (c *Cluster) Node(name string) *ClusterNode {
	for _, n := range c.Nodes {
		if n.Name == name {
			return n
		}
	}
	return nil
}

// Describe says, for diagnostics, each node's state: running or not (killed: its routes cut),
// routes, whether it is the JetStream meta leader, and, for each stream named, whether it
// leads the stream and is current with its leader.
func (c *Cluster) Describe(streams ...string) string {
	var b strings.Builder
	for _, n := range c.Nodes {
		n.mu.Lock()
		killed := n.killed
		n.mu.Unlock()
		s := n.Server()
		if s == nil {
			fmt.Fprintf(&b, "%s: down (killed %v); ", n.Name, killed)
			continue
		}
		fmt.Fprintf(&b, "%s: up, routes %d, meta leader %v", n.Name, s.NumRemotes(), s.JetStreamIsLeader())
		for _, st := range streams {
			fmt.Fprintf(&b, ", %s leader %v current %v", st, s.JetStreamIsStreamLeader(GlobalAccount, st), s.JetStreamIsStreamCurrent(GlobalAccount, st))
		}
		b.WriteString("; ")
	}
	return strings.TrimSuffix(b.String(), "; ")
}

// WaitMetaLeader waits until a running node is the JetStream meta leader.
func (c *Cluster) WaitMetaLeader(timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		for _, n := range c.Nodes {
			if s := n.Server(); s != nil && s.JetStreamIsLeader() {
				return nil
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("embedded nats cluster: no JetStream meta leader within %s", timeout)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// GlobalAccount is the account of clients of a server without accounts configured.
const GlobalAccount = server.DEFAULT_GLOBAL_ACCOUNT

// StreamLeader returns the running node that leads stream (of the global account), or nil
// while the stream has no leader.
func (c *Cluster) StreamLeader(stream string) *ClusterNode {
	for _, n := range c.Nodes {
		if s := n.Server(); s != nil && s.JetStreamIsStreamLeader(GlobalAccount, stream) {
			return n
		}
	}
	return nil
}

// WaitStreamLeader waits until stream has a leader, and, when not is non-nil, one other
// than not; it returns the leader.
func (c *Cluster) WaitStreamLeader(stream string, not *ClusterNode, timeout time.Duration) (*ClusterNode, error) {
	deadline := time.Now().Add(timeout)
	for {
		if l := c.StreamLeader(stream); l != nil && l != not {
			return l, nil
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("embedded nats cluster: stream %q has no leader within %s", stream, timeout)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// WaitStreamCurrent waits until every running node that hosts stream is current with its
// leader (a restarted node has caught up).
func (c *Cluster) WaitStreamCurrent(stream string, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		ok := c.StreamLeader(stream) != nil
		for _, n := range c.Nodes {
			if s := n.Server(); ok && s != nil && s.JetStreamIsStreamAssigned(GlobalAccount, stream) &&
				!s.JetStreamIsStreamCurrent(GlobalAccount, stream) {
				ok = false
			}
		}
		if ok {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("embedded nats cluster: stream %q not current on every node within %s", stream, timeout)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// ErrStepDown is returned when JetStream refuses a leader step-down.
var ErrStepDown = errors.New("embedded nats cluster: stream leader step-down refused")

// StepDown asks the leader of stream to step down, through JetStream's API
// ($JS.API.STREAM.LEADER.STEPDOWN.<stream>) on nc. The stream is leaderless until another
// replica wins the election that follows.
func StepDown(ctx context.Context, nc *nats.Conn, stream string) error {
	msg, err := nc.RequestWithContext(ctx, fmt.Sprintf(server.JSApiStreamLeaderStepDownT, stream), nil)
	if err != nil {
		return fmt.Errorf("embedded nats cluster: step down %q: %w", stream, err)
	}
	var resp server.JSApiStreamLeaderStepDownResponse
	if err := json.Unmarshal(msg.Data, &resp); err != nil {
		return fmt.Errorf("embedded nats cluster: step down %q: %w", stream, err)
	}
	if resp.Error != nil || !resp.Success {
		return fmt.Errorf("%w: %q: %v", ErrStepDown, stream, resp.Error)
	}
	return nil
}

// Shutdown stops every node and removes the store directory StartCluster created.
func (c *Cluster) Shutdown() {
	var wg sync.WaitGroup
	for _, n := range c.Nodes {
		wg.Add(1)
		go func() { defer wg.Done(); n.Stop() }()
	}
	wg.Wait()
	for _, p := range c.proxies {
		p.close()
	}
	if c.ownRoot {
		_ = os.RemoveAll(c.root)
	}
}

// routeProxy relays the route connections one node makes to another.
type routeProxy struct {
	ln     net.Listener
	target string

	mu    sync.Mutex
	isCut bool
	conns map[net.Conn]bool
	ends  int // how many of its two nodes are killed
}

func startRouteProxy(target string) (*routeProxy, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("embedded nats cluster: route relay: %w", err)
	}
	p := &routeProxy{ln: ln, target: target, conns: map[net.Conn]bool{}}
	go p.serve()
	return p, nil
}

func (p *routeProxy) addr() string { return p.ln.Addr().String() }

func (p *routeProxy) serve() {
	for {
		in, err := p.ln.Accept()
		if err != nil {
			return
		}
		p.mu.Lock()
		cut := p.isCut
		p.mu.Unlock()
		if cut {
			_ = in.Close()
			continue
		}
		out, err := net.DialTimeout("tcp", p.target, 2*time.Second)
		if err != nil {
			_ = in.Close()
			continue
		}
		p.mu.Lock()
		if p.isCut {
			p.mu.Unlock()
			_ = in.Close()
			_ = out.Close()
			continue
		}
		p.conns[in], p.conns[out] = true, true
		p.mu.Unlock()
		pipe := func(dst, src net.Conn) {
			_, _ = io.Copy(dst, src)
			_ = dst.Close()
			_ = src.Close()
			p.mu.Lock()
			delete(p.conns, dst)
			delete(p.conns, src)
			p.mu.Unlock()
		}
		go pipe(out, in)
		go pipe(in, out)
	}
}

// cut closes the relayed connections and refuses new ones until restore.
func (p *routeProxy) cut() {
	p.mu.Lock()
	p.isCut = true
	p.ends++
	for c := range p.conns {
		_ = c.Close()
	}
	p.mu.Unlock()
}

// restore lets connections through again once neither of its nodes is killed.
func (p *routeProxy) restore() {
	p.mu.Lock()
	if p.ends > 0 {
		p.ends--
	}
	p.isCut = p.ends > 0
	p.mu.Unlock()
}

func (p *routeProxy) close() {
	_ = p.ln.Close()
	p.mu.Lock()
	p.isCut = true
	for c := range p.conns {
		_ = c.Close()
	}
	p.mu.Unlock()
}

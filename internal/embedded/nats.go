// Package embedded starts the services txoutbox needs when the machine does not run them: an
// in-process NATS server with JetStream (nats-server/v2 as a library) and a throwaway
// PostgreSQL cluster built from the local PostgreSQL binaries. It serves the tests, the demo
// and `relay run --embedded` for local development; production never uses it silently.
package embedded

import (
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"os"
	"time"

	"github.com/nats-io/nats-server/v2/server"
)

// NATS is an in-process nats-server with JetStream enabled.
type NATS struct {
	// StoreDir is the JetStream store directory. Removed by Shutdown when the server created it.
	StoreDir string
	// Port is the client port, fixed for the server's life so that Restart keeps its URL.
	Port int

	srv      *server.Server
	ownStore bool
	user     string
	password string
	opts     NATSOptions
}

// NATSOptions configures StartNATS.
type NATSOptions struct {
	// StoreDir is where JetStream stores streams. Defaults to a new temporary directory.
	StoreDir string
	// Port is the client port. Defaults to a free port chosen at start.
	Port int
	// Username and Password, when set, are the only credentials the server accepts.
	Username, Password string
	// NKeys, when set, are the public keys (U...) of the NKey users the server accepts (with
	// Username and Password, if set too).
	NKeys []string
	// TLS, when set, makes the server accept TLS connections only, with this configuration;
	// ClientAuth tls.RequireAndVerifyClientCert (and ClientCAs) make it verify client
	// certificates. Defaults to no TLS.
	TLS *tls.Config
	// TLSHandshakeFirst makes the server expect the TLS handshake before its INFO (clients
	// connect with nats.TLSHandshakeFirst). Needs TLS.
	TLSHandshakeFirst bool
	// Token, when set, is the authentication token the server wants.
	Token string
	// Configure, when set, changes the server's options last (operator mode, accounts, ...).
	Configure func(*server.Options)
}

// StartNATS starts a JetStream-enabled nats-server on 127.0.0.1.
func StartNATS(opts NATSOptions) (*NATS, error) {
	n := &NATS{StoreDir: opts.StoreDir, Port: opts.Port, user: opts.Username, password: opts.Password, opts: opts}
	if n.StoreDir == "" {
		dir, err := os.MkdirTemp("", "txoutbox-nats-")
		if err != nil {
			return nil, fmt.Errorf("embedded nats: %w", err)
		}
		n.StoreDir, n.ownStore = dir, true
	}
	if n.Port == 0 {
		p, err := FreePort()
		if err != nil {
			return nil, err
		}
		n.Port = p
	}
	if err := n.start(); err != nil {
		if n.ownStore {
			_ = os.RemoveAll(n.StoreDir)
		}
		return nil, err
	}
	return n, nil
}

func (n *NATS) start() error {
	var lastErr error
	// The port may be briefly unavailable right after a restart; retry a little.
	for i := 0; i < 50; i++ {
		so := &server.Options{
			ServerName:             "txoutbox-embedded",
			Host:                   "127.0.0.1",
			Port:                   n.Port,
			JetStream:              true,
			StoreDir:               n.StoreDir,
			NoLog:                  true,
			NoSigs:                 true,
			DisableJetStreamBanner: true,
			Username:               n.user,
			Password:               n.password,
		}
		for _, k := range n.opts.NKeys {
			so.Nkeys = append(so.Nkeys, &server.NkeyUser{Nkey: k})
		}
		if n.opts.TLS != nil {
			so.TLS = true
			so.TLSConfig = n.opts.TLS.Clone()
			so.TLSVerify = n.opts.TLS.ClientAuth == tls.RequireAndVerifyClientCert
			so.TLSHandshakeFirst = n.opts.TLSHandshakeFirst
			so.TLSTimeout = 2
		}
		so.Authorization = n.opts.Token
		if n.opts.Configure != nil {
			n.opts.Configure(so)
		}
		srv, err := server.NewServer(so)
		if err != nil {
			return fmt.Errorf("embedded nats: %w", err)
		}
		go srv.Start()
		if srv.ReadyForConnections(10 * time.Second) {
			n.srv = srv
			return nil
		}
		srv.Shutdown()
		srv.WaitForShutdown()
		lastErr = errors.New("embedded nats: server not ready for connections within 10s")
		time.Sleep(100 * time.Millisecond)
	}
	return lastErr
}

// URL is the client URL, nats://127.0.0.1:<port>.
func (n *NATS) URL() string { return fmt.Sprintf("nats://127.0.0.1:%d", n.Port) }

// Server returns the running server (nil while stopped).
func (n *NATS) Server() *server.Server { return n.srv }

// Stop shuts the server down but keeps its store, so Start brings back the same streams.
func (n *NATS) Stop() {
	if n.srv != nil {
		n.srv.Shutdown()
		n.srv.WaitForShutdown()
		n.srv = nil
	}
}

// Start starts a stopped server again on the same port and store.
func (n *NATS) Start() error {
	if n.srv != nil {
		return nil
	}
	return n.start()
}

// Shutdown stops the server and removes the store directory it created.
func (n *NATS) Shutdown() {
	n.Stop()
	if n.ownStore {
		_ = os.RemoveAll(n.StoreDir)
	}
}

// FreePort asks the kernel for a free TCP port on 127.0.0.1.
func FreePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("free port: %w", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

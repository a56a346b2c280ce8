package testsvc

import (
	"bufio"
	"bytes"
	"encoding/json"
	"io"
	"net"
	"strings"
	"sync"
	"testing"
)

// VersionProxy is a TCP proxy in front of a real nats-server that rewrites the version the
// server announces in its INFO, so that clients see an older (or newer) server. Everything else
// passes through unchanged: the server is real, only its version is not. nats-server has no
// option to announce another version.
//
// It returns a nats:// URL; the proxy stops when the test ends.
func VersionProxy(tb testing.TB, natsURL, version string) string {
	tb.Helper()
	upstream := strings.TrimPrefix(natsURL, "nats://")
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatalf("testsvc: version proxy: %v", err)
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	var conns []net.Conn
	track := func(c net.Conn) bool {
		mu.Lock()
		defer mu.Unlock()
		if conns == nil {
			return false // closed
		}
		conns = append(conns, c)
		return true
	}
	conns = []net.Conn{}
	tb.Cleanup(func() {
		_ = ln.Close()
		mu.Lock()
		for _, c := range conns {
			_ = c.Close()
		}
		conns = nil
		mu.Unlock()
		wg.Wait()
	})
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			client, err := ln.Accept()
			if err != nil {
				return
			}
			server, err := net.Dial("tcp", upstream)
			if err != nil {
				_ = client.Close()
				continue
			}
			if !track(client) || !track(server) {
				_ = client.Close()
				_ = server.Close()
				return
			}
			wg.Add(2)
			go func() {
				defer wg.Done()
				defer client.Close()
				_, _ = io.Copy(server, client)
			}()
			go func() {
				defer wg.Done()
				defer server.Close()
				rewriteInfo(client, server, version)
			}()
		}
	}()
	return "nats://" + ln.Addr().String()
}

// rewriteInfo copies server to client, rewriting "version" in every INFO line.
func rewriteInfo(client io.Writer, server io.Reader, version string) {
	r := bufio.NewReaderSize(server, 64*1024)
	for {
		line, err := r.ReadBytes('\n')
		if len(line) > 0 {
			if bytes.HasPrefix(line, []byte("INFO ")) {
				var info map[string]any
				if json.Unmarshal(bytes.TrimSpace(line[5:]), &info) == nil {
					info["version"] = version
					if b, err := json.Marshal(info); err == nil {
						line = append(append([]byte("INFO "), b...), '\r', '\n')
					}
				}
			}
			if _, werr := client.Write(line); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

package demo

import (
	"bufio"
	"bytes"
	"io"
	"math/rand/v2"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
)

// ackLoss is a TCP proxy between a NATS client and its server that loses JetStream publish
// acknowledgements on the way back to the client, as a flaky network or a server that fails
// over after storing a message would. The client's publish is stored, but the client never
// hears so: its publish times out, and it publishes again. Everything else passes untouched.
type ackLoss struct {
	target string
	prob   float64
	ln     net.Listener

	dropped atomic.Int64
	wg      sync.WaitGroup
	mu      sync.Mutex
	conns   map[net.Conn]struct{}
	closed  bool
}

// newAckLoss listens on a free port of 127.0.0.1 and forwards to target (host:port), losing
// each PubAck with probability prob.
func newAckLoss(target string, prob float64) (*ackLoss, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	p := &ackLoss{target: target, prob: prob, ln: ln, conns: map[net.Conn]struct{}{}}
	p.wg.Add(1)
	go p.accept()
	return p, nil
}

// URL is the proxy's NATS URL.
func (p *ackLoss) URL() string { return "nats://" + p.ln.Addr().String() }

// Dropped counts the PubAcks lost so far.
func (p *ackLoss) Dropped() int64 { return p.dropped.Load() }

// Close stops the proxy and closes every connection through it.
func (p *ackLoss) Close() {
	p.mu.Lock()
	p.closed = true
	for c := range p.conns {
		_ = c.Close()
	}
	p.mu.Unlock()
	_ = p.ln.Close()
	p.wg.Wait()
}

func (p *ackLoss) track(cs ...net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		for _, c := range cs {
			_ = c.Close()
		}
		return false
	}
	for _, c := range cs {
		p.conns[c] = struct{}{}
	}
	return true
}

func (p *ackLoss) untrack(cs ...net.Conn) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range cs {
		_ = c.Close()
		delete(p.conns, c)
	}
}

func (p *ackLoss) accept() {
	defer p.wg.Done()
	for {
		client, err := p.ln.Accept()
		if err != nil {
			return
		}
		server, err := net.Dial("tcp", p.target)
		if err != nil {
			_ = client.Close()
			continue
		}
		if !p.track(client, server) {
			return
		}
		p.wg.Add(2)
		go func() {
			defer p.wg.Done()
			_, _ = io.Copy(server, client)
			p.untrack(client, server)
		}()
		go func() {
			defer p.wg.Done()
			_ = p.filter(client, server)
			p.untrack(client, server)
		}()
	}
}

// filter copies the server's protocol stream to the client, leaving out some PubAcks. A
// PubAck is a MSG (no headers) whose payload is the JSON {"stream":...,"seq":...}; API replies
// carry a "type" field and are never dropped.
func (p *ackLoss) filter(client io.Writer, server io.Reader) error {
	r := bufio.NewReaderSize(server, 64<<10)
	w := bufio.NewWriterSize(client, 64<<10)
	for {
		line, err := r.ReadBytes('\n')
		if err != nil {
			return err
		}
		size := -1
		switch {
		case bytes.HasPrefix(line, []byte("MSG ")), bytes.HasPrefix(line, []byte("HMSG ")):
			f := bytes.Fields(line)
			if n, err := strconv.Atoi(string(f[len(f)-1])); err == nil {
				size = n
			}
		}
		if size < 0 {
			if _, err := w.Write(line); err != nil {
				return err
			}
		} else {
			body := make([]byte, size+2) // payload and its CRLF
			if _, err := io.ReadFull(r, body); err != nil {
				return err
			}
			if bytes.HasPrefix(line, []byte("MSG ")) && isPubAck(body) && rand.Float64() < p.prob {
				p.dropped.Add(1)
			} else {
				if _, err := w.Write(line); err != nil {
					return err
				}
				if _, err := w.Write(body); err != nil {
					return err
				}
			}
		}
		if r.Buffered() == 0 {
			if err := w.Flush(); err != nil {
				return err
			}
		}
	}
}

func isPubAck(body []byte) bool {
	return bytes.HasPrefix(body, []byte(`{"stream":`)) && bytes.Contains(body, []byte(`"seq":`)) &&
		!bytes.Contains(body, []byte(`"type":`)) && !bytes.Contains(body, []byte(`"error":`))
}

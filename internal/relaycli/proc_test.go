package relaycli

import (
	"bufio"
	"encoding/json"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/txoutbox/txoutbox/internal/testsvc"
)

// relayBinary is the real relay command, built once per test binary.
func relayBinary(t *testing.T) string { return testsvc.RelayBinary(t) }

// logLine is one JSON log line of a relay process, with the time the test read it.
type logLine struct {
	Read   time.Time
	Fields map[string]any
}

func (l logLine) msg() string { s, _ := l.Fields["msg"].(string); return s }

// proc is a relay process started by the test.
type proc struct {
	name string
	cmd  *exec.Cmd
	done chan struct{}
	err  error

	mu   sync.Mutex
	logs []logLine
	raw  strings.Builder
}

// startRelay runs the relay binary with args (JSON logs on stderr are collected).
func startRelay(t *testing.T, name string, args ...string) *proc {
	t.Helper()
	return startRelayEnv(t, name, nil, args...)
}

// startRelayEnv is startRelay with env (KEY=value) added to the environment.
func startRelayEnv(t *testing.T, name string, env []string, args ...string) *proc {
	t.Helper()
	p := &proc{name: name, cmd: exec.Command(relayBinary(t), args...), done: make(chan struct{})}
	p.cmd.Env = append(append(os.Environ(), "DATABASE_URL=", "NATS_URL="), env...)
	stderr, err := p.cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	p.cmd.Stdout = io.Discard
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	var reading sync.WaitGroup
	reading.Add(1)
	go func() {
		defer reading.Done()
		sc := bufio.NewScanner(stderr)
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		for sc.Scan() {
			line := sc.Text()
			l := logLine{Read: time.Now()}
			_ = json.Unmarshal([]byte(line), &l.Fields)
			p.mu.Lock()
			p.raw.WriteString(line + "\n")
			if l.Fields != nil {
				p.logs = append(p.logs, l)
			}
			p.mu.Unlock()
		}
	}()
	go func() {
		reading.Wait()
		p.err = p.cmd.Wait()
		close(p.done)
	}()
	t.Cleanup(func() {
		select {
		case <-p.done:
		default:
			_ = p.cmd.Process.Kill()
			<-p.done
		}
		if t.Failed() {
			t.Logf("%s log:\n%s", p.name, p.output())
		}
	})
	return p
}

func (p *proc) output() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.raw.String()
}

// find returns the log lines whose msg is msg.
func (p *proc) find(msg string) []logLine {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []logLine
	for _, l := range p.logs {
		if l.msg() == msg {
			out = append(out, l)
		}
	}
	return out
}

// waitLog waits for a log line with msg.
func (p *proc) waitLog(t *testing.T, msg string, timeout time.Duration) logLine {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		if ls := p.find(msg); len(ls) > 0 {
			return ls[0]
		}
		select {
		case <-p.done:
			t.Fatalf("%s exited (%v) before logging %q:\n%s", p.name, p.err, msg, p.output())
		case <-time.After(20 * time.Millisecond):
		}
	}
	t.Fatalf("%s did not log %q within %s:\n%s", p.name, msg, timeout, p.output())
	return logLine{}
}

// signal sends sig and, for SIGTERM, waits for the exit and returns its status.
func (p *proc) stop(t *testing.T, sig syscall.Signal) int {
	t.Helper()
	if err := p.cmd.Process.Signal(sig); err != nil {
		t.Fatal(err)
	}
	select {
	case <-p.done:
	case <-time.After(30 * time.Second):
		t.Fatalf("%s did not exit after %v", p.name, sig)
	}
	return p.cmd.ProcessState.ExitCode()
}

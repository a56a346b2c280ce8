package demo

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/txoutbox/txoutbox/internal/fault"
)

// proc supervises one child process role (a relay, the consumer): it starts it, restarts it
// whenever it exits, kills it on demand with SIGKILL, freezes it on demand with SIGSTOP (and
// resumes it with SIGCONT), and tells the deaths apart: killed by us, killed by its own fault
// point (it writes fault.KillMarker first), or any other exit.
type proc struct {
	name string
	// command builds the command of the n-th incarnation (from 1).
	command func(n int) *exec.Cmd
	log     io.Writer // the children's output, each line prefixed with the incarnation
	// onLine sees each line the child writes to stdout, onErrLine each line to stderr.
	onLine, onErrLine func(n int, line string)
	// onExit runs after each incarnation ends.
	onExit func(n int)

	mu            sync.Mutex
	cmd           *exec.Cmd
	n             int
	killRequested bool
	stopping      bool
	frozen        bool // a freeze is under way (its thaw not called yet)

	starts     atomic.Int64
	kills      atomic.Int64 // SIGKILLed by the orchestrator
	selfKills  atomic.Int64 // killed themselves at a fault point
	otherExits atomic.Int64 // exited on their own (an error after an outage, say)
	pointHits  sync.Map     // fault point -> *atomic.Int64
	lastExit   atomic.Value // string
}

// run keeps the role running until ctx ends or stop is called.
func (p *proc) run(ctx context.Context) {
	for {
		p.mu.Lock()
		if p.stopping || ctx.Err() != nil {
			p.mu.Unlock()
			return
		}
		p.n++
		n := p.n
		cmd := p.command(n)
		setChildAttrs(cmd)
		stdout, _ := cmd.StdoutPipe()
		stderr, _ := cmd.StderrPipe()
		p.killRequested = false
		if err := cmd.Start(); err != nil {
			p.mu.Unlock()
			fmt.Fprintf(p.log, "[%s %d] start: %v\n", p.name, n, err)
			if !sleepCtx(ctx, time.Second) {
				return
			}
			continue
		}
		p.cmd = cmd
		p.mu.Unlock()
		p.starts.Add(1)

		var marker atomic.Value
		var readers sync.WaitGroup
		readers.Add(2)
		go func() {
			defer readers.Done()
			p.scan(n, stdout, nil)
		}()
		go func() {
			defer readers.Done()
			p.scan(n, stderr, func(line string) {
				if i := strings.Index(line, fault.KillMarker); i >= 0 {
					marker.Store(strings.TrimSpace(line[i+len(fault.KillMarker):]))
				}
				if p.onErrLine != nil {
					p.onErrLine(n, line)
				}
			})
		}()
		readers.Wait()
		err := cmd.Wait()

		p.mu.Lock()
		byUs := p.killRequested
		stopping := p.stopping
		p.cmd = nil
		p.mu.Unlock()
		point, _ := marker.Load().(string)
		switch {
		case byUs:
			p.kills.Add(1)
		case point != "":
			p.selfKills.Add(1)
			c, _ := p.pointHits.LoadOrStore(point, new(atomic.Int64))
			c.(*atomic.Int64).Add(1)
		case stopping:
		default:
			p.otherExits.Add(1)
			p.lastExit.Store(fmt.Sprintf("%v", err))
		}
		fmt.Fprintf(p.log, "[%s %d] exited: %v (killed by the orchestrator: %v, fault point: %q)\n", p.name, n, err, byUs, point)
		if p.onExit != nil {
			p.onExit(n)
		}
		if stopping || ctx.Err() != nil {
			return
		}
		// Restart after a short, random pause, as a process supervisor would.
		if !sleepCtx(ctx, time.Duration(50+rand.IntN(250))*time.Millisecond) {
			return
		}
	}
}

func (p *proc) scan(n int, r io.Reader, see func(string)) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if see != nil {
			see(line)
		}
		if p.onLine != nil && see == nil {
			p.onLine(n, line)
		}
		fmt.Fprintf(p.log, "[%s %d] %s\n", p.name, n, line)
	}
	_, _ = io.Copy(io.Discard, r)
}

// kill SIGKILLs the running incarnation; it reports whether one was running.
func (p *proc) kill() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd == nil || p.cmd.Process == nil || p.killRequested {
		return false
	}
	p.killRequested = true
	_ = p.cmd.Process.Kill()
	return true
}

// freeze stops the running incarnation with SIGSTOP. It returns the incarnation's number and
// a function that resumes it with SIGCONT (that process, even when it was killed and another
// incarnation runs by then), or thaw nil when no incarnation runs, a freeze is under way
// already, or the platform has no SIGSTOP. Until thaw is called the proc freezes nothing else.
func (p *proc) freeze() (n int, thaw func()) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if freezeSignal == nil || p.cmd == nil || p.cmd.Process == nil || p.killRequested || p.stopping || p.frozen {
		return 0, nil
	}
	pr := p.cmd.Process
	if pr.Signal(freezeSignal) != nil {
		return 0, nil
	}
	p.frozen = true
	return p.n, func() {
		_ = pr.Signal(thawSignal)
		p.mu.Lock()
		p.frozen = false
		p.mu.Unlock()
	}
}

// isFrozen reports whether a freeze is under way.
func (p *proc) isFrozen() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.frozen
}

// stop asks the running incarnation to stop (SIGTERM; SIGKILL after timeout) and keeps it
// from being restarted.
func (p *proc) stop(timeout time.Duration) {
	p.mu.Lock()
	p.stopping = true
	cmd := p.cmd
	p.mu.Unlock()
	if cmd == nil || cmd.Process == nil {
		return
	}
	_ = terminate(cmd.Process)
	if thawSignal != nil {
		_ = cmd.Process.Signal(thawSignal) // a frozen child would not see the SIGTERM
	}
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		p.mu.Lock()
		running := p.cmd != nil
		p.mu.Unlock()
		if !running {
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
	_ = cmd.Process.Kill()
}

func (p *proc) hits(point string) int64 {
	c, ok := p.pointHits.Load(point)
	if !ok {
		return 0
	}
	return c.(*atomic.Int64).Load()
}

func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

// syncWriter serialises writes to a file shared by several goroutines.
type syncWriter struct {
	mu sync.Mutex
	f  *os.File
}

func (w *syncWriter) Write(b []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.f.Write(b)
}

// terminate asks a process to stop gracefully.
func terminate(p *os.Process) error { return p.Signal(syscall.SIGTERM) }

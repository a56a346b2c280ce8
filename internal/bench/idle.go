package bench

import (
	"context"
	"flag"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/txoutbox/txoutbox/outbox"
)

func init() {
	register(scenario{name: "idle", summary: "the relay's CPU use with nothing to do (relay in a process of its own)", flags: idleFlags})
}

// DefaultIdleDuration is how long the idle relay is measured.
const DefaultIdleDuration = 30 * time.Second

// clockTicks is USER_HZ, the unit of utime and stime in /proc/<pid>/stat: 100 on every Linux
// architecture Go supports (the kernel reports it to user space as a fixed ABI value).
const clockTicks = 100

type idleOpts struct {
	duration, settle time.Duration
}

func idleFlags(fs *flag.FlagSet) func(context.Context, *run) error {
	o := &idleOpts{}
	fs.DurationVar(&o.duration, "duration", DefaultIdleDuration, "how long to measure")
	fs.DurationVar(&o.settle, "settle", 3*time.Second, "wait this long after the relay's last work before measuring (its poll backs off to 1s)")
	return func(ctx context.Context, r *run) error { return idle(ctx, r, o) }
}

func idle(ctx context.Context, r *run, o *idleOpts) error {
	if o.duration <= 0 || o.settle < 0 {
		return usageErr("--duration must be positive and --settle not negative")
	}
	if err := r.start(ctx); err != nil {
		return err
	}
	schema, err := r.NewSchema(ctx)
	if err != nil {
		return err
	}
	const stream, subject, subjects = streamPrefix + "IDLE", "bench.idle.msg", "bench.idle.>"
	s, err := r.ResetStream(ctx, stream, subjects)
	if err != nil {
		return err
	}
	// The relay, default settings, as a process of its own so that only its CPU is counted.
	c, err := r.startChild([]string{relayMode, "--schema", schema, "--subjects", subjects},
		"DATABASE_URL="+r.DSN, "NATS_URL="+r.NATSURL)
	if err != nil {
		return err
	}
	stopped := false
	defer func() {
		if !stopped {
			_ = c.stop(10 * time.Second)
		}
	}()
	line, err := c.readLine(30 * time.Second)
	if err != nil {
		return err
	}
	if !strings.HasPrefix(line, "ready") {
		return fmt.Errorf("relay process said %q", line)
	}
	pid := c.cmd.Process.Pid
	r.logf("relay process %d started (default settings, schema %s)", pid, schema)

	// Prove it works before measuring it doing nothing: 10 messages, doorbell rung.
	set, err := newMsgSet(20, DefaultPayload, 0)
	if err != nil {
		return err
	}
	client, err := outbox.NewClient(&outbox.Config{Schema: schema, Doorbell: outbox.NewNATSDoorbell(r.NC, "")})
	if err != nil {
		return err
	}
	enqueue := func(from, to int) error {
		msgs := make([]outbox.Message, 0, to-from)
		for i := from; i < to; i++ {
			msgs = append(msgs, set.message(i, subject))
		}
		return pgx.BeginFunc(ctx, r.Admin, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, "INSERT INTO "+businessTable(schema)+" (producer, seq, note) VALUES (0, $1, 'idle')", from); err != nil {
				return err
			}
			_, err := client.EnqueueTx(ctx, tx, msgs...)
			return err
		})
	}
	if err := enqueue(0, 10); err != nil {
		return err
	}
	client.Ring()
	if err := waitFor(ctx, 30*time.Second, func() bool { n, _ := streamMsgs(ctx, s); return n >= 10 }); err != nil {
		return fmt.Errorf("%w: the relay process did not publish 10 messages: %v", ErrCheckFailed, err)
	}
	r.logf("relay published the first 10 messages; settling for %s, then measuring for %s", o.settle, o.duration)
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(o.settle):
	}

	cpu0, err := procCPU(pid)
	if err != nil {
		return err
	}
	t0 := time.Now()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(o.duration):
	}
	cpu1, err := procCPU(pid)
	if err != nil {
		return err
	}
	wall := time.Since(t0)
	rss := procRSS(pid)
	cpu := cpu1 - cpu0
	pct := 100 * cpu.Seconds() / wall.Seconds()
	r.logf("relay process used %s of CPU in %s (%.3f%% of one core), RSS %d kB", cpu, wall.Round(time.Millisecond), pct, rss)

	// Still alive after idling: 10 more messages, no doorbell this time (its poll finds them).
	if err := enqueue(10, 20); err != nil {
		return err
	}
	if err := waitFor(ctx, 10*time.Second, func() bool { n, _ := streamMsgs(ctx, s); return n >= 20 }); err != nil {
		r.logf("the relay process did not publish the last 10 messages: %v", err)
	}
	stopped = true
	stopErr := c.stop(30 * time.Second)
	res, err := checkStream(ctx, r.JS, stream, set, nil)
	if err != nil {
		return err
	}
	r.logf("check: %s", res)
	r.result("cpu_pct", pct,
		"cpu_ms", cpu.Milliseconds(),
		"wall_s", wall.Seconds(),
		"rss_kb", rss,
		"lost", res.Lost,
		"duplicates", res.Duplicates,
		"load1", load1())
	switch {
	case stopErr != nil:
		return fmt.Errorf("relay process: %w", stopErr)
	case !res.ok():
		return fmt.Errorf("%w: stream %s: %s", ErrCheckFailed, stream, res)
	}
	return nil
}

// procCPU returns the user+system CPU time a process has used, from /proc/<pid>/stat.
func procCPU(pid int) (time.Duration, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, fmt.Errorf("read the relay's CPU time: %w", err)
	}
	// The command name (field 2) is in parentheses and may contain spaces: parse after it.
	s := string(b)
	end := strings.LastIndexByte(s, ')')
	if end < 0 {
		return 0, fmt.Errorf("unexpected /proc/%d/stat: %q", pid, s)
	}
	f := strings.Fields(s[end+1:])
	// f[0] is field 3 (state); utime and stime are fields 14 and 15.
	if len(f) < 13 {
		return 0, fmt.Errorf("unexpected /proc/%d/stat: %q", pid, s)
	}
	utime, err1 := strconv.ParseInt(f[11], 10, 64)
	stime, err2 := strconv.ParseInt(f[12], 10, 64)
	if err1 != nil || err2 != nil {
		return 0, fmt.Errorf("unexpected /proc/%d/stat: %q", pid, s)
	}
	return time.Duration(utime+stime) * time.Second / clockTicks, nil
}

// procRSS returns a process's resident set size in kB (0 if unknown).
func procRSS(pid int) int64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			n, _ := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			return n
		}
	}
	return 0
}

package testsvc

import (
	"bufio"
	"bytes"
	"encoding/json"
	"log/slog"
	"sync"
	"testing"
)

// LogBuffer is where a test's logger writes, safe for the component's goroutines to write
// while the test reads it back. The zero value is ready to use.
type LogBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

// Write appends p (one log line, as slog writes it).
func (l *LogBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

// String returns everything logged so far.
func (l *LogBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// Logger returns a JSON logger writing every level, debug included, to l.
func (l *LogBuffer) Logger() *slog.Logger { return l.LoggerAt(slog.LevelDebug) }

// LoggerAt returns a JSON logger writing the lines at level and above to l.
func (l *LogBuffer) LoggerAt(level slog.Leveler) *slog.Logger {
	return slog.New(slog.NewJSONHandler(l, &slog.HandlerOptions{Level: level}))
}

// Lines returns the JSON lines logged so far whose msg is msg (every line when msg is empty)
// and that carry each of the attrs, given as key, value pairs of strings ("group", "orders").
// A line that is not JSON fails the test.
func (l *LogBuffer) Lines(tb testing.TB, msg string, attrs ...string) []map[string]any {
	tb.Helper()
	if len(attrs)%2 != 0 {
		tb.Fatalf("LogBuffer.Lines: attrs %q are not key, value pairs", attrs)
	}
	var out []map[string]any
	sc := bufio.NewScanner(bytes.NewReader([]byte(l.String())))
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		var m map[string]any
		if err := json.Unmarshal(sc.Bytes(), &m); err != nil {
			tb.Fatalf("log line %q: %v", sc.Text(), err)
		}
		if msg != "" && m["msg"] != msg {
			continue
		}
		match := true
		for i := 0; i < len(attrs); i += 2 {
			if v, ok := m[attrs[i]].(string); !ok || v != attrs[i+1] {
				match = false
			}
		}
		if match {
			out = append(out, m)
		}
	}
	if err := sc.Err(); err != nil {
		tb.Fatalf("reading the log: %v", err)
	}
	return out
}

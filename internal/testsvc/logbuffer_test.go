package testsvc

import (
	"log/slog"
	"strings"
	"testing"
)

func TestLogBufferLines(t *testing.T) {
	var l LogBuffer
	log := l.LoggerAt(slog.LevelInfo)
	log.Debug("hidden")
	log.Info("a", "group", "orders")
	log.Warn("a", "group", "payments")
	log.Info("b", "group", "orders", "n", 1)
	if n := len(l.Lines(t, "")); n != 3 {
		t.Errorf("all lines: %d, want 3 (debug is below the level):\n%s", n, l.String())
	}
	if got := l.Lines(t, "a", "group", "payments"); len(got) != 1 || got[0]["level"] != "WARN" {
		t.Errorf(`msg "a" of group payments: %v`, got)
	}
	if n := len(l.Lines(t, "", "group", "orders")); n != 2 {
		t.Errorf("group orders: %d lines, want 2", n)
	}
	l.Logger().Debug("shown")
	if !strings.Contains(l.String(), `"msg":"shown"`) {
		t.Errorf("Logger does not log debug lines:\n%s", l.String())
	}
}

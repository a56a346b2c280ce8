package checkback

import (
	"log/slog"
	"sync"
)

// maxInconclusiveGroups bounds the groups whose inconclusive state is remembered; past it,
// every further inconclusive check of another group is logged as the first.
const maxInconclusiveGroups = 1024

// inconclusiveGroups turns inconclusive checks (UNKNOWN, a timeout, no responders, an error
// or malformed reply) into one log line per state change of a producer group: a warning when
// its checks start ending inconclusively, an info line when one of its checks gets COMMIT or
// ROLLBACK again. The checks in between are logged at debug level; every check is counted in
// txoutbox_checkback_checks_total{outcome}.
type inconclusiveGroups struct {
	mu sync.Mutex
	m  map[string]int64 // group → inconclusive checks since its checks started ending so
}

func (g *inconclusiveGroups) inconclusive(log *slog.Logger, group, outcome, detail string, attrs ...any) {
	g.mu.Lock()
	if g.m == nil {
		g.m = make(map[string]int64)
	}
	n, known := g.m[group]
	if known || len(g.m) < maxInconclusiveGroups {
		g.m[group] = n + 1
	}
	g.mu.Unlock()
	attrs = append(attrs, "outcome", outcome, "detail", detail)
	if known {
		log.Debug("half message check inconclusive; checking again later", attrs...)
		return
	}
	log.Warn("a producer group's checks are inconclusive; its half messages are checked again with backoff "+
		"(further inconclusive checks are logged at debug level until one gets COMMIT or ROLLBACK)", attrs...)
}

func (g *inconclusiveGroups) conclusive(log *slog.Logger, group string) {
	g.mu.Lock()
	n, known := g.m[group]
	if known {
		delete(g.m, group)
	}
	g.mu.Unlock()
	if known {
		log.Info("a producer group's checks are conclusive again", "group", group, "inconclusive_checks", n)
	}
}

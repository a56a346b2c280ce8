package checkback

import (
	"log/slog"
	"maps"
	"slices"
	"sync"
)

// maxInconclusiveGroups bounds the groups whose inconclusive state is remembered; past it,
// one warning says so and the inconclusive checks of further groups are logged at debug level
// until there is room again.
const maxInconclusiveGroups = 1024

// inconclusiveGroups turns inconclusive checks (UNKNOWN, a timeout, no responders, an error
// or malformed reply) into one log line per state change of a producer group: a warning when
// its checks start ending inconclusively; an info line when one of its checks gets COMMIT or
// ROLLBACK again, or when it has no half message left that a check found inconclusive (its
// producer settled them, they became check_exhausted — logged as an error of their own — or
// were removed), so that its next incident warns again. The checks in between are logged at
// debug level; every check is counted in txoutbox_checkback_checks_total{outcome}.
type inconclusiveGroups struct {
	mu       sync.Mutex
	m        map[string]int64 // group → inconclusive checks since its checks started ending so
	overflow bool             // a group was left unremembered for want of room
}

func (g *inconclusiveGroups) inconclusive(log *slog.Logger, group, outcome, detail string, attrs ...any) {
	g.mu.Lock()
	if g.m == nil {
		g.m = make(map[string]int64)
	}
	n, known := g.m[group]
	full := !known && len(g.m) >= maxInconclusiveGroups
	startOverflow := full && !g.overflow
	if full {
		g.overflow = true
	} else {
		g.m[group] = n + 1
	}
	g.mu.Unlock()
	attrs = append(attrs, "outcome", outcome, "detail", detail)
	if startOverflow {
		log.Warn("the checks of more producer groups are inconclusive than the check-back follows one by one; "+
			"the inconclusive checks of further groups are logged at debug level (counted in txoutbox_checkback_checks_total)",
			"groups_followed", maxInconclusiveGroups)
	}
	if known || full {
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
	endOverflow := g.roomAgain()
	g.mu.Unlock()
	if known {
		log.Info("a producer group's checks are conclusive again", "group", group, "inconclusive_checks", n)
	}
	if endOverflow {
		log.Info("the check-back follows every producer group with inconclusive checks again")
	}
}

// roomAgain ends an overflow once there is room; it reports whether it did. g.mu is held.
func (g *inconclusiveGroups) roomAgain() bool {
	if g.overflow && len(g.m) < maxInconclusiveGroups {
		g.overflow = false
		return true
	}
	return false
}

// snapshot returns the groups whose checks are inconclusive, with their counts.
func (g *inconclusiveGroups) snapshot() map[string]int64 {
	g.mu.Lock()
	defer g.mu.Unlock()
	return maps.Clone(g.m)
}

// settled forgets the groups of snap that have no half message left that a check found
// inconclusive (still, the groups that do, was read after snap was taken), unless one of
// their checks was inconclusive since snap: one info line each.
func (g *inconclusiveGroups) settled(log *slog.Logger, snap map[string]int64, still []string) {
	for _, group := range still {
		delete(snap, group)
	}
	var gone []string
	g.mu.Lock()
	for group, n := range snap {
		if cur, ok := g.m[group]; ok && cur == n {
			delete(g.m, group)
			gone = append(gone, group)
		}
	}
	endOverflow := g.roomAgain()
	g.mu.Unlock()
	slices.Sort(gone)
	for _, group := range gone {
		log.Info("a producer group has no inconclusive half messages left: its producer settled them, or they became check_exhausted or were removed",
			"group", group, "inconclusive_checks", snap[group])
	}
	if endOverflow {
		log.Info("the check-back follows every producer group with inconclusive checks again")
	}
}

package relay

import (
	"runtime/debug"
	"sync"
	"time"

	"github.com/txoutbox/txoutbox/internal/store"
)

// The fleet view: with each heartbeat a relay writes its version, state, NATS connection state
// and throughput into its membership row (migration 006), so that `relay status` and the
// status page of any relay show every live relay, not only the one serving the page.

// modulePath is this module's path, looked up in the binary's build information.
const modulePath = "github.com/txoutbox/txoutbox"

// rateWindow is how far back the reported publish rate looks.
const rateWindow = time.Minute

// moduleVersion is the txoutbox version the running binary was built with: the main
// module's version when the binary is built from this module (the relay command), else the
// version of this module among the dependencies. A development build says "(devel)" and, when
// known, its VCS revision.
var moduleVersion = sync.OnceValue(func() string {
	info, ok := debug.ReadBuildInfo()
	if !ok {
		return ""
	}
	if info.Main.Path == modulePath {
		v := info.Main.Version
		if v != "" && v != "(devel)" {
			return v
		}
		var rev string
		var modified bool
		for _, s := range info.Settings {
			switch s.Key {
			case "vcs.revision":
				rev = s.Value
			case "vcs.modified":
				modified = s.Value == "true"
			}
		}
		v = "(devel)"
		if rev != "" {
			v += " " + rev[:min(12, len(rev))]
			if modified {
				v += "+dirty"
			}
		}
		return v
	}
	for _, d := range info.Deps {
		if d.Path == modulePath {
			if d.Replace != nil {
				return d.Version + " (replaced by " + d.Replace.Path + ")"
			}
			return d.Version
		}
	}
	return ""
})

// rateMeter turns a running total into a rate over about the last rateWindow, from the totals
// seen at each lease round.
type rateMeter struct {
	samples []rateSample // oldest first, spanning at most rateWindow (plus one older sample)
}

type rateSample struct {
	at    time.Time
	total int64
}

// observe records total at now and returns the rate per second since the oldest sample kept.
func (m *rateMeter) observe(now time.Time, total int64) float64 {
	m.samples = append(m.samples, rateSample{now, total})
	// Keep one sample at or beyond the window's start, so that the rate covers the window.
	for len(m.samples) > 2 && now.Sub(m.samples[1].at) >= rateWindow {
		m.samples = m.samples[1:]
	}
	first := m.samples[0]
	d := now.Sub(first.at).Seconds()
	if d <= 0 || total < first.total {
		return 0
	}
	return float64(total-first.total) / d
}

// fleetInfo is what this relay reports with the heartbeat of the round starting at now.
func (r *Relay) fleetInfo(m *rateMeter, now time.Time) store.RelayInfo {
	published := r.stats.Published.Load()
	return store.RelayInfo{
		Version:     moduleVersion(),
		Health:      string(r.Health()),
		NATS:        r.js.Conn().Status().String(),
		Published:   published,
		PublishRate: m.observe(now, published),
	}
}

package relay

import (
	"github.com/nats-io/nats.go"
	"github.com/txoutbox/txoutbox/internal/natsver"
)

// MinServerVersion is the oldest nats-server the relay runs against: it publishes and looks
// streams up through nats.go's jetstream package, which needs 2.9.0 (see the README's table of
// versions per feature).
const MinServerVersion = "2.9.0"

// CheckServerVersion returns a *txoutbox.ServerVersionError when the server nc is connected to
// announced a version older than MinServerVersion (nil when it is not connected). Run does
// this check itself; call it to refuse a server before starting anything else.
func CheckServerVersion(nc *nats.Conn) error {
	return natsver.Check(nc, "relay", "the relay (JetStream publishing and stream lookup through nats.go's jetstream package)", MinServerVersion)
}

func (r *Relay) checkServerVersion() error { return CheckServerVersion(r.js.Conn()) }

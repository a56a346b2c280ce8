package relay

import (
	"github.com/txoutbox/txoutbox/internal/natsver"
)

// MinServerVersion is the oldest nats-server the relay runs against: it publishes and looks
// streams up through nats.go's jetstream package, which needs 2.9.0 (see the README's table of
// versions per feature).
const MinServerVersion = "2.9.0"

// ErrServerTooOld is the sentinel of a *ServerVersionError: Run (and CheckStreams) refuse a
// nats-server older than MinServerVersion before anything is published.
var ErrServerTooOld = natsver.ErrServerTooOld

// ServerVersionError names the server's version (from its INFO) and the version required.
type ServerVersionError = natsver.ServerVersionError

// checkServerVersion refuses a server older than MinServerVersion.
func (r *Relay) checkServerVersion() error {
	return natsver.Check(r.js.Conn(), "relay", "the relay (JetStream publishing and stream lookup through nats.go's jetstream package)", MinServerVersion)
}

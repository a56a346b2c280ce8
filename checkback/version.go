package checkback

import (
	"github.com/txoutbox/txoutbox/internal/natsver"
)

// MinServerVersion is the oldest nats-server the check-back runs against: its check requests
// and Serve's answers carry NATS headers, and a check no checker answers is told apart by the
// server's no-responders status, both from 2.2.0 (see the README's table of versions per
// feature).
const MinServerVersion = "2.2.0"

// ErrServerTooOld is the sentinel of a *ServerVersionError: Run and RunOnce refuse a
// nats-server older than MinServerVersion.
var ErrServerTooOld = natsver.ErrServerTooOld

// ServerVersionError names the server's version (from its INFO) and the version required.
type ServerVersionError = natsver.ServerVersionError

// checkServerVersion refuses a server older than MinServerVersion (none without a connection).
func (c *CheckBack) checkServerVersion() error {
	return natsver.Check(c.nc, "checkback", "the check-back (check requests with NATS headers and no-responders status)", MinServerVersion)
}

package checkback

import (
	"github.com/txoutbox/txoutbox/internal/natsver"
)

// MinServerVersion is the oldest nats-server the check-back runs against: its check requests
// and the checkers' answers (checker.Serve) carry NATS headers, and a check no checker answers is told apart by the
// server's no-responders status, both from 2.2.0 (see the README's table of versions per
// feature).
const MinServerVersion = "2.2.0"

// checkServerVersion refuses a server older than MinServerVersion (none without a connection).
func (c *CheckBack) checkServerVersion() error {
	return natsver.Check(c.nc, "checkback", "the check-back (check requests with NATS headers and no-responders status)", MinServerVersion)
}

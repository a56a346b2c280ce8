package consumer

import (
	"github.com/txoutbox/txoutbox/internal/natsver"
)

// The oldest nats-server versions the consumer runs against (see the README's table of versions
// per feature).
const (
	// MinServerVersion: durable pull consumers through nats.go's jetstream package
	// (CreateOrUpdateConsumer, Consume with heartbeats, NakWithDelay, DoubleAck) need 2.9.0.
	MinServerVersion = "2.9.0"
	// MinServerVersionFilterSubjects: more than one of Config.FilterSubjects needs 2.10.0
	// (one filter subject works from MinServerVersion).
	MinServerVersionFilterSubjects = "2.10.0"
)

// checkServerVersion refuses a server older than the configuration needs.
func (c *Consumer) checkServerVersion() error {
	nc := c.js.Conn()
	if len(c.cfg.FilterSubjects) > 1 {
		return natsver.Check(nc, "consumer", "a consumer with more than one FilterSubjects", MinServerVersionFilterSubjects)
	}
	return natsver.Check(nc, "consumer", "the consumer (durable pull consumers through nats.go's jetstream package)", MinServerVersion)
}

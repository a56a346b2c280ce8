package consumer

import (
	"github.com/nats-io/nats.go"
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
	// MinServerVersionTermReason: a terminate that carries a reason (+TERM <reason>, what the
	// dead-letter path sends, shown in JetStream's terminated-message advisory) needs 2.10.4;
	// an older server ignores it and redelivers the message, so the consumer sends a plain
	// terminate to such a server (and when the version is not known).
	MinServerVersionTermReason = "2.10.4"
)

// termTakesReason reports whether the server nc is connected to now terminates a message
// given a reason.
func termTakesReason(nc *nats.Conn) bool {
	less, err := natsver.Less(nc.ConnectedServerVersion(), MinServerVersionTermReason)
	return err == nil && !less
}

// checkServerVersion refuses a server older than the configuration needs.
func (c *Consumer) checkServerVersion() error {
	nc := c.js.Conn()
	if len(c.cfg.FilterSubjects) > 1 {
		return natsver.Check(nc, "consumer", "a consumer with more than one FilterSubjects", MinServerVersionFilterSubjects)
	}
	return natsver.Check(nc, "consumer", "the consumer (durable pull consumers through nats.go's jetstream package)", MinServerVersion)
}

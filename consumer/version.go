package consumer

import (
	"github.com/nats-io/nats.go"
	"github.com/txoutbox/txoutbox/internal/natsver"
)

// The oldest nats-server versions the consumer runs against (see the README's table of versions
// per feature).
const (
	// MinServerVersion: the consumer needs nats-server 2.10.16. Durable pull consumers through
	// nats.go's jetstream package work from 2.9.0, but before 2.10.16 a server that has a
	// nak'ed (or otherwise due) redelivery and no pull request waiting drops it from its
	// redelivery queue, so it comes back only after AckWait, and sends the last message it
	// delivered again as a first delivery, its delivery count going backwards (fixed in
	// 2.10.14 and 2.10.16: nats-io/nats-server#5305 and "Fixed delivery counts on failed
	// deliveries"). That delays every message a stopping consumer hands back, lets a
	// failing message escape MaxDeliveries, and breaks what ordered mode reads from delivery
	// counts (first deliveries come in stream order). Found against Debian's 2.9.10. It also
	// covers more than one Config.FilterSubjects (2.10.0) and a terminate carrying a reason
	// (MinServerVersionTermReason).
	MinServerVersion = "2.10.16"
	// MinServerVersionTermReason: a terminate that carries a reason (+TERM <reason>, what the
	// dead-letter path sends, shown in JetStream's terminated-message advisory) needs 2.10.4;
	// an older server ignores it and redelivers the message. Below MinServerVersion, so the
	// consumer never starts on such a server; should its connection land on one later (a
	// rolling downgrade), it sends that server a plain terminate.
	MinServerVersionTermReason = "2.10.4"
)

// termTakesReason reports whether the server nc is connected to now terminates a message
// given a reason.
func termTakesReason(nc *nats.Conn) bool {
	less, err := natsver.Less(nc.ConnectedServerVersion(), MinServerVersionTermReason)
	return err == nil && !less
}

// checkServerVersion refuses a server older than the consumer needs.
func (c *Consumer) checkServerVersion() error {
	return natsver.Check(c.js.Conn(), "consumer", "the consumer (redeliveries of nak'ed messages that keep their place and their delivery count)", MinServerVersion)
}

// Package jserr classifies JetStream API failures the same way for every component: which
// ones say that JetStream cannot answer right now (and waiting may help), and which are an
// answer. Error types and codes are read, never messages.
package jserr

import (
	"context"
	"errors"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// OutageCodes are the JetStream API errors that are about a stream's (or the cluster's) state
// right now, not about the request: an election under way, a stream offline, a publish of
// the same message id still waiting for its stream's replicas (10158: the stream's leader
// proposed it and has no quorum to store it; it is stored, or dropped, once the replicas
// answer or the leader changes).
var OutageCodes = map[jetstream.ErrorCode]string{
	10008: "JetStream system temporarily unavailable",
	10009: "JetStream cluster can not handle request (not the leader)",
	10118: "stream is offline",
	10158: "duplicate message id is in process",
}

// IsOutageCode reports a JetStream API error in OutageCodes.
func IsOutageCode(err error) bool {
	var apiErr *jetstream.APIError
	if errors.As(err, &apiErr) {
		_, ok := OutageCodes[apiErr.ErrorCode]
		return ok
	}
	return false
}

// Waitable reports whether a failed JetStream API request may succeed by waiting: JetStream
// or a stream did not answer (a timeout; no responders, which the client reports as
// "JetStream not enabled"; the connection reconnecting), or answered that it cannot answer
// now (OutageCodes). Every other answer is final: not authorised, JetStream not enabled for
// the account, no such stream, an invalid configuration.
func Waitable(err error) bool {
	for _, e := range []error{
		context.DeadlineExceeded, nats.ErrTimeout, nats.ErrNoResponders, jetstream.ErrNoStreamResponse,
		jetstream.ErrJetStreamNotEnabled, nats.ErrDisconnected, nats.ErrConnectionReconnecting,
		nats.ErrNoServers, nats.ErrStaleConnection,
	} {
		if errors.Is(err, e) {
			return true
		}
	}
	return IsOutageCode(err)
}

package bench

import (
	"context"
	"flag"
)

func init() {
	register(scenario{name: "consume", summary: "idempotent consumer throughput, per-message and batch mode (TODO: needs package consumer)", flags: consumeFlags})
}

// consumeFlags is the `consume` scenario of the yardstick (issue 6):
//
//	50,000 messages in the stream; the idempotent consumer with a one-row business update per
//	message, per-message mode and batch mode. Final line:
//	consume msgs=50000 per_message_msgs_per_s=… batch_msgs_per_s=…
//
// TODO(issue 6, consumer): package consumer (issue 4) is built on a parallel branch. Once it is
// merged, wire it here: fill BENCH_CONSUME with --msgs messages (reuse drainLoad + the ceiling
// publisher of drain.go, which already publishes deterministic payloads with Nats-Msg-Id),
// run the consumer once per mode against a fresh schema with a one-row business UPDATE per
// message in the consumer's transaction, time until every message is acked, and check with
// the dedup table and the business rows that each message took effect exactly once.
func consumeFlags(fs *flag.FlagSet) func(context.Context, *run) error {
	_ = fs.Int("msgs", 50000, "messages in the stream")
	return func(ctx context.Context, r *run) error {
		return &notWired{msg: "consume: needs package consumer"}
	}
}

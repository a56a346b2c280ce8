package relay

// Hot-path benchmarks of the relay on a real PostgreSQL and an embedded JetStream (file
// storage). Run them one at a time on a quiet machine, for example:
//
//	go test ./relay -run '^$' -bench . -benchtime 200x
//
// Each reports msgs/s besides ns/op (one op is one batch of benchBatch rows).

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/txoutbox/txoutbox/internal/store"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
)

// benchBatch is the relay's default batch size.
const benchBatch = DefaultBatchSize

type benchEnv struct {
	db     *testsvc.DB
	nats   *testsvc.NATS
	client *outbox.Client
	r      *Relay
	body   []byte
}

func newBenchEnv(b testing.TB) *benchEnv {
	b.Helper()
	db := testsvc.NewDB(b)
	n := testsvc.NewNATS(b)
	n.Stream(b, "BENCH", "bench.>")
	c, err := outbox.NewClient(&outbox.Config{Schema: db.Schema})
	if err != nil {
		b.Fatal(err)
	}
	r, err := New(db.Pool, n.JS, &Config{
		Schema: db.Schema, ID: "bench",
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
	})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(r.Close)
	body := make([]byte, 512)
	for i := range body {
		body[i] = byte(i * 7)
	}
	return &benchEnv{db: db, nats: n, client: c, r: r, body: body}
}

// fill commits n messages (keys > 0: spread over that many keys), 1,000 per transaction.
func (e *benchEnv) fill(b testing.TB, n, keys int) {
	b.Helper()
	ctx := context.Background()
	for done := 0; done < n; {
		k := min(1000, n-done)
		msgs := make([]outbox.Message, k)
		for i := range msgs {
			msgs[i] = outbox.Message{Subject: "bench.relay", Payload: e.body}
			if keys > 0 {
				msgs[i].Key = fmt.Sprintf("k%d", (done+i)%keys)
			}
		}
		if err := pgx.BeginFunc(ctx, e.db.Pool, func(tx pgx.Tx) error {
			_, err := e.client.EnqueueTx(ctx, tx, msgs...)
			return err
		}); err != nil {
			b.Fatal(err)
		}
		done += k
	}
}

func reportMsgs(b *testing.B, msgs int) {
	b.ReportMetric(float64(msgs)/b.Elapsed().Seconds(), "msgs/s")
}

// BenchmarkRunOnce is one claim + publish + settle of a full batch (the relay's loop body),
// with exactly one batch in the table, or with a backlog of 50,000 rows ahead of it.
func BenchmarkRunOnce(b *testing.B) {
	for _, bc := range []struct {
		name          string
		backlog, keys int
	}{
		{"unkeyed", benchBatch, 0},
		{"keyed_50", benchBatch, 50},
		{"unkeyed_backlog_50000", 50000, 0},
	} {
		b.Run(bc.name, func(b *testing.B) {
			e := newBenchEnv(b)
			ctx := context.Background()
			left, total := 0, 0
			for b.Loop() {
				if left < benchBatch {
					b.StopTimer()
					e.fill(b, bc.backlog-left, bc.keys)
					left = bc.backlog
					b.StartTimer()
				}
				n, err := e.r.runOnce(ctx)
				if err != nil || n != benchBatch {
					b.Fatalf("runOnce = %d, %v; want %d rows", n, err, benchBatch)
				}
				left -= n
				total += n
			}
			reportMsgs(b, total)
		})
	}
}

// BenchmarkClaim is the claim query alone (read only: the same rows every time) with 50,000
// ready rows, on a clean table and after 100,000 earlier rows were settled (deleted) and not
// yet vacuumed, as in the middle of a long drain: the claim's index scan then steps over the
// deleted rows' index entries; with the first batch in flight (excluded, as the pipelined
// claim does); and from 4 or 3 of the 8 partitions, as one relay of two or three claims (its
// scan steps over the other relays' rows). Autovacuum is off for the table so that it cannot clean up in
// the middle of a measurement. Ten claims run before the clock starts (the first executions
// of a prepared statement get custom plans; see the report of issue 6).
func BenchmarkClaim(b *testing.B) {
	for _, bc := range []struct {
		name    string
		settled int
		parts   []int32 // the partitions claimed from (nil: all, as one relay)
		// inFlight excludes the first batch's rows, as the pipelined claim does while that
		// batch is being published: its scan steps over them.
		inFlight bool
	}{
		{"backlog_50000", 0, nil, false},
		{"backlog_50000_500_in_flight", 0, nil, true},
		{"backlog_50000_after_100000_settled", 100000, nil, false},
		// One relay of two, and of three (scale-out): the claim steps over the other relays'
		// rows, in id order, to fill its batch.
		{"backlog_50000_4_of_8_partitions", 0, []int32{0, 1, 2, 3}, false},
		{"backlog_50000_3_of_8_partitions", 0, []int32{0, 1, 2}, false},
	} {
		b.Run(bc.name, func(b *testing.B) {
			e := newBenchEnv(b)
			ctx := context.Background()
			if _, err := e.db.Pool.Exec(ctx, "ALTER TABLE txoutbox_messages SET (autovacuum_enabled = false)"); err != nil {
				b.Fatal(err)
			}
			e.fill(b, bc.settled+50000, 0)
			if bc.settled > 0 {
				if _, err := e.db.Pool.Exec(ctx, "DELETE FROM txoutbox_messages WHERE id IN (SELECT id FROM txoutbox_messages ORDER BY id LIMIT $1)", bc.settled); err != nil {
					b.Fatal(err)
				}
			}
			conn, _, err := e.r.lease.acquire(ctx)
			if err != nil {
				b.Fatal(err)
			}
			args := store.ClaimArgs{Limit: benchBatch, PartitionCount: DefaultPartitions, Partitions: bc.parts}
			if bc.inFlight {
				first, err := e.r.q.Claim(ctx, conn, args)
				if err != nil {
					b.Fatal(err)
				}
				for _, row := range first {
					args.Exclude = append(args.Exclude, row.ID)
				}
			}
			claim := func() {
				rows, err := e.r.q.Claim(ctx, conn, args)
				if err != nil || len(rows) != benchBatch {
					b.Fatalf("claim = %d rows, %v", len(rows), err)
				}
			}
			for range 10 {
				claim()
			}
			ops := 0
			for b.Loop() {
				claim()
				ops++
			}
			reportMsgs(b, ops*benchBatch)
		})
	}
}

// BenchmarkPublish is publishing a claimed batch and awaiting every PubAck, without the
// database (fresh message ids every time).
func BenchmarkPublish(b *testing.B) {
	e := newBenchEnv(b)
	ctx := context.Background()
	rows := make([]store.Claimed, benchBatch)
	ops := 0
	for b.Loop() {
		ops++
		b.StopTimer()
		for i := range rows {
			rows[i] = store.Claimed{ID: int64(i), MessageID: uuid.New(), Subject: "bench.relay", Payload: e.body, ReadyAt: time.Now()}
		}
		_, _, gen, err := e.r.lease.acquireGen(ctx) // a lease round when one is due, as a claim would
		if err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
		res := e.r.publish(ctx, rows, nil, gen)
		if len(res.published) != benchBatch || res.brokerErr != nil {
			b.Fatalf("published %d, broker error %v", len(res.published), res.brokerErr)
		}
	}
	reportMsgs(b, ops*benchBatch)
}

// BenchmarkSettle is settling a published batch (deleting its rows) alone.
func BenchmarkSettle(b *testing.B) {
	e := newBenchEnv(b)
	ctx := context.Background()
	conn, _, err := e.r.lease.acquire(ctx)
	if err != nil {
		b.Fatal(err)
	}
	args := store.ClaimArgs{Limit: benchBatch, PartitionCount: DefaultPartitions}
	ops := 0
	for b.Loop() {
		ops++
		b.StopTimer()
		e.fill(b, benchBatch, 0)
		rows, err := e.r.q.Claim(ctx, conn, args)
		if err != nil || len(rows) != benchBatch {
			b.Fatalf("claim = %d rows, %v", len(rows), err)
		}
		pub := make([]store.Published, len(rows))
		for i, row := range rows {
			pub[i] = store.Published{ID: row.ID, Stream: "BENCH", Seq: uint64(i + 1)}
		}
		b.StartTimer()
		out, err := e.r.q.Settle(ctx, conn, store.SettleArgs{Published: pub, MaxAttempts: DefaultMaxAttempts})
		if err != nil || out.Published != benchBatch {
			b.Fatalf("settle = %d, %v", out.Published, err)
		}
	}
	reportMsgs(b, ops*benchBatch)
}

// BenchmarkLeaseCheck is the lease check made before each message is handed to the NATS client
// (an atomic load and a monotonic clock reading).
func BenchmarkLeaseCheck(b *testing.B) {
	l := &leaser{}
	l.snap.Store(&leaseSnap{until: time.Now().Add(time.Hour)})
	for b.Loop() {
		if !l.valid(0) {
			b.Fatal("lease invalid")
		}
	}
}

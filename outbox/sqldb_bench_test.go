package outbox_test

import (
	"context"
	"database/sql"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
)

// BenchmarkProducersDatabaseSQL compares, in one run, EnqueueTx on pgx with EnqueueSQLTx
// through database/sql (pgx's stdlib driver, lib/pq, lib/pq with binary_parameters=yes), with BenchmarkProducers' message (a
// subject, a key of its own, one header, 100 bytes of payload). Each op is one transaction of
// 1 or 100 messages; each op runs one transaction of each way, and each way reports its
// ns/msg and its ratio to EnqueueTx on pgx.
//
//	go test ./outbox/ -run '^$' -bench BenchmarkProducersDatabaseSQL -benchtime 2s
func BenchmarkProducersDatabaseSQL(b *testing.B) {
	ctx := context.Background()
	db := testsvc.NewDB(b)
	c, err := outbox.NewClient(&outbox.Config{Schema: db.Schema})
	if err != nil {
		b.Fatal(err)
	}
	payload := make([]byte, 100)
	msgs := func(n, round int) []outbox.Message {
		out := make([]outbox.Message, n)
		for i := range out {
			out[i] = outbox.Message{Subject: "bench.orders", Key: "k-" + strconv.Itoa(round) + "-" + strconv.Itoa(i),
				Headers: map[string][]string{"traceparent": {"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}}, Payload: payload}
		}
		return out
	}
	sqlTx := func(sdb *sql.DB, ms []outbox.Message) error {
		tx, err := sdb.BeginTx(ctx, nil)
		if err != nil {
			return err
		}
		if _, err := c.EnqueueSQLTx(ctx, tx, ms...); err != nil {
			_ = tx.Rollback()
			return err
		}
		return tx.Commit()
	}
	stdlib, pq, pqBinary := openSQL(b, db, "pgx"), openSQL(b, db, "postgres"), openSQL(b, db, "postgres+binary_parameters")
	ways := []struct {
		name string
		do   func(ms []outbox.Message) error
	}{
		{"EnqueueTx_pgx", func(ms []outbox.Message) error {
			return pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
				_, err := c.EnqueueTx(ctx, tx, ms...)
				return err
			})
		}},
		{"EnqueueSQLTx_pgx_stdlib", func(ms []outbox.Message) error { return sqlTx(stdlib, ms) }},
		{"EnqueueSQLTx_lib_pq", func(ms []outbox.Message) error { return sqlTx(pq, ms) }},
		{"EnqueueSQLTx_lib_pq_binary_parameters", func(ms []outbox.Message) error { return sqlTx(pqBinary, ms) }},
	}
	// The ways run in turns, in a rotating order, inside each op, so that they share the
	// machine's load (a shared machine's load drifts more than they differ); each reports
	// its own ns/msg and its ratio to EnqueueTx on pgx.
	for _, n := range []int{1, 100} {
		b.Run(strconv.Itoa(n)+"_per_tx", func(b *testing.B) {
			spent := make([]time.Duration, len(ways))
			for i := 0; i < b.N; i++ {
				for j := range ways {
					k := (i + j) % len(ways)
					ms := msgs(n, i*len(ways)+k)
					start := time.Now()
					if err := ways[k].do(ms); err != nil {
						b.Fatal(err)
					}
					spent[k] += time.Since(start)
				}
			}
			for k, w := range ways {
				b.ReportMetric(float64(spent[k].Nanoseconds())/float64(b.N*n), w.name+"_ns/msg")
				if k > 0 {
					b.ReportMetric(float64(spent[k])/float64(spent[0]), w.name+"/EnqueueTx_pgx")
				}
			}
			b.StopTimer()
			if _, err := db.Pool.Exec(ctx, `TRUNCATE txoutbox_messages`); err != nil {
				b.Fatal(err)
			}
		})
	}
}

package outbox_test

import (
	"context"
	"database/sql"
	"strconv"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
)

// BenchmarkProducersDatabaseSQL compares, in one run, EnqueueTx on pgx with EnqueueSQLTx
// through database/sql (pgx's stdlib driver and lib/pq), with BenchmarkProducers' message (a
// subject, a key of its own, one header, 100 bytes of payload). Each op is one transaction of
// 1 or 100 messages; ns/msg is per message.
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
	stdlib, pq := openSQL(b, db, "pgx"), openSQL(b, db, "postgres")
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
	}
	for _, n := range []int{1, 100} {
		for _, w := range ways {
			b.Run(w.name+"/"+strconv.Itoa(n)+"_per_tx", func(b *testing.B) {
				for i := 0; i < b.N; i++ {
					if err := w.do(msgs(n, i)); err != nil {
						b.Fatal(err)
					}
				}
				b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*n), "ns/msg")
				b.StopTimer()
				if _, err := db.Pool.Exec(ctx, `TRUNCATE txoutbox_messages`); err != nil {
					b.Fatal(err)
				}
			})
		}
	}
}

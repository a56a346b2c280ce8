package outbox_test

import (
	"context"
	"encoding/json"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/txoutbox/txoutbox/internal/store"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
)

// BenchmarkProducers compares, in one run, the ways to write the same keyed message (a
// subject, a key of its own, one header, 100 bytes of payload): EnqueueTx, the SQL function
// txoutbox_enqueue (one call per message), its batch form txoutbox_enqueue_many, and a plain
// INSERT of the same row without validation or key lock (EnqueueTx's statement and argument
// encoding, store.InsertMessagesUnlocked: a lower bound). Each op runs 50 transactions of 1 or
// 100 messages of every way, in turns; ns/msg is per message. Each way runs on a connection
// of its own, and server-µs/tx is its backend's CPU time per transaction (utime+stime from
// /proc, when the server runs on this machine): the load of a shared machine moves it far
// less than the wall clock. The ratios to EnqueueTx are of one run, in wall clock and in
// server CPU.
//
//	go test ./outbox/ -run '^$' -bench 'BenchmarkProducers$' -benchtime 10x -count 3
func BenchmarkProducers(b *testing.B) {
	ctx := context.Background()
	db := testsvc.NewDB(b)
	c, err := outbox.NewClient(&outbox.Config{Schema: db.Schema})
	if err != nil {
		b.Fatal(err)
	}
	q := store.New(db.Schema)
	payload := make([]byte, 100)
	msgs := func(n, round int) []outbox.Message {
		out := make([]outbox.Message, n)
		for i := range out {
			out[i] = outbox.Message{Subject: "bench.orders", Key: "k-" + strconv.Itoa(round) + "-" + strconv.Itoa(i),
				Headers: map[string][]string{"traceparent": {"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}}, Payload: payload}
		}
		return out
	}
	ways := []struct {
		name string
		do   func(tx pgx.Tx, ms []outbox.Message) error
	}{
		{"EnqueueTx", func(tx pgx.Tx, ms []outbox.Message) error {
			_, err := c.EnqueueTx(ctx, tx, ms...)
			return err
		}},
		{"txoutbox_enqueue", func(tx pgx.Tx, ms []outbox.Message) error {
			batch := &pgx.Batch{}
			for _, m := range ms {
				batch.Queue(`SELECT txoutbox_enqueue($1, $2, $3, $4::jsonb)`, m.Subject, m.Payload, m.Key, headersJSON(m.Headers))
			}
			return tx.SendBatch(ctx, batch).Close()
		}},
		{"txoutbox_enqueue_many", func(tx pgx.Tx, ms []outbox.Message) error {
			n := len(ms)
			subjects, payloads, keys, hdrs := make([]string, n), make([][]byte, n), make([]string, n), make([]any, n)
			for i, m := range ms {
				subjects[i], payloads[i], keys[i], hdrs[i] = m.Subject, m.Payload, m.Key, headersJSON(m.Headers)
			}
			_, err := tx.Exec(ctx, `SELECT txoutbox_enqueue_many($1, $2, $3, $4::text[]::jsonb[])`, subjects, payloads, keys, hdrs)
			return err
		}},
		{"plain_INSERT", func(tx pgx.Tx, ms []outbox.Message) error {
			// EnqueueTx's own statement and argument encoding, without its checks and key
			// locks: a lower bound of a write.
			rows := make([]store.NewRow, len(ms))
			for i, m := range ms {
				hdr, err := json.Marshal(m.Headers)
				if err != nil {
					return err
				}
				rows[i] = store.NewRow{MessageID: uuid.Must(uuid.NewV7()), Subject: m.Subject, Key: m.Key, Headers: hdr, Payload: m.Payload}
			}
			return q.InsertMessagesUnlocked(ctx, tx, rows)
		}},
	}
	// The ways run in turns, in a rotating order, inside each op, each on a connection of its
	// own, so that they share the machine's load (a shared machine's load drifts more than
	// they differ); each reports its ns/msg, its backend's CPU per transaction, and its ratios
	// to EnqueueTx in wall clock and in server CPU. A turn is txPerTurn transactions in a row,
	// as a producer runs them: switching backends at every transaction would measure the
	// CPU caches refilling more than the statements.
	const txPerTurn = 50
	for _, n := range []int{1, 100} {
		b.Run(strconv.Itoa(n)+"_per_tx", func(b *testing.B) {
			conns := make([]*pgxpool.Conn, len(ways))
			for k := range ways {
				conn, err := db.Pool.Acquire(ctx)
				if err != nil {
					b.Fatal(err)
				}
				defer conn.Release()
				conns[k] = conn
			}
			spent, cpu := make([]time.Duration, len(ways)), make([]time.Duration, len(ways))
			cpuOK := true
			for i := 0; i < b.N; i++ {
				for j := range ways {
					k := (i + j) % len(ways)
					pid := conns[k].Conn().PgConn().PID()
					cpu0, ok0 := backendCPU(pid)
					for t := range txPerTurn {
						ms := msgs(n, (i*len(ways)+k)*txPerTurn+t)
						start := time.Now()
						if err := pgx.BeginFunc(ctx, conns[k], func(tx pgx.Tx) error { return ways[k].do(tx, ms) }); err != nil {
							b.Fatal(err)
						}
						spent[k] += time.Since(start)
					}
					cpu1, ok1 := backendCPU(pid)
					cpuOK = cpuOK && ok0 && ok1
					cpu[k] += cpu1 - cpu0
				}
			}
			b.StopTimer()
			for k, w := range ways {
				b.ReportMetric(float64(spent[k].Nanoseconds())/float64(b.N*txPerTurn*n), w.name+"_ns/msg")
				if cpuOK {
					b.ReportMetric(float64(cpu[k].Microseconds())/float64(b.N*txPerTurn), w.name+"_server-µs/tx")
				}
				if k > 0 {
					b.ReportMetric(float64(spent[k])/float64(spent[0]), w.name+"/EnqueueTx")
					if cpuOK && cpu[0] > 0 {
						b.ReportMetric(float64(cpu[k])/float64(cpu[0]), w.name+"_server/EnqueueTx")
					}
				}
			}
			// On a connection of the op's: the pool has no other while they are held.
			if _, err := conns[0].Exec(ctx, `TRUNCATE txoutbox_messages`); err != nil {
				b.Fatal(err)
			}
		})
	}
}

// backendCPU is the CPU time (user and system) the server process pid has used, read from
// /proc/<pid>/stat (false when the server does not run on this machine). The kernel counts
// it in clock ticks, 10 ms on Linux (USER_HZ 100): read it over many ops.
func backendCPU(pid uint32) (time.Duration, bool) {
	b, err := os.ReadFile("/proc/" + strconv.FormatUint(uint64(pid), 10) + "/stat")
	if err != nil {
		return 0, false
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')') // the command name may hold spaces
	if i < 0 {
		return 0, false
	}
	f := strings.Fields(s[i+1:]) // f[0] is field 3 (state): utime and stime are fields 14 and 15
	if len(f) < 13 || !strings.HasPrefix(strings.TrimSpace(s[:i]), strconv.FormatUint(uint64(pid), 10)+" (postgres") {
		return 0, false
	}
	utime, err1 := strconv.ParseInt(f[11], 10, 64)
	stime, err2 := strconv.ParseInt(f[12], 10, 64)
	if err1 != nil || err2 != nil {
		return 0, false
	}
	return time.Duration(utime+stime) * 10 * time.Millisecond, true
}

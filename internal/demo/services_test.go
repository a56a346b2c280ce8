package demo

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/txoutbox/txoutbox/internal/embedded"
)

// Without DATABASE_URL the demo starts a throwaway cluster, even when a PostgreSQL answers on
// 127.0.0.1:5432 (as it does where the tests run): it never writes into a database nobody
// named. With -keep the cluster is left running at exit, and the demo says how to stop it.
func TestDemoWithoutDatabaseURLUsesAThrowawayCluster(t *testing.T) {
	t.Parallel()
	if testing.Short() {
		t.Skip("starts a PostgreSQL cluster")
	}
	if _, err := embedded.FindPostgresBinaries(); errors.Is(err, embedded.ErrNoPostgresBinaries) {
		t.Skip(err)
	}
	ctx := context.Background()
	var said []string
	svc, err := startServices(ctx, serviceOptions{NoNATS: true, Keep: true, Log: func(f string, a ...any) { said = append(said, fmt.Sprintf(f, a...)) }})
	if err != nil {
		t.Fatal(err)
	}
	pg := svc.pg
	t.Cleanup(pg.Stop)
	u, err := url.Parse(svc.DSN)
	if err != nil || pg == nil || u.Port() == "5432" || !strings.Contains(svc.PostgresFrom, "throwaway") {
		t.Fatalf("services: DSN %q, from %q, cluster %v; want a throwaway cluster of its own", svc.DSN, svc.PostgresFrom, pg != nil)
	}
	svc.Close()
	if err := embedded.Ping(ctx, pg.DSN(), 5*time.Second); err != nil {
		t.Fatalf("-keep: the cluster was stopped at exit: %v", err)
	}
	if last := said[len(said)-1]; !strings.Contains(last, "kept running") || !strings.Contains(last, pg.Dir) {
		t.Fatalf("-keep: the demo said %q, want how to stop the kept cluster", last)
	}
}

// Package deploy_test keeps the files under deploy/ true to the code: the Grafana dashboard
// and the Prometheus alert rules query only metrics (and labels, and label values) that a
// running relay, check-back and consumer export, and the rules load with Prometheus's own
// rule parser. Prometheus's parser is a test-only dependency: no library package imports it.
package deploy_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"regexp"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"github.com/prometheus/prometheus/model/labels"
	"github.com/prometheus/prometheus/model/rulefmt"
	"github.com/prometheus/prometheus/promql/parser"
	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/checkback"
	"github.com/txoutbox/txoutbox/consumer"
	"github.com/txoutbox/txoutbox/internal/ops"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
	"github.com/txoutbox/txoutbox/outbox/checker"
	"github.com/txoutbox/txoutbox/relay"
)

func TestMain(m *testing.M) { os.Exit(testsvc.Main(m)) }

const (
	dashboardFile = "grafana/txoutbox.json"
	rulesFile     = "prometheus/alerts.yml"
)

// targetLabels are added by Prometheus to every scraped series; no component exports them.
var targetLabels = map[string]bool{"instance": true, "job": true}

// scrapeSeries are the series Prometheus writes for each scrape target itself (with the target
// labels only): the rules watch `up` for a relay that is down, whose own series are gone.
var scrapeSeries = map[string]bool{"up": true}

// exported is what the scrapes showed: per series name (a histogram's _bucket, _sum and
// _count separately), per label, the values seen.
type exported map[string]map[string]map[string]bool

// add records the series of one scrape.
func (e exported) add(ss []series) {
	for _, s := range ss {
		if e[s.name] == nil {
			e[s.name] = map[string]map[string]bool{}
		}
		for k, v := range s.labels {
			if e[s.name][k] == nil {
				e[s.name][k] = map[string]bool{}
			}
			e[s.name][k][v] = true
		}
	}
}

type series struct {
	name   string
	labels map[string]string
}

// scrape fetches url (a /metrics endpoint) as Prometheus does and returns its series, a
// histogram as its _bucket (with le), _sum and _count series.
func scrape(url string) ([]series, error) {
	req, err := http.NewRequest(http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	req.Header.Set("Accept", "text/plain;version=0.0.4")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(resp.Body)
	if err != nil {
		return nil, fmt.Errorf("parse %s: %w", url, err)
	}
	var out []series
	for name, f := range fams {
		for _, m := range f.GetMetric() {
			ls := map[string]string{}
			for _, l := range m.GetLabel() {
				ls[l.GetName()] = l.GetValue()
			}
			with := func(k, v string) map[string]string {
				c := map[string]string{k: v}
				for k, v := range ls {
					c[k] = v
				}
				return c
			}
			switch {
			case m.GetHistogram() != nil:
				out = append(out, series{name + "_bucket", with("le", "+Inf")}, series{name + "_sum", ls}, series{name + "_count", ls})
			case m.GetSummary() != nil:
				out = append(out, series{name, with("quantile", "0.5")}, series{name + "_sum", ls}, series{name + "_count", ls})
			default:
				out = append(out, series{name, ls})
			}
		}
	}
	return out, nil
}

// query is one PromQL expression of the dashboard or the rules, and where it is.
type query struct {
	where, expr string
}

// grafanaVars replaces the dashboard's variables with what Grafana would put there, so that
// the expression parses as PromQL.
var grafanaVars = strings.NewReplacer(
	"$__rate_interval", "5m", "${__rate_interval}", "5m",
	"$__interval", "1m", "${__interval}", "1m",
	"$__range", "1h", "${__range}", "1h",
	"$consumer", ".*", "${consumer}", ".*",
)

var labelValuesQuery = regexp.MustCompile(`^label_values\(\s*([a-zA-Z_:][a-zA-Z0-9_:]*)\s*,\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\)$`)

// dashboardQueries reads the dashboard and returns its panels' and variables' queries; it
// fails the test on a dashboard Grafana could not use the way this project means it
// (no datasource variable, a panel bound to a fixed data source, duplicate panel ids).
func dashboardQueries(t *testing.T) []query {
	t.Helper()
	raw, err := os.ReadFile(dashboardFile)
	if err != nil {
		t.Fatal(err)
	}
	var d struct {
		Title      string `json:"title"`
		UID        string `json:"uid"`
		Templating struct {
			List []struct {
				Name  string          `json:"name"`
				Type  string          `json:"type"`
				Query json.RawMessage `json:"query"`
			} `json:"list"`
		} `json:"templating"`
		Panels []panel `json:"panels"`
	}
	if err := json.Unmarshal(raw, &d); err != nil {
		t.Fatalf("%s: %v", dashboardFile, err)
	}
	if d.Title == "" || d.UID == "" {
		t.Errorf("%s: the dashboard has no title or uid", dashboardFile)
	}
	var out []query
	hasDS := false
	for _, v := range d.Templating.List {
		switch v.Type {
		case "datasource":
			var q string
			if err := json.Unmarshal(v.Query, &q); err != nil || q != "prometheus" {
				t.Errorf("%s: variable %s is a data source variable of type %s, want prometheus", dashboardFile, v.Name, v.Query)
			}
			hasDS = hasDS || v.Name == "datasource"
		case "query":
			var q struct {
				Query string `json:"query"`
			}
			if err := json.Unmarshal(v.Query, &q); err != nil {
				t.Fatalf("%s: variable %s: %v", dashboardFile, v.Name, err)
			}
			m := labelValuesQuery.FindStringSubmatch(q.Query)
			if m == nil {
				t.Errorf("%s: variable %s: query %q is not label_values(metric, label)", dashboardFile, v.Name, q.Query)
				continue
			}
			out = append(out, query{where: "variable " + v.Name, expr: fmt.Sprintf("group by (%s) (%s)", m[2], m[1])})
		}
	}
	if !hasDS {
		t.Errorf("%s: no data source variable named datasource", dashboardFile)
	}
	ids := map[int]string{}
	var walk func(ps []panel)
	walk = func(ps []panel) {
		for _, p := range ps {
			if prev, ok := ids[p.ID]; ok {
				t.Errorf("%s: panels %q and %q share the id %d", dashboardFile, prev, p.Title, p.ID)
			}
			ids[p.ID] = p.Title
			walk(p.Panels)
			if p.Type == "row" {
				continue
			}
			if len(p.Targets) == 0 {
				t.Errorf("%s: panel %q has no query", dashboardFile, p.Title)
			}
			if p.Datasource.UID != "${datasource}" {
				t.Errorf("%s: panel %q uses data source %q, want ${datasource}", dashboardFile, p.Title, p.Datasource.UID)
			}
			for _, tg := range p.Targets {
				if tg.Datasource.UID != "${datasource}" {
					t.Errorf("%s: panel %q query %s uses data source %q, want ${datasource}", dashboardFile, p.Title, tg.RefID, tg.Datasource.UID)
				}
				out = append(out, query{where: fmt.Sprintf("panel %q query %s", p.Title, tg.RefID), expr: grafanaVars.Replace(tg.Expr)})
			}
		}
	}
	walk(d.Panels)
	return out
}

type panel struct {
	ID         int    `json:"id"`
	Type       string `json:"type"`
	Title      string `json:"title"`
	Datasource struct {
		UID string `json:"uid"`
	} `json:"datasource"`
	Targets []struct {
		RefID      string `json:"refId"`
		Expr       string `json:"expr"`
		Datasource struct {
			UID string `json:"uid"`
		} `json:"datasource"`
	} `json:"targets"`
	Panels []panel `json:"panels"`
}

// ruleQueries loads the rules with Prometheus's rule parser (which also parses every
// expression and checks the annotation templates) and returns their expressions.
func ruleQueries(t *testing.T) []query {
	t.Helper()
	raw, err := os.ReadFile(rulesFile)
	if err != nil {
		t.Fatal(err)
	}
	groups, errs := rulefmt.Parse(raw, false, model.UTF8Validation, parser.NewParser(parser.Options{}), slog.New(slog.DiscardHandler))
	for _, err := range errs {
		t.Errorf("%s: %v", rulesFile, err)
	}
	if len(errs) > 0 {
		t.FailNow()
	}
	var out []query
	for _, g := range groups.Groups {
		for _, r := range g.Rules {
			if r.Alert == "" {
				t.Errorf("%s: group %s has a recording rule %s; this file holds alerts", rulesFile, g.Name, r.Record)
				continue
			}
			for _, k := range []string{"summary", "description"} {
				if r.Annotations[k] == "" {
					t.Errorf("%s: alert %s has no %s", rulesFile, r.Alert, k)
				}
			}
			if r.Labels["severity"] == "" {
				t.Errorf("%s: alert %s has no severity label", rulesFile, r.Alert)
			}
			out = append(out, query{where: "alert " + r.Alert, expr: r.Expr})
		}
	}
	return out
}

// check parses q and returns what in it the scrape does not back: a metric nobody exports, a
// label a metric does not have, a label value never seen, a grouping by a label none of the
// aggregated metrics has.
func check(q query, e exported) []string {
	expr, err := parser.NewParser(parser.Options{}).ParseExpr(q.expr)
	if err != nil {
		return []string{fmt.Sprintf("%s: %v", q.where, err)}
	}
	var problems []string
	bad := func(format string, args ...any) {
		problems = append(problems, q.where+": "+fmt.Sprintf(format, args...))
	}
	hasLabel := func(names []string, label string) bool {
		if targetLabels[label] {
			return true
		}
		for _, n := range names {
			if e[n][label] != nil {
				return true
			}
		}
		return false
	}
	parser.Inspect(expr, func(node parser.Node, _ []parser.Node) error {
		switch n := node.(type) {
		case *parser.VectorSelector:
			name := n.Name
			if name == "" {
				bad("selector %s names no metric", n)
				return nil
			}
			if scrapeSeries[name] {
				for _, m := range n.LabelMatchers {
					if m.Name != model.MetricNameLabel && !targetLabels[m.Name] {
						bad("Prometheus's %s has no label %s", name, m.Name)
					}
				}
				return nil
			}
			if e[name] == nil {
				bad("metric %s is not exported", name)
				return nil
			}
			for _, m := range n.LabelMatchers {
				if m.Name == model.MetricNameLabel {
					continue
				}
				if targetLabels[m.Name] {
					continue
				}
				values := e[name][m.Name]
				if values == nil {
					bad("metric %s has no label %s", name, m.Name)
					continue
				}
				switch m.Type {
				case labels.MatchEqual, labels.MatchRegexp:
					ok := false
					for v := range values {
						ok = ok || m.Matches(v)
					}
					if !ok {
						bad("%s matches no value of %s's label %s (seen: %s)", m, name, m.Name, keys(values))
					}
				}
			}
		case *parser.AggregateExpr:
			if n.Without {
				return nil
			}
			names := selectorNames(n.Expr)
			for _, l := range n.Grouping {
				if !hasLabel(names, l) {
					bad("%s by (%s): none of %v has label %s", n.Op, strings.Join(n.Grouping, ", "), names, l)
				}
			}
		case *parser.BinaryExpr:
			if n.VectorMatching != nil && n.VectorMatching.On {
				names := append(selectorNames(n.LHS), selectorNames(n.RHS)...)
				for _, l := range n.VectorMatching.MatchingLabels {
					if !hasLabel(names, l) {
						bad("on (%s): none of %v has label %s", strings.Join(n.VectorMatching.MatchingLabels, ", "), names, l)
					}
				}
			}
		}
		return nil
	})
	return problems
}

func selectorNames(n parser.Node) []string {
	var out []string
	parser.Inspect(n, func(node parser.Node, _ []parser.Node) error {
		if vs, ok := node.(*parser.VectorSelector); ok {
			out = append(out, vs.Name)
		}
		return nil
	})
	return out
}

func keys(m map[string]bool) string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return strings.Join(out, ", ")
}

// The checker itself: expressions that are wrong in each way it looks for are reported, and
// right ones are not.
func TestCheckFindsWhatIsNotExported(t *testing.T) {
	t.Parallel()
	e := exported{
		"txoutbox_outbox_messages":                        {"state": {"ready": true, "dead": true}},
		"txoutbox_relay_commit_to_publish_seconds_bucket": {"le": {"+Inf": true}},
	}
	for expr, want := range map[string]string{
		`max(txoutbox_outbox_messages{state="dead"}) > 0`:                                                   "",
		`max by (instance) (txoutbox_outbox_messages{state=~"dead|ready", job="x"})`:                        "",
		`histogram_quantile(0.9, sum by (le) (rate(txoutbox_relay_commit_to_publish_seconds_bucket[5m])))`:  "",
		`max(txoutbox_outbox_mesages)`:                                                                      "metric txoutbox_outbox_mesages is not exported",
		`max(txoutbox_outbox_messages{stat="dead"})`:                                                        "has no label stat",
		`max(txoutbox_outbox_messages{state="deadd"})`:                                                      `matches no value`,
		`max(txoutbox_outbox_messages{state=~"gone|lost"})`:                                                 `matches no value`,
		`max by (subject) (txoutbox_outbox_messages)`:                                                       "has label subject",
		`a{x="1"} / on (partition) txoutbox_outbox_messages`:                                                "metric a is not exported",
		`txoutbox_outbox_messages / on (partition) txoutbox_outbox_messages`:                                "has label partition",
		`max(txoutbox_outbox_messages`:                                                                      "unclosed",
		`(up{job="relay"} == 0) and on (instance, job) group by (instance, job) (txoutbox_outbox_messages)`: "",
		`up{state="ok"} == 0`:                           "up has no label state",
		`absent_over_time(txoutbox_outbox_mesages[5m])`: "metric txoutbox_outbox_mesages is not exported",
	} {
		got := check(query{where: "test", expr: expr}, e)
		switch {
		case want == "" && len(got) > 0:
			t.Errorf("%s: reported %q, want nothing", expr, got)
		case want != "" && !strings.Contains(strings.Join(got, "\n"), want):
			t.Errorf("%s: reported %q, want %q", expr, got, want)
		}
	}
}

// The rules load with Prometheus's rule parser, and a broken rules file does not.
func TestAlertRulesParse(t *testing.T) {
	t.Parallel()
	qs := ruleQueries(t)
	want := []string{"TxoutboxOldestReadyRowTooOld", "TxoutboxDeadRows", "TxoutboxCheckExhausted", "TxoutboxFewerRelaysThanExpected",
		"TxoutboxPartitionCountMismatch", "TxoutboxConsumerDeadLetters", "TxoutboxConsumerDuplicateRateHigh", "TxoutboxRelayNotReady",
		"TxoutboxStreamUnavailable", "TxoutboxStreamWindowShort", "TxoutboxRelayDown", "TxoutboxNoRelay"}
	have := map[string]bool{}
	for _, q := range qs {
		have[strings.TrimPrefix(q.where, "alert ")] = true
	}
	for _, a := range want {
		if !have[a] {
			t.Errorf("%s has no alert %s", rulesFile, a)
		}
	}
	broken := []byte("groups:\n  - name: x\n    rules:\n      - alert: X\n        expr: max(\n")
	if _, errs := rulefmt.Parse(broken, false, model.UTF8Validation, parser.NewParser(parser.Options{}), slog.New(slog.DiscardHandler)); len(errs) == 0 {
		t.Error("rulefmt.Parse accepted a rule with a broken expression: the parse check proves nothing")
	}
}

// A relay that is down exports nothing, so the rules that watch for it must not rest on the
// relay's current series: TxoutboxRelayDown selects Prometheus's `up` == 0 and keeps, on
// instance and job, the targets that were relays over a window; TxoutboxNoRelay is an absent
// check over a window. And every other use of `up` is joined to a txoutbox metric the same
// way: a bare `up == 0` would fire for every target Prometheus scrapes.
func TestRelayDownAlertsDoNotNeedTheRelaysSeries(t *testing.T) {
	t.Parallel()
	exprs := map[string]parser.Expr{}
	for _, q := range ruleQueries(t) {
		expr, err := parser.NewParser(parser.Options{}).ParseExpr(q.expr)
		if err != nil {
			t.Fatalf("%s: %v", q.where, err)
		}
		exprs[strings.TrimPrefix(q.where, "alert ")] = expr
		joined := map[*parser.VectorSelector]bool{}
		parser.Inspect(expr, func(node parser.Node, _ []parser.Node) error {
			b, ok := node.(*parser.BinaryExpr)
			if !ok || b.Op != parser.LAND || b.VectorMatching == nil || !b.VectorMatching.On ||
				!slices.Contains(b.VectorMatching.MatchingLabels, "instance") || !slices.Contains(b.VectorMatching.MatchingLabels, "job") {
				return nil
			}
			rhs := selectorNames(b.RHS)
			if len(rhs) == 0 || !strings.HasPrefix(rhs[0], "txoutbox_") {
				return nil
			}
			parser.Inspect(b.LHS, func(n parser.Node, _ []parser.Node) error {
				if vs, ok := n.(*parser.VectorSelector); ok {
					joined[vs] = true
				}
				return nil
			})
			return nil
		})
		parser.Inspect(expr, func(node parser.Node, _ []parser.Node) error {
			if vs, ok := node.(*parser.VectorSelector); ok && vs.Name == "up" && !joined[vs] {
				t.Errorf("%s: %s is not joined on (instance, job) to a txoutbox metric: it would fire for any target", q.where, vs)
			}
			return nil
		})
	}

	down, ok := exprs["TxoutboxRelayDown"]
	if !ok {
		t.Fatal("no TxoutboxRelayDown")
	}
	usesUp, usesWindow := false, false
	parser.Inspect(down, func(node parser.Node, _ []parser.Node) error {
		switch n := node.(type) {
		case *parser.VectorSelector:
			usesUp = usesUp || n.Name == "up"
		case *parser.Call:
			usesWindow = usesWindow || strings.HasSuffix(n.Func.Name, "_over_time")
		}
		return nil
	})
	if !usesUp || !usesWindow {
		t.Errorf("TxoutboxRelayDown = %s: want up == 0 kept by a relay metric seen over a window", down)
	}

	none, ok := exprs["TxoutboxNoRelay"]
	if !ok {
		t.Fatal("no TxoutboxNoRelay")
	}
	if c, ok := none.(*parser.Call); !ok || (c.Func.Name != "absent_over_time" && c.Func.Name != "absent") {
		t.Errorf("TxoutboxNoRelay = %s: want an absent check", none)
	}
}

// The dashboard and the alert rules against a real scrape: a relay, a check-back and a
// consumer (real PostgreSQL, embedded JetStream), each serving its registry on an operations
// listener, after enough work that every family exists: messages published and consumed, a
// dead row holding back two rows of its key, a half message whose checker is missing
// (check_exhausted) and one still prepared, a dead letter; the stream gauge shows the streams
// the relay's start check learnt, at 0.
func TestDashboardAndAlertsQueryExportedMetrics(t *testing.T) {
	t.Parallel()
	queries := append(dashboardQueries(t), ruleQueries(t)...)
	if len(queries) < 40 {
		t.Fatalf("only %d queries in the dashboard and the rules", len(queries))
	}

	db := testsvc.NewDB(t)
	n := testsvc.NewNATS(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	n.Stream(t, "ORDERS", "orders.>")
	n.Stream(t, "DEAD", consumer.DefaultDeadLetterPrefix+">")
	// A stream whose messages may carry 64 bytes: a larger message becomes a dead row at once.
	if _, err := n.JS.CreateStream(ctx, jetstream.StreamConfig{Name: "SMALL", Subjects: []string{"small.>"}, MaxMsgSize: 64, Duplicates: 2 * time.Minute}); err != nil {
		t.Fatal(err)
	}
	client, err := outbox.NewClient(&outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	msgs := []outbox.Message{
		{Subject: "small.x", Key: "k1", Payload: make([]byte, 200)}, // dead: too large for SMALL
		{Subject: "small.x", Key: "k1", Payload: []byte("a")},       // held back by the dead row
		{Subject: "small.x", Key: "k1", Payload: []byte("b")},
	}
	for i := 0; i < 20; i++ {
		msgs = append(msgs, outbox.Message{Subject: "orders.created", Payload: fmt.Appendf(nil, "order %d", i)})
	}
	msgs = append(msgs, outbox.Message{Subject: "orders.poison", Payload: []byte("poison")})
	if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		_, err := client.EnqueueTx(ctx, tx, msgs...)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	// Two half messages of group payments, which has no checker: one checked at once (and
	// exhausted after one check), one immune for an hour (stays prepared).
	if _, err := client.Prepare(ctx, db.Pool, outbox.Message{Subject: "orders.paid", Payload: []byte("p1")}, &outbox.PrepareOptions{Group: "payments"}); err != nil {
		t.Fatal(err)
	}
	if _, err := client.Prepare(ctx, db.Pool, outbox.Message{Subject: "orders.paid", Payload: []byte("p2")}, &outbox.PrepareOptions{Group: "payments", CheckImmunity: time.Hour}); err != nil {
		t.Fatal(err)
	}

	serve := func(reg *prometheus.Registry) string {
		srv, err := ops.Start(&ops.Config{Addr: "127.0.0.1:0", Gatherer: reg, Logger: testsvc.Logger()})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(srv.Close)
		return "http://" + srv.Addr() + "/metrics"
	}
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	run := func(what string, f func(context.Context) error) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := f(ctx); err != nil && !errors.Is(err, context.Canceled) {
				t.Errorf("%s: %v", what, err)
			}
		}()
	}

	relayReg := prometheus.NewRegistry()
	// Subjects: the start check learns ORDERS, so txoutbox_relay_stream_unavailable has its
	// series (0) without an outage.
	r, err := relay.New(db.Pool, n.JS, &relay.Config{Schema: db.Schema, Registerer: relayReg, SampleInterval: 50 * time.Millisecond,
		PollMax: 50 * time.Millisecond, Subjects: []string{"orders.>"}, Logger: testsvc.Logger()})
	if err != nil {
		t.Fatal(err)
	}
	run("relay", r.Run)

	cbReg := prometheus.NewRegistry()
	cb, err := checkback.New(db.Pool, n.Conn, &checkback.Config{Schema: db.Schema, Registerer: cbReg, TransactionTimeout: txoutbox.Off,
		MaxChecks: 1, RequestTimeout: time.Second, Logger: testsvc.Logger(),
	})
	if err != nil {
		t.Fatal(err)
	}
	rep, err := cb.RunOnce(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("check-back pass: %+v", *rep)

	// A checker of another producer group, on its own registry (a producer service's): its
	// txoutbox_checkback_checker_foreign_requests_total{group} has its series (0).
	chkReg := prometheus.NewRegistry()
	identity, err := checker.OutboxIdentity(ctx, db.Pool, db.Schema)
	if err != nil {
		t.Fatal(err)
	}
	chk, err := checker.Serve(n.Conn, "shipping", func(context.Context, checker.Request) (outbox.LocalState, error) {
		return outbox.StateUnknown, nil
	}, &checker.Config{Outbox: identity, Registerer: chkReg, Logger: testsvc.Logger()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = chk.Stop() })

	conReg := prometheus.NewRegistry()
	con, err := consumer.New(db.Pool, n.JS, func(_ context.Context, _ pgx.Tx, m consumer.Message) error {
		if m.Subject == "orders.poison" {
			return consumer.Permanent(errors.New("poison"))
		}
		return nil
	}, &consumer.Config{Stream: "ORDERS", Durable: "billing", Schema: db.Schema, Registerer: conReg, Logger: testsvc.Logger()})
	if err != nil {
		t.Fatal(err)
	}
	run("consumer", con.Run)

	urls := []string{serve(relayReg), serve(cbReg), serve(conReg), serve(chkReg)}
	var problems []string
	defer func() {
		if t.Failed() {
			t.Logf("what the scrapes do not back:\n%s", strings.Join(problems, "\n"))
		}
	}()
	testsvc.Eventually(t, time.Minute, "every query of the dashboard and the rules to be backed by the scrapes", func() bool {
		e := exported{}
		for _, u := range urls {
			fams, err := scrape(u)
			if err != nil {
				t.Fatal(err)
			}
			e.add(fams)
		}
		problems = problems[:0]
		for _, q := range queries {
			problems = append(problems, check(q, e)...)
		}
		return len(problems) == 0
	})
	st := con.Stats()
	t.Logf("%d queries checked; relay published %d, consumer processed %d and dead-lettered %d", len(queries), r.Stats().Published, st.Processed, st.DeadLettered)
}

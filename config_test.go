package txoutbox_test

import (
	"context"
	"database/sql"
	"errors"
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"math"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/checkback"
	"github.com/txoutbox/txoutbox/consumer"
	"github.com/txoutbox/txoutbox/migrations"
	"github.com/txoutbox/txoutbox/outbox"
	"github.com/txoutbox/txoutbox/outbox/checker"
	"github.com/txoutbox/txoutbox/relay"
)

// Every package reports configuration errors the same way: a *txoutbox.ConfigError naming
// the package and the field, matching ErrInvalidConfig.
func TestEveryPackageReportsOneConfigError(t *testing.T) {
	t.Parallel()
	long := strings.Repeat("s", 64)
	_, outboxErr := outbox.NewClient(&outbox.Config{Schema: long})
	_, migErr := migrations.New(&migrations.Config{Schema: long})
	for _, tc := range []struct {
		pkg, field string
		err        error
	}{
		{"relay", "Config.Schema", relay.ValidateConfig(&relay.Config{Schema: long})},
		{"consumer", "Config.Schema", consumer.ValidateConfig(&consumer.Config{Stream: "S", Durable: "d", Schema: long})},
		{"checkback", "Config.Schema", checkback.ValidateConfig(&checkback.Config{Schema: long})},
		{"outbox", "Config.Schema", outboxErr},
		{"outbox", "Config.Schema", outbox.ValidateConfig(&outbox.Config{Schema: long})},
		{"migrations", "Config.Schema", migErr},
		{"migrations", "Config.Schema", migrations.ValidateConfig(&migrations.Config{Schema: long})},
		{"outbox", "Config.MaxMessageBytes", func() error { _, err := outbox.NewClient(&outbox.Config{MaxMessageBytes: 10}); return err }()},
		{"checker", "Config.SubjectPrefix", checker.ValidateConfig(&checker.Config{Outbox: "o", SubjectPrefix: "a..b"})},
		{"checker", "Config.Outbox", checker.ValidateConfig(nil)},
	} {
		var ce *txoutbox.ConfigError
		if !errors.As(tc.err, &ce) || ce.Package != tc.pkg || ce.Field != tc.field {
			t.Errorf("%s %s: got %v (%T), want a *txoutbox.ConfigError naming it", tc.pkg, tc.field, tc.err, tc.err)
			continue
		}
		if !errors.Is(tc.err, txoutbox.ErrInvalidConfig) {
			t.Errorf("%s: %v does not match ErrInvalidConfig", tc.pkg, tc.err)
		}
		if !strings.HasPrefix(tc.err.Error(), tc.pkg+": "+tc.field+" ") {
			t.Errorf("%s: message %q does not start with the package and the field", tc.pkg, tc.err)
		}
	}
}

// fieldRule is what the convention says of one numeric Config field.
type fieldRule struct {
	// def is the value WithDefaults gives the zero field: a Default… constant, or derived
	// for a default computed from other fields (documented as such).
	def any
	// minus1 says the field takes txoutbox.Off or txoutbox.Forever (-1), and its doc says so;
	// every other numeric field refuses -1.
	minus1 bool
}

// derived marks a default computed from other fields, which no constant can hold.
var derived = new(struct{})

type component struct {
	name     string
	fresh    func() any // a new, valid *Config
	validate func(cfg any) error
	defaults func(cfg any) any // cfg.WithDefaults()
	rules    map[string]fieldRule
}

func components() []component {
	newConsumer := func() *consumer.Config { return &consumer.Config{Stream: "S", Durable: "d"} }
	return []component{
		{"relay", func() any { return &relay.Config{} },
			func(c any) error { return relay.ValidateConfig(c.(*relay.Config)) },
			func(c any) any { return c.(*relay.Config).WithDefaults() },
			map[string]fieldRule{
				"BatchSize": {def: relay.DefaultBatchSize}, "MaxInFlight": {def: relay.DefaultMaxInFlight},
				"PublishTimeout": {def: relay.DefaultPublishTimeout}, "PollMin": {def: relay.DefaultPollMin},
				"PollMax": {def: relay.DefaultPollMax}, "BackoffBase": {def: relay.DefaultBackoffBase},
				"BackoffMax": {def: relay.DefaultBackoffMax}, "BackoffJitter": {def: relay.DefaultBackoffJitter, minus1: true},
				"MaxAttempts": {def: relay.DefaultMaxAttempts}, "PublishedRetention": {def: relay.DefaultPublishedRetention, minus1: true},
				"Partitions": {def: relay.DefaultPartitions}, "LeaseInterval": {def: relay.DefaultLeaseInterval},
				"HandoverAfter": {def: relay.DefaultHandoverAfter, minus1: true}, "StreamDuplicates": {def: relay.DefaultStreamDuplicates},
				"SampleInterval": {def: relay.DefaultSampleInterval}, "SampleLimit": {def: relay.DefaultSampleLimit},
				"MaxMessageBytes": {def: relay.DefaultMaxMessageBytes, minus1: true},
			}},
		{"consumer", func() any { return newConsumer() },
			func(c any) error { return consumer.ValidateConfig(c.(*consumer.Config)) },
			func(c any) any { return c.(*consumer.Config).WithDefaults() },
			map[string]fieldRule{
				"Concurrency": {def: consumer.DefaultConcurrency}, "BatchSize": {def: consumer.DefaultBatchSize},
				"BatchWait": {def: consumer.DefaultBatchWait}, "MaxDeliveries": {def: consumer.DefaultMaxDeliveries},
				"BackoffBase": {def: consumer.DefaultBackoffBase}, "BackoffMax": {def: consumer.DefaultBackoffMax},
				"BackoffJitter": {def: consumer.DefaultBackoffJitter, minus1: true}, "AckWait": {def: consumer.DefaultAckWait},
				"InProgressInterval": {def: derived}, "MaxAckPending": {def: consumer.DefaultMaxAckPending},
				"PullMaxMessages": {def: derived}, "PullHeartbeat": {def: consumer.DefaultPullHeartbeat},
				"StopTimeout": {def: derived, minus1: true},
			}},
		{"checkback", func() any { return &checkback.Config{} },
			func(c any) error { return checkback.ValidateConfig(c.(*checkback.Config)) },
			func(c any) any { return c.(*checkback.Config).WithDefaults() },
			map[string]fieldRule{
				"TransactionTimeout": {def: checkback.DefaultTransactionTimeout, minus1: true}, "MaxChecks": {def: checkback.DefaultMaxChecks},
				"RequestTimeout": {def: checkback.DefaultRequestTimeout}, "BackoffBase": {def: checkback.DefaultBackoffBase},
				"BackoffMax": {def: checkback.DefaultBackoffMax}, "BackoffJitter": {def: checkback.DefaultBackoffJitter, minus1: true},
				"BatchSize": {def: checkback.DefaultBatchSize}, "GroupConcurrency": {def: checkback.DefaultGroupConcurrency},
				"GroupRate": {def: checkback.DefaultGroupRate, minus1: true}, "StaleReadyAfter": {def: checkback.DefaultStaleReadyAfter},
				"PublishedRetention":  {def: checkback.DefaultPublishedRetention, minus1: true},
				"RolledBackRetention": {def: checkback.DefaultRolledBackRetention, minus1: true},
				"DedupRetention":      {def: checkback.DefaultDedupRetention, minus1: true}, "PurgeBatchSize": {def: checkback.DefaultPurgeBatchSize},
			}},
		{"checker", func() any { return &checker.Config{Outbox: "o"} },
			func(c any) error { return checker.ValidateConfig(c.(*checker.Config)) },
			func(c any) any { return c.(*checker.Config).WithDefaults() },
			map[string]fieldRule{"Concurrency": {def: checker.DefaultConcurrency}, "RequestTimeout": {def: checker.DefaultRequestTimeout}}},
		{"outbox", func() any { return &outbox.Config{} },
			func(c any) error { return outbox.ValidateConfig(c.(*outbox.Config)) },
			func(c any) any { return c.(*outbox.Config).WithDefaults() },
			map[string]fieldRule{"MaxMessageBytes": {def: outbox.DefaultMaxMessageBytes}}},
		{"migrations", func() any { return &migrations.Config{} },
			func(c any) error { return migrations.ValidateConfig(c.(*migrations.Config)) },
			func(c any) any { return c.(*migrations.Config).WithDefaults() },
			map[string]fieldRule{}},
	}
}

// numericField is one numeric field of a Config, at any depth (nested structs included).
type numericField struct {
	name  string // dotted from the Config: "BackoffJitter", "Outer.Inner"
	index []int
	typ   reflect.Type
}

// numericFields lists the numeric fields of struct type typ and of the exported structs nested
// in it. A numeric kind the convention cannot express (an unsigned field cannot take -1) is
// reported through bad.
func numericFields(typ reflect.Type, prefix string, index []int, bad func(name, why string)) []numericField {
	var out []numericField
	for i := 0; i < typ.NumField(); i++ {
		f := typ.Field(i)
		if !f.IsExported() {
			continue
		}
		name := prefix + f.Name
		idx := append(slices.Clone(index), i)
		switch f.Type.Kind() {
		case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64, reflect.Float32, reflect.Float64:
			out = append(out, numericField{name, idx, f.Type})
		case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64, reflect.Uintptr:
			bad(name, "is unsigned: it cannot take txoutbox.Off or txoutbox.Forever (-1) nor be refused when negative; use a signed type")
		case reflect.Complex64, reflect.Complex128:
			bad(name, "is complex: no Config field should be")
		case reflect.Struct:
			out = append(out, numericFields(f.Type, name+".", idx, bad)...)
		}
	}
	return out
}

// One rule for every numeric field of every Config (counts, sizes, rates, durations,
// factors), enforced field by field so that a new field cannot escape it:
//   - zero takes the default, an exported Default… constant unless derived from other fields;
//   - -1 (txoutbox.Off / txoutbox.Forever) is accepted and kept by WithDefaults exactly where
//     the field says so, and refused, naming the field, everywhere else;
//   - -2 is refused everywhere, naming the field; so are NaN, +Inf and -Inf in a float field.
//
// Every numeric kind counts (an unsigned field fails: it cannot follow the rule), and the
// fields of nested structs too.
func TestEveryNumericFieldFollowsTheConvention(t *testing.T) {
	t.Parallel()
	for _, c := range components() {
		typ := reflect.TypeOf(c.fresh()).Elem()
		seen := map[string]bool{}
		bad := func(name, why string) { t.Errorf("%s Config.%s %s", c.name, name, why) }
		for _, f := range numericFields(typ, "", nil, bad) {
			name := c.name + " Config." + f.name
			seen[f.name] = true
			rule, ok := c.rules[f.name]
			if !ok {
				t.Errorf("%s is not listed here: state its default and whether it takes -1", name)
				continue
			}
			field := func(cfg any) reflect.Value { return reflect.ValueOf(cfg).Elem().FieldByIndex(f.index) }
			with := func(v float64) any {
				cfg := c.fresh()
				if fv := field(cfg); fv.CanFloat() {
					fv.SetFloat(v)
				} else {
					fv.SetInt(int64(v))
				}
				return cfg
			}

			if rule.def != derived {
				got := field(c.defaults(with(0)))
				want := reflect.ValueOf(rule.def).Convert(f.typ)
				if !got.Equal(want) {
					t.Errorf("%s = 0 became %v after WithDefaults, want the Default constant %v", name, got, want)
				}
			} else if got := field(c.defaults(with(0))); got.IsZero() {
				t.Errorf("%s = 0 did not take its derived default", name)
			}

			err := c.validate(with(-1))
			var ce *txoutbox.ConfigError
			switch {
			case rule.minus1 && err != nil:
				t.Errorf("%s = -1 refused: %v", name, err)
			case rule.minus1:
				if got := field(c.defaults(with(-1))); !got.Equal(reflect.ValueOf(-1).Convert(f.typ)) {
					t.Errorf("%s = -1 became %v after WithDefaults", name, got)
				}
			case !errors.As(err, &ce) || ce.Field != "Config."+f.name || ce.Package != c.name:
				t.Errorf("%s = -1: got %v, want a ConfigError naming it (it has no off or forever value)", name, err)
			}
			bads := []float64{-2}
			if f.typ.Kind() == reflect.Float32 || f.typ.Kind() == reflect.Float64 {
				bads = append(bads, math.NaN(), math.Inf(1), math.Inf(-1))
			}
			for _, v := range bads {
				if err := c.validate(with(v)); !errors.As(err, &ce) || ce.Field != "Config."+f.name || ce.Package != c.name {
					t.Errorf("%s = %g: got %v, want a ConfigError naming it", name, v, err)
				}
			}
		}
		for f := range c.rules {
			if !seen[f] {
				t.Errorf("%s Config.%s is listed here but is not a numeric field", c.name, f)
			}
		}
	}
	// Jitter is one range everywhere: (0, 1), 0 being the default and txoutbox.Off none.
	for _, err := range []error{
		relay.ValidateConfig(&relay.Config{BackoffJitter: 1}),
		checkback.ValidateConfig(&checkback.Config{BackoffJitter: 1}),
		consumer.ValidateConfig(&consumer.Config{Stream: "S", Durable: "d", BackoffJitter: 1}),
	} {
		if !errors.Is(err, txoutbox.ErrInvalidConfig) {
			t.Errorf("a jitter of 1 was accepted: %v", err)
		}
	}
}

// noDefault lists the Config fields whose documentation states no default, each with the
// reason: the field is required, or its zero value is itself the documented behaviour.
var noDefault = map[string]string{
	"consumer Config.Stream":  "required: there is no stream a consumer could assume",
	"consumer Config.Durable": "required: the consumer's name, which keys its dedup rows",
	"checker Config.Outbox":   "required: the outbox identity must match the check-back's, which no default can guess",
}

// configDocs parses the non-test Go files of the module's public packages (everything but
// internal/, cmd/ and testdata) and returns, per package name, the documentation of each field
// of its type Config (a field without a comment of its own shares the comment of the field on
// the line above, as in "BackoffBase, BackoffMax and BackoffJitter ...").
func configDocs(t *testing.T) map[string]map[string]string {
	t.Helper()
	out := map[string]map[string]string{}
	fset := token.NewFileSet()
	err := filepath.WalkDir(".", func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			if path != "." && (strings.HasPrefix(d.Name(), ".") || d.Name() == "internal" || d.Name() == "cmd" || d.Name() == "testdata") {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
			return nil
		}
		f, err := parser.ParseFile(fset, path, nil, parser.ParseComments)
		if err != nil {
			return err
		}
		for _, decl := range f.Decls {
			gd, ok := decl.(*ast.GenDecl)
			if !ok || gd.Tok != token.TYPE {
				continue
			}
			for _, spec := range gd.Specs {
				ts := spec.(*ast.TypeSpec)
				st, ok := ts.Type.(*ast.StructType)
				if ts.Name.Name != "Config" || !ok {
					continue
				}
				fields := map[string]string{}
				prevDoc, prevLine := "", -1
				for _, fld := range st.Fields.List {
					line := fset.Position(fld.Pos()).Line
					doc := fld.Doc.Text()
					if doc == "" && line == prevLine+1 {
						doc = prevDoc
					}
					for _, n := range fld.Names {
						if n.IsExported() {
							fields[n.Name] = doc
						}
					}
					prevDoc, prevLine = doc, fset.Position(fld.End()).Line
				}
				out[f.Name.Name] = fields
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// Every public package's Config is covered by the convention tests, and every Config field's
// documentation states its default ("Defaults to …", unless listed in noDefault with the
// reason) and, where the field takes -1, what -1 means.
func TestEveryConfigIsCoveredAndDocumented(t *testing.T) {
	t.Parallel()
	docs := configDocs(t)
	byName := map[string]component{}
	for _, c := range components() {
		byName[c.name] = c
	}
	for pkg := range docs {
		if _, ok := byName[pkg]; !ok {
			t.Errorf("package %s has a Config that components() does not list: add it", pkg)
		}
	}
	for name, c := range byName {
		fields, ok := docs[name]
		if !ok {
			t.Errorf("components() lists %s, whose Config the source walk did not find", name)
			continue
		}
		typ := reflect.TypeOf(c.fresh()).Elem()
		for i := 0; i < typ.NumField(); i++ {
			f := typ.Field(i)
			if !f.IsExported() {
				continue
			}
			doc := strings.Join(strings.Fields(fields[f.Name]), " ")
			id := name + " Config." + f.Name
			if _, ok := noDefault[id]; !ok && !strings.Contains(doc, "Defaults to") {
				t.Errorf("%s: its documentation states no default (\"Defaults to …\"): %q", id, doc)
			}
			if c.rules[f.Name].minus1 && !strings.Contains(doc, "txoutbox.Off") && !strings.Contains(doc, "txoutbox.Forever") {
				t.Errorf("%s takes -1 but its documentation does not say what txoutbox.Off or txoutbox.Forever means: %q", id, doc)
			}
		}
	}
	for id, why := range noDefault {
		if why == "" {
			t.Errorf("noDefault[%s] gives no reason", id)
		}
	}
}

// Every component exposes its effective Config the same way: WithDefaults, ValidateConfig and
// a Config accessor on what New returns.
func TestEveryComponentReturnsItsEffectiveConfig(t *testing.T) {
	t.Parallel()
	c, err := outbox.NewClient(&outbox.Config{Schema: "s1"})
	if err != nil {
		t.Fatal(err)
	}
	if got := c.Config(); got.Schema != "s1" || got.MaxMessageBytes != outbox.DefaultMaxMessageBytes {
		t.Errorf("outbox Client.Config() = %+v", got)
	}
	m, err := migrations.New(nil)
	if err != nil {
		t.Fatal(err)
	}
	if got := m.Config(); got.Schema != txoutbox.DefaultSchema {
		t.Errorf("migrations Migrator.Config().Schema = %q, want %q", got.Schema, txoutbox.DefaultSchema)
	}
	for name, err := range map[string]error{
		"outbox":     outbox.ValidateConfig(nil),
		"migrations": migrations.ValidateConfig(nil),
		"relay":      relay.ValidateConfig(nil),
		"checkback":  checkback.ValidateConfig(nil),
		"checker":    checker.ValidateConfig(&checker.Config{Outbox: "o"}),
		"consumer":   consumer.ValidateConfig(&consumer.Config{Stream: "S", Durable: "d"}),
	} {
		if err != nil {
			t.Errorf("%s: the defaults are invalid: %v", name, err)
		}
	}
}

// One stream and consumer name rule: relay.Config.CreateStream and consumer.Config.Stream and
// Durable accept and refuse the same names, JetStream's (at most 255 bytes, no '.', '*', '>',
// white space or path separators), each refusal naming its field.
func TestOneStreamNameRule(t *testing.T) {
	t.Parallel()
	type check struct {
		field    string
		validate func(name string) error
	}
	checks := []check{
		{"Config.CreateStream", func(n string) error {
			return relay.ValidateConfig(&relay.Config{CreateStream: n, Subjects: []string{"orders.>"}})
		}},
		{"Config.Stream", func(n string) error {
			return consumer.ValidateConfig(&consumer.Config{Stream: n, Durable: "d"})
		}},
		{"Config.Durable", func(n string) error {
			return consumer.ValidateConfig(&consumer.Config{Stream: "S", Durable: n})
		}},
	}
	for _, c := range checks {
		for _, ok := range []string{"ORDERS", "orders-v2_eu", strings.Repeat("s", 255)} {
			if err := c.validate(ok); err != nil {
				t.Errorf("%s %q refused: %v", c.field, ok, err)
			}
		}
		for _, bad := range []string{strings.Repeat("s", 256), "a.b", "a*", "a>", "a b", "a/b", `a\b`} {
			var ce *txoutbox.ConfigError
			if err := c.validate(bad); !errors.As(err, &ce) || ce.Field != c.field {
				t.Errorf("%s %.20q: got %v, want a ConfigError naming it", c.field, bad, err)
			}
		}
	}
}

// Where two packages share a default, one is defined as the other: they cannot drift.
func TestSharedDefaultsAgree(t *testing.T) {
	t.Parallel()
	if checkback.DefaultRequestTimeout != checker.DefaultRequestTimeout {
		t.Errorf("checkback.DefaultRequestTimeout %s, checker.DefaultRequestTimeout %s", checkback.DefaultRequestTimeout, checker.DefaultRequestTimeout)
	}
	if checkback.DefaultSubjectPrefix != checker.DefaultSubjectPrefix {
		t.Errorf("checkback.DefaultSubjectPrefix %q, checker.DefaultSubjectPrefix %q", checkback.DefaultSubjectPrefix, checker.DefaultSubjectPrefix)
	}
	if relay.DefaultDoorbellSubject != outbox.DefaultDoorbellSubject {
		t.Errorf("relay.DefaultDoorbellSubject %q, outbox.DefaultDoorbellSubject %q", relay.DefaultDoorbellSubject, outbox.DefaultDoorbellSubject)
	}
	if migrations.DownAll != txoutbox.Forever {
		t.Errorf("migrations.DownAll %d, want txoutbox.Forever", migrations.DownAll)
	}
}

// A nil argument to a constructor is reported like an invalid field: a *txoutbox.ConfigError
// naming the argument (a typed nil pointer in an interface too).
func TestNilArgumentsAreConfigErrors(t *testing.T) {
	t.Parallel()
	pool, err := pgxpool.New(context.Background(), "postgres://127.0.0.1:1/none") // never connects
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	var js jetstream.JetStream = struct{ jetstream.JetStream }{} // never used: New refuses first
	apply := func(context.Context, pgx.Tx, consumer.Message) error { return nil }
	applySQL := func(context.Context, *sql.Tx, consumer.Message) error { return nil }
	answer := func(context.Context, checker.Request) (outbox.LocalState, error) { return outbox.StateUnknown, nil }
	cfg := &consumer.Config{Stream: "S", Durable: "d"}
	for _, tc := range []struct {
		pkg, arg string
		err      error
	}{
		{"relay", "pool", func() error { _, err := relay.New(nil, js, nil); return err }()},
		{"relay", "js", func() error { _, err := relay.New(pool, nil, nil); return err }()},
		{"consumer", "db", func() error { _, err := consumer.New(nil, js, apply, cfg); return err }()},
		{"consumer", "db", func() error { _, err := consumer.New((*pgxpool.Pool)(nil), js, apply, cfg); return err }()},
		{"consumer", "js", func() error { _, err := consumer.New(pool, nil, apply, cfg); return err }()},
		{"consumer", "handler", func() error { _, err := consumer.New(pool, js, nil, cfg); return err }()},
		{"consumer", "db", func() error { _, err := consumer.NewSQL(nil, js, applySQL, cfg); return err }()},
		{"consumer", "handler", func() error { _, err := consumer.NewSQL(new(sql.DB), js, nil, cfg); return err }()},
		{"consumer", "handler", func() error { _, err := consumer.NewBatch(pool, js, nil, cfg); return err }()},
		{"checkback", "db", func() error { _, err := checkback.New(nil, nil, nil); return err }()},
		{"checkback", "db", func() error { _, err := checkback.New((*pgxpool.Pool)(nil), nil, nil); return err }()},
		{"checker", "nc", func() error { _, err := checker.Serve(nil, "g", answer, nil); return err }()},
		{"checker", "check", func() error { _, err := checker.Serve(new(nats.Conn), "g", nil, nil); return err }()},
		{"outbox", "nc", outbox.NewNATSDoorbell(nil, "").Err()},
		{"outbox", "db", outbox.NewPostgresDoorbell(nil, "").Err()},
		{"outbox", "db", outbox.NewPostgresSQLDoorbell(nil, "").Err()},
	} {
		var ce *txoutbox.ConfigError
		if !errors.As(tc.err, &ce) || ce.Package != tc.pkg || ce.Field != tc.arg || !errors.Is(tc.err, txoutbox.ErrInvalidConfig) {
			t.Errorf("%s: nil %s: got %v (%T), want a *txoutbox.ConfigError naming it", tc.pkg, tc.arg, tc.err, tc.err)
		}
	}
}

// A validation failure with a sentinel behind it keeps the sentinel as ConfigError.Err, so
// errors.Is finds both ErrInvalidConfig and it.
func TestConfigErrorsKeepTheirSentinel(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		field string
		err   error
	}{
		{"relay Config.DoorbellSubject", relay.ValidateConfig(&relay.Config{DoorbellSubject: "a..b"})},
		{"relay Config.Subjects", relay.ValidateConfig(&relay.Config{Subjects: []string{"a..b"}})},
		{"consumer Config.FilterSubjects", consumer.ValidateConfig(&consumer.Config{Stream: "S", Durable: "d", FilterSubjects: []string{"a..b"}})},
		{"consumer Config.DeadLetterSubject", consumer.ValidateConfig(&consumer.Config{Stream: "S", Durable: "d", DeadLetterSubject: "dead.*"})},
		{"checkback Config.SubjectPrefix", checkback.ValidateConfig(&checkback.Config{SubjectPrefix: "a..b"})},
		{"checker Config.SubjectPrefix", checker.ValidateConfig(&checker.Config{Outbox: "o", SubjectPrefix: "a..b"})},
	} {
		if !errors.Is(tc.err, txoutbox.ErrInvalidConfig) || !errors.Is(tc.err, outbox.ErrInvalidSubject) {
			t.Errorf("%s: %v matches ErrInvalidConfig %v and outbox.ErrInvalidSubject %v, want both", tc.field,
				tc.err, errors.Is(tc.err, txoutbox.ErrInvalidConfig), errors.Is(tc.err, outbox.ErrInvalidSubject))
		}
	}
}

// Every numeric field whose validator refuses the largest value, or the smallest positive
// one (1, one nanosecond for a duration), says so in its documentation: "at most …" or
// "at least …" (a float field: its range, "in (…)"). A bound the validator enforces and the
// field's doc leaves out is one the user finds only by failing.
func TestEveryNumericBoundIsDocumented(t *testing.T) {
	t.Parallel()
	docs := configDocs(t)
	for _, c := range components() {
		typ := reflect.TypeOf(c.fresh()).Elem()
		for _, f := range numericFields(typ, "", nil, func(string, string) {}) {
			doc := strings.ToLower(strings.Join(strings.Fields(docs[c.name][f.name]), " "))
			name := c.name + " Config." + f.name
			isFloat := f.typ.Kind() == reflect.Float32 || f.typ.Kind() == reflect.Float64
			refused := func(v float64) bool {
				cfg := c.fresh()
				fv := reflect.ValueOf(cfg).Elem().FieldByIndex(f.index)
				if isFloat {
					fv.SetFloat(v)
				} else if v >= math.MaxInt64 {
					fv.SetInt(math.MaxInt64)
				} else {
					fv.SetInt(int64(v))
				}
				var ce *txoutbox.ConfigError
				return errors.As(c.validate(cfg), &ce) && ce.Field == "Config."+f.name
			}
			if isFloat {
				if (refused(math.MaxFloat64) || refused(math.SmallestNonzeroFloat64)) && !strings.Contains(doc, "in (") && !strings.Contains(doc, "in [") {
					t.Errorf("%s: the validator bounds it, its documentation states no range: %q", name, doc)
				}
				continue
			}
			if refused(math.MaxInt64) && !strings.Contains(doc, "at most") {
				t.Errorf("%s: the validator refuses the largest value, its documentation says no \"at most\": %q", name, doc)
			}
			if refused(1) && !strings.Contains(doc, "at least") {
				t.Errorf("%s: the validator refuses 1, its documentation says no \"at least\": %q", name, doc)
			}
		}
	}
}

// Every Config.Schema is validated by migrations.ValidateSchemaName (at most 63 bytes, no NUL
// byte), and every one's documentation states that bound in the same words.
func TestEverySchemaBoundIsDocumented(t *testing.T) {
	t.Parallel()
	docs := configDocs(t)
	for _, c := range components() {
		f, ok := reflect.TypeOf(c.fresh()).Elem().FieldByName("Schema")
		if !ok {
			continue
		}
		doc := strings.Join(strings.Fields(docs[c.name]["Schema"]), " ")
		if !strings.Contains(doc, "at most 63 bytes, no NUL byte") {
			t.Errorf("%s Config.Schema: its documentation does not say \"at most 63 bytes, no NUL byte\": %q", c.name, doc)
		}
		for _, bad := range []string{strings.Repeat("s", 64), "out\x00box"} {
			cfg := c.fresh()
			reflect.ValueOf(cfg).Elem().FieldByIndex(f.Index).SetString(bad)
			var ce *txoutbox.ConfigError
			if err := c.validate(cfg); !errors.As(err, &ce) || ce.Field != "Config.Schema" {
				t.Errorf("%s Config.Schema %q: %v, want a *txoutbox.ConfigError naming Config.Schema", c.name, bad, err)
			}
		}
	}
}

// A field set alone above the default of the field that must be at least it is valid: that
// field's default follows it (PollMin: 2s alone failed on PollMax; BackoffBase above the
// default BackoffMax alone failed on BackoffMax, in the relay, the consumer and the
// check-back).
func TestRelatedDefaultsFollowTheFieldSet(t *testing.T) {
	t.Parallel()
	const base = 10 * time.Minute // above every default BackoffMax
	if c := (&relay.Config{PollMin: 2 * time.Second}).WithDefaults(); c.PollMax != 2*time.Second {
		t.Errorf("relay PollMin 2s alone: PollMax %s, want 2s", c.PollMax)
	}
	if c := (&relay.Config{BackoffBase: base}).WithDefaults(); c.BackoffMax != base {
		t.Errorf("relay BackoffBase %s alone: BackoffMax %s", base, c.BackoffMax)
	}
	if c := (&consumer.Config{Stream: "S", Durable: "d", BackoffBase: base}).WithDefaults(); c.BackoffMax != base {
		t.Errorf("consumer BackoffBase %s alone: BackoffMax %s", base, c.BackoffMax)
	}
	if c := (&checkback.Config{BackoffBase: base}).WithDefaults(); c.BackoffMax != base {
		t.Errorf("checkback BackoffBase %s alone: BackoffMax %s", base, c.BackoffMax)
	}
	for name, err := range map[string]error{
		"relay PollMin":         relay.ValidateConfig(&relay.Config{PollMin: 2 * time.Second}),
		"relay BackoffBase":     relay.ValidateConfig(&relay.Config{BackoffBase: base}),
		"consumer BackoffBase":  consumer.ValidateConfig(&consumer.Config{Stream: "S", Durable: "d", BackoffBase: base}),
		"checkback BackoffBase": checkback.ValidateConfig(&checkback.Config{BackoffBase: base}),
	} {
		if err != nil {
			t.Errorf("%s set alone: %v", name, err)
		}
	}
}

// BackoffBase and BackoffMax are at most a day in every component, a refusal naming the field.
func TestBackoffIsAtMostADay(t *testing.T) {
	t.Parallel()
	const day, over = 24 * time.Hour, 24*time.Hour + time.Nanosecond
	newConsumer := func(base, max time.Duration) *consumer.Config {
		return &consumer.Config{Stream: "S", Durable: "d", BackoffBase: base, BackoffMax: max}
	}
	for _, tc := range []struct {
		pkg, field string
		err        error
	}{
		{"relay", "", relay.ValidateConfig(&relay.Config{BackoffBase: day, BackoffMax: day})},
		{"relay", "Config.BackoffMax", relay.ValidateConfig(&relay.Config{BackoffMax: over})},
		{"relay", "Config.BackoffMax", relay.ValidateConfig(&relay.Config{BackoffMax: math.MaxInt64})},
		{"relay", "Config.BackoffBase", relay.ValidateConfig(&relay.Config{BackoffBase: over})},
		{"consumer", "", consumer.ValidateConfig(newConsumer(day, day))},
		{"consumer", "Config.BackoffMax", consumer.ValidateConfig(newConsumer(0, over))},
		{"consumer", "Config.BackoffBase", consumer.ValidateConfig(newConsumer(over, 0))},
		{"checkback", "", checkback.ValidateConfig(&checkback.Config{BackoffBase: day, BackoffMax: day})},
		{"checkback", "Config.BackoffMax", checkback.ValidateConfig(&checkback.Config{BackoffMax: over})},
		{"checkback", "Config.BackoffBase", checkback.ValidateConfig(&checkback.Config{BackoffBase: over})},
	} {
		var ce *txoutbox.ConfigError
		switch {
		case tc.field == "" && tc.err != nil:
			t.Errorf("%s: a day refused: %v", tc.pkg, tc.err)
		case tc.field != "" && (!errors.As(tc.err, &ce) || ce.Package != tc.pkg || ce.Field != tc.field):
			t.Errorf("%s %s: got %v, want a ConfigError naming it", tc.pkg, tc.field, tc.err)
		}
	}
}

// Of several invalid check-back schedules, the same one is reported every time: the first in
// the fields' order (they were checked in a map's random order).
func TestCheckbackScheduleErrorIsStable(t *testing.T) {
	t.Parallel()
	cfg := &checkback.Config{ResolveSchedule: "bad", StaleSchedule: "bad", PurgeSchedule: "bad"}
	for range 50 {
		var ce *txoutbox.ConfigError
		if err := checkback.ValidateConfig(cfg); !errors.As(err, &ce) || ce.Field != "Config.ResolveSchedule" {
			t.Fatalf("got %v, want Config.ResolveSchedule every time", err)
		}
	}
	cfg.ResolveSchedule = ""
	for range 50 {
		var ce *txoutbox.ConfigError
		if err := checkback.ValidateConfig(cfg); !errors.As(err, &ce) || ce.Field != "Config.StaleSchedule" {
			t.Fatalf("got %v, want Config.StaleSchedule every time", err)
		}
	}
}

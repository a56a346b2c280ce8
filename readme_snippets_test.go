package txoutbox_test

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"go/ast"
	"go/importer"
	"go/parser"
	"go/token"
	"go/types"
	"io"
	"maps"
	"os"
	"os/exec"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"

	"github.com/txoutbox/txoutbox/internal/testsvc"
)

// readmeSnippetPreamble declares what the README's Go snippets use without declaring it: the
// handles and values of the surrounding service. Each snippet is compiled as the body of a
// function returning error (so `return err` works), in a package holding these declarations;
// a snippet's own declarations shadow them. Add a name here only for what a reader has in
// hand at that point of the README (a pool, a NATS connection, the business values), never
// to hide a mistake in a snippet.
const readmeSnippetPreamble = `package snippets

import (
	"context"
	"database/sql"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jmoiron/sqlx"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"gorm.io/gorm"

	"github.com/txoutbox/txoutbox/outbox"
)

var (
	ctx      context.Context
	pool     *pgxpool.Pool     // the service's pgx pool
	db       *sql.DB           // the service's database/sql handle
	sqlxDB   *sqlx.DB          // the same, through sqlx
	gdb      *gorm.DB          // the same, through GORM
	tx       pgx.Tx            // a business transaction begun on pool
	nc       *nats.Conn        // the service's NATS connection
	js       jetstream.JetStream
	client   *outbox.Client    // from outbox.NewClient
	msg      outbox.Message    // a message built by the service
	exporter sdktrace.SpanExporter

	// Business values.
	id, orderID string
	total       int
	amount      int64
	body        []byte
	shipment    struct{ ID string }
	provider    interface {
		Charge(ctx context.Context, orderID, ref string) error
		Lookup(ctx context.Context, ref string) (charged, known bool, err error)
	}
)
`

// readmeSnippetImports are the packages the snippets may name, by the name they use: a
// snippet gets the imports of the names it uses.
var readmeSnippetImports = map[string]string{
	"context":     "context",
	"errors":      "errors",
	"fmt":         "fmt",
	"slog":        "log/slog",
	"strconv":     "strconv",
	"time":        "time",
	"sql":         "database/sql",
	"pgx":         "github.com/jackc/pgx/v5",
	"pgxpool":     "github.com/jackc/pgx/v5/pgxpool",
	"sqlx":        "github.com/jmoiron/sqlx",
	"gorm":        "gorm.io/gorm",
	"nats":        "github.com/nats-io/nats.go",
	"jetstream":   "github.com/nats-io/nats.go/jetstream",
	"otel":        "go.opentelemetry.io/otel",
	"propagation": "go.opentelemetry.io/otel/propagation",
	"sdktrace":    "go.opentelemetry.io/otel/sdk/trace",
	"uuid":        "github.com/google/uuid",
	"txoutbox":    "github.com/txoutbox/txoutbox",
	"outbox":      "github.com/txoutbox/txoutbox/outbox",
	"checker":     "github.com/txoutbox/txoutbox/outbox/checker",
	"consumer":    "github.com/txoutbox/txoutbox/consumer",
	"checkback":   "github.com/txoutbox/txoutbox/checkback",
	"relay":       "github.com/txoutbox/txoutbox/relay",
	"migrations":  "github.com/txoutbox/txoutbox/migrations",
}

// notCompiled marks a ```go block that is deliberately not compilable Go (a signature
// sketch): the line before the fence must be this comment, with a reason.
var notCompiled = regexp.MustCompile(`^<!-- not compiled: (\S.*) -->$`)

// readmeSnippet is one ```go block of README.md.
type readmeSnippet struct {
	line int    // of the opening fence
	code string // without the fence's indentation
	skip string // the not-compiled reason, if any
}

// readmeSnippets returns the ```go blocks of the markdown in r.
func readmeSnippets(t *testing.T, r io.Reader) []readmeSnippet {
	t.Helper()
	var out []readmeSnippet
	var cur *readmeSnippet
	var indent, prev string
	sc := bufio.NewScanner(r)
	for n := 1; sc.Scan(); n++ {
		line := sc.Text()
		trimmed := strings.TrimSpace(line)
		switch {
		case cur == nil && trimmed == "```go":
			indent = line[:len(line)-len(strings.TrimLeft(line, " \t"))]
			cur = &readmeSnippet{line: n}
			if m := notCompiled.FindStringSubmatch(strings.TrimSpace(prev)); m != nil {
				cur.skip = m[1]
			}
		case cur != nil && trimmed == "```":
			out = append(out, *cur)
			cur = nil
		case cur != nil:
			cur.code += strings.TrimPrefix(line, indent) + "\n"
		}
		if trimmed != "" {
			prev = line
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	if cur != nil {
		t.Fatalf("README.md:%d: a ```go block that is never closed", cur.line)
	}
	return out
}

// TestReadmeGoSnippetsCompile type-checks every ```go block of README.md as the body of a
// function (see readmeSnippetPreamble) against the module's packages, and refuses a call
// whose error is dropped (a statement, defer or go of a call that returns an error): the
// README's code is what users copy.
func TestReadmeGoSnippetsCompile(t *testing.T) {
	t.Parallel()
	f, err := os.Open("README.md")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	snippets := readmeSnippets(t, f)
	if len(snippets) < 5 {
		t.Fatalf("found %d ```go blocks in README.md; the extraction is broken", len(snippets))
	}
	problems, err := checkReadmeSnippets(snippets)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range problems {
		t.Error(p)
	}
}

// checkReadmeSnippets type-checks snippets and returns what is wrong with them, each problem
// naming its README line.
func checkReadmeSnippets(snippets []readmeSnippet) ([]string, error) {
	fset := token.NewFileSet()
	pre, err := parser.ParseFile(fset, "readme_preamble.go", readmeSnippetPreamble, parser.ParseComments)
	if err != nil {
		return nil, fmt.Errorf("the preamble: %w", err)
	}
	files := []*ast.File{pre}
	paths := map[string]bool{}
	for _, imp := range pre.Imports {
		paths[strings.Trim(imp.Path.Value, `"`)] = true
	}
	var problems []string
	for i, s := range snippets {
		if s.skip != "" {
			continue
		}
		// Parse once without imports to find the package names the snippet uses, then
		// again with them, the function starting at the fence's line so that positions
		// are the README's.
		body := fmt.Sprintf("func readmeSnippet%d() error {\n%sreturn nil\n}\n", i, s.code)
		probe, err := parser.ParseFile(fset, "", "package snippets\n"+body, 0)
		if err != nil {
			problems = append(problems, fmt.Sprintf("README.md:%d: the ```go block does not parse: %v (mark a sketch with <!-- not compiled: reason -->)", s.line, err))
			continue
		}
		var imports []string
		for _, name := range usedPackages(probe) {
			imports = append(imports, fmt.Sprintf("import %s %q\n", name, readmeSnippetImports[name]))
			paths[readmeSnippetImports[name]] = true
		}
		src := "package snippets\n" + strings.Join(imports, "") + "//line README.md:" + fmt.Sprint(s.line) + "\n" + body
		file, err := parser.ParseFile(fset, fmt.Sprintf("readme_snippet_%d.go", i), src, 0)
		if err != nil {
			return nil, fmt.Errorf("README.md:%d: %w", s.line, err)
		}
		files = append(files, file)
	}
	if len(problems) > 0 {
		return problems, nil
	}
	lookup, err := exportData(slices.Sorted(maps.Keys(paths)))
	if err != nil {
		return nil, err
	}
	info := &types.Info{Types: map[ast.Expr]types.TypeAndValue{}}
	conf := types.Config{
		Importer: importer.ForCompiler(fset, "gc", lookup),
		Error: func(err error) {
			problems = append(problems, err.Error())
		},
	}
	_, _ = conf.Check("snippets", fset, files, info) // the errors are in problems
	for _, file := range files[1:] {
		problems = append(problems, droppedErrors(fset, file, info)...)
	}
	sort.Strings(problems)
	return problems, nil
}

// usedPackages returns the names of readmeSnippetImports that f uses as a package: X in an
// X.Sel whose X the file does not declare.
func usedPackages(f *ast.File) []string {
	seen := map[string]bool{}
	ast.Inspect(f, func(n ast.Node) bool {
		if sel, ok := n.(*ast.SelectorExpr); ok {
			if id, ok := sel.X.(*ast.Ident); ok && id.Obj == nil && readmeSnippetImports[id.Name] != "" {
				seen[id.Name] = true
			}
		}
		return true
	})
	return slices.Sorted(maps.Keys(seen))
}

// droppedErrors reports the calls of f whose error result is thrown away without a word: an
// expression statement, a defer or a go statement of a call that returns an error. (An
// explicit `_ =` is a decision the reader sees, and is allowed.)
func droppedErrors(fset *token.FileSet, f *ast.File, info *types.Info) []string {
	errType := types.Universe.Lookup("error").Type()
	returnsError := func(call *ast.CallExpr) bool {
		tv, ok := info.Types[call]
		if !ok || tv.Type == nil {
			return false
		}
		switch t := tv.Type.(type) {
		case *types.Tuple:
			return t.Len() > 0 && types.Identical(t.At(t.Len()-1).Type(), errType)
		default:
			return types.Identical(t, errType)
		}
	}
	var out []string
	ast.Inspect(f, func(n ast.Node) bool {
		var call *ast.CallExpr
		var what string
		switch s := n.(type) {
		case *ast.ExprStmt:
			call, _ = s.X.(*ast.CallExpr)
			what = "a call"
		case *ast.DeferStmt:
			call, what = s.Call, "a deferred call"
		case *ast.GoStmt:
			call, what = s.Call, "a go statement"
		}
		if call != nil && returnsError(call) {
			out = append(out, fmt.Sprintf("%s: %s drops its error: %s", fset.Position(call.Pos()), what, types.ExprString(call.Fun)))
		}
		return true
	})
	return out
}

// exportData returns an importer lookup of the compiled export data of paths and their
// dependencies, as `go list -export` builds them (from the build cache after the first run).
func exportData(paths []string) (func(path string) (io.ReadCloser, error), error) {
	cmd := exec.Command(testsvc.GoTool(), append([]string{"list", "-export", "-deps", "-json=ImportPath,Export,Error"}, paths...)...)
	cmd.Env = append(os.Environ(), "GOPROXY=off") // offline: the module cache has what the module needs
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("go list -export: %w\n%s", err, stderr.String())
	}
	files := map[string]string{}
	dec := json.NewDecoder(bytes.NewReader(out))
	for {
		var p struct {
			ImportPath, Export string
			Error              *struct{ Err string }
		}
		if err := dec.Decode(&p); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			return nil, err
		}
		if p.Error != nil {
			return nil, fmt.Errorf("go list: %s: %s", p.ImportPath, p.Error.Err)
		}
		files[p.ImportPath] = p.Export
	}
	return func(path string) (io.ReadCloser, error) {
		file, ok := files[path]
		if !ok || file == "" {
			return nil, fmt.Errorf("no export data for %q", path)
		}
		return os.Open(file)
	}, nil
}

// The checker itself: it finds what the README's snippets used to get wrong (an error never
// checked, := with nothing new, a dropped error, a method of another type), skips a block
// marked as a sketch, and passes a correct one.
func TestReadmeSnippetCheckerFindsMistakes(t *testing.T) {
	t.Parallel()
	md := "text\n\n```go\n" +
		"client, err := outbox.NewClient(nil)\n" + // err never checked
		"tx, err := pool.Begin(ctx)\n" +
		"defer tx.Rollback(ctx)\n" + // dropped error
		"client.Ring()\n" +
		"```\n\n<!-- not compiled: a signature sketch -->\n```go\nfunc Sketch(ctx, …) error\n```\n\n" +
		"  ```go\n  err := gdb.WithContext(ctx).Error\n  err := db.Ping()\n  return err\n  ```\n\n" + // indented; no new variables
		"```go\nif err := db.PingContext(ctx); err != nil {\n\treturn err\n}\n```\n"
	snippets := readmeSnippets(t, strings.NewReader(md))
	if len(snippets) != 4 || snippets[1].skip != "a signature sketch" || snippets[0].line != 3 {
		t.Fatalf("extracted %+v", snippets)
	}
	problems, err := checkReadmeSnippets(snippets)
	if err != nil {
		t.Fatal(err)
	}
	got := strings.Join(problems, "\n")
	for _, want := range []string{
		"README.md:4: declared and not used: err",
		"README.md:6: a deferred call drops its error: tx.Rollback",
		"README.md:17: no new variables on left side of :=",
	} {
		if !strings.Contains(got, want) {
			t.Errorf("problems do not include %q:\n%s", want, got)
		}
	}
	if len(problems) != 3 {
		t.Errorf("%d problems, want the 3 above (none in the sketch or the correct block):\n%s", len(problems), got)
	}
}

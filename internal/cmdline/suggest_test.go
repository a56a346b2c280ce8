package cmdline

import (
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// Every admin command a component suggests to an operator (in a log line, an error, the
// status page, /status.json, relay status) is built with Command, so that it names the
// outbox's schema: a suggestion without --schema acts on the default schema's outbox instead
// (or, after the `relay migrate up` it then advises, on a new empty one). The test looks at
// every string literal of the module's non-test code that names an admin command and
// requires it to be an argument of Command. Left out: the relay's own usage texts
// (internal/relaycli, which describe the flags, --schema included) and package migrations
// (the generated grants script's header and the export advice, which need no schema).
func TestEverySuggestedCommandNamesTheSchema(t *testing.T) {
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	cmd := regexp.MustCompile(`relay (dead|prepared|scheduled|migrate|status|checkback)\b`)
	skip := map[string]bool{"internal/relaycli": true, "migrations": true, "cmd": true}
	var bad []string
	seen := 0
	err = filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		if d.IsDir() {
			if skip[filepath.ToSlash(rel)] || d.Name() == "testdata" || strings.HasPrefix(d.Name(), ".") && rel != "." {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(p, ".go") || strings.HasSuffix(p, "_test.go") {
			return nil
		}
		fset := token.NewFileSet()
		f, err := parser.ParseFile(fset, p, nil, 0)
		if err != nil {
			return err
		}
		built := map[*ast.BasicLit]bool{}
		ast.Inspect(f, func(n ast.Node) bool {
			call, ok := n.(*ast.CallExpr)
			if !ok {
				return true
			}
			name := ""
			switch fn := call.Fun.(type) {
			case *ast.Ident:
				name = fn.Name
			case *ast.SelectorExpr:
				if x, ok := fn.X.(*ast.Ident); ok {
					name = x.Name + "." + fn.Sel.Name
				}
			}
			if name == "cmdline.Command" || name == "Command" && f.Name.Name == "cmdline" {
				for _, a := range call.Args {
					if lit, ok := a.(*ast.BasicLit); ok {
						built[lit] = true
					}
				}
			}
			return true
		})
		ast.Inspect(f, func(n ast.Node) bool {
			lit, ok := n.(*ast.BasicLit)
			if !ok || lit.Kind != token.STRING || !cmd.MatchString(lit.Value) {
				return true
			}
			seen++
			if !built[lit] {
				bad = append(bad, fset.Position(lit.Pos()).String()+": "+lit.Value)
			}
			return true
		})
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if seen < 5 {
		t.Fatalf("found only %d suggested commands: the walk missed the sources", seen)
	}
	for _, b := range bad {
		t.Errorf("a command suggested without cmdline.Command (it would not name the schema): %s", strings.TrimPrefix(b, root+"/"))
	}
}

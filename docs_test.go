package txoutbox_test

import (
	"go/ast"
	"go/doc"
	"go/parser"
	"go/token"
	"io/fs"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// publicPackageDirs lists the directories of the module's public packages: everything but
// internal/, cmd/, testdata and hidden directories, with non-test Go files.
func publicPackageDirs(t *testing.T) []string {
	t.Helper()
	var dirs []string
	err := filepath.WalkDir(".", func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if !d.IsDir() {
			return nil
		}
		if path != "." && (strings.HasPrefix(d.Name(), ".") || d.Name() == "internal" || d.Name() == "cmd" || d.Name() == "testdata") {
			return filepath.SkipDir
		}
		if m, _ := filepath.Glob(filepath.Join(path, "*.go")); len(m) > 0 {
			dirs = append(dirs, path)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return dirs
}

// parsePackage parses the non-test Go files of dir (one package each: the module has no
// build-tagged package split in its public packages).
func parsePackage(t *testing.T, fset *token.FileSet, dir string, mode parser.Mode) []*ast.File {
	t.Helper()
	names, err := filepath.Glob(filepath.Join(dir, "*.go"))
	if err != nil {
		t.Fatal(err)
	}
	var files []*ast.File
	for _, name := range names {
		if strings.HasSuffix(name, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, name, nil, mode)
		if err != nil {
			t.Fatal(err)
		}
		files = append(files, f)
	}
	return files
}

var identWord = regexp.MustCompile(`[A-Za-z_][A-Za-z0-9_]*`)

// looksLikeGoName tells a Go name (OutboxIdentity, Serve() is caught by the caller's list)
// from a capitalised English word: camelCase with a lower-case letter before a later capital.
func looksLikeGoName(w string) bool {
	for i := 1; i < len(w); i++ {
		if w[i] >= 'A' && w[i] <= 'Z' && w[i-1] >= 'a' && w[i-1] <= 'z' {
			return true
		}
	}
	return false
}

// elsewhere lists the camelCase names the docs may use unqualified although the package does
// not declare them: methods and fields of the package's own types (resolved by the reader in
// context), other projects' and protocols' names.
var elsewhere = map[string]bool{
	"PostgreSQL": true, "RocketMQ": true, "OpenTelemetry": true, "MiB": true, "KiB": true, "NaN": true,
	"PubAcks": true, "BizKeys": true, // plurals of PubAck, BizKey
	"JSStreamHeaderExceedsMaximumErr": true, // nats-server's error name
	"BackOff":                         true, // jetstream.ConsumerConfig.BackOff
}

// The documentation a user reads (go doc -all of each public package) names only what the
// user can see: no unexported function, type, constant, variable or method of the package,
// and no internal/ package.
func TestPublicDocsNameOnlyExportedThings(t *testing.T) {
	t.Parallel()
	dirs := publicPackageDirs(t)
	// Every name the public packages declare (types, functions, methods, fields, constants,
	// variables): a doc may name another package's or its own type's member in context.
	declared := map[string]bool{}
	for _, dir := range dirs {
		for _, f := range parsePackage(t, token.NewFileSet(), dir, 0) {
			ast.Inspect(f, func(n ast.Node) bool {
				if id, ok := n.(*ast.Ident); ok {
					declared[id.Name] = true
				}
				return true
			})
		}
	}
	for _, dir := range dirs {
		fset := token.NewFileSet()
		{
			files := parsePackage(t, fset, dir, parser.ParseComments)
			unexported := map[string]bool{}
			for _, f := range files {
				for _, decl := range f.Decls {
					switch d := decl.(type) {
					case *ast.FuncDecl:
						unexported[d.Name.Name] = !d.Name.IsExported()
					case *ast.GenDecl:
						for _, spec := range d.Specs {
							switch s := spec.(type) {
							case *ast.TypeSpec:
								unexported[s.Name.Name] = !s.Name.IsExported()
							case *ast.ValueSpec:
								for _, n := range s.Names {
									unexported[n.Name] = !n.IsExported()
								}
							}
						}
					}
				}
			}
			dp, err := doc.NewFromFiles(fset, files, "example.com/"+dir)
			if err != nil {
				t.Fatal(err)
			}
			check := func(where, text string) {
				if strings.Contains(text, "internal/") {
					t.Errorf("%s: %s: the doc names an internal/ package: %q", dir, where, text)
				}
				// An unexported identifier is told from an English word by its form: camelCase
				// (leaderGraceWaves) or called (run()).
				for _, loc := range identWord.FindAllStringIndex(text, -1) {
					w := text[loc[0]:loc[1]]
					called := loc[1] < len(text) && text[loc[1]] == '('
					if unexported[w] && (called || strings.ToLower(w) != w) {
						t.Errorf("%s: %s: the doc names the unexported %s", dir, where, w)
					}
					// An exported name, unqualified, that the package does not declare: a
					// name that moved (checkback's Serve went to outbox/checker) or never was.
					qualified := loc[0] > 0 && text[loc[0]-1] == '.'
					if !declared[w] && !qualified && token.IsExported(w) && looksLikeGoName(w) && !elsewhere[w] {
						t.Errorf("%s: %s: the doc names %s, which the package does not declare (qualify it with its package)", dir, where, w)
					}
				}
			}
			check("package doc", dp.Doc)
			values := func(vs []*doc.Value) {
				for _, v := range vs {
					check(strings.Join(v.Names, ","), v.Doc)
				}
			}
			funcs := func(fs []*doc.Func) {
				for _, f := range fs {
					check(f.Name, f.Doc)
				}
			}
			values(dp.Consts)
			values(dp.Vars)
			funcs(dp.Funcs)
			for _, typ := range dp.Types {
				check(typ.Name, typ.Doc)
				values(typ.Consts)
				values(typ.Vars)
				funcs(typ.Funcs)
				funcs(typ.Methods)
				// The comments inside an exported type (its exported fields and methods), as
				// go doc shows them.
				ast.Inspect(typ.Decl, func(n ast.Node) bool {
					switch x := n.(type) {
					case *ast.Field:
						exported := len(x.Names) == 0
						for _, name := range x.Names {
							exported = exported || name.IsExported()
						}
						if exported {
							check(typ.Name+" field", x.Doc.Text()+x.Comment.Text())
						}
					}
					return true
				})
			}
		}
	}
}

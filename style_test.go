package txoutbox_test

import (
	"go/parser"
	"go/token"
	"io/fs"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// Every Go file groups its imports as goimports does: the standard library first, then, after
// a blank line, everything else (the module's own packages among them), each group sorted.
func TestImportsAreGroupedStandardLibraryFirst(t *testing.T) {
	n := 0
	err := filepath.WalkDir(".", func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			if p != "." && (strings.HasPrefix(d.Name(), ".") || d.Name() == "testdata" || d.Name() == "node_modules") {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(p, ".go") {
			return nil
		}
		fset := token.NewFileSet()
		f, err := parser.ParseFile(fset, p, nil, parser.ImportsOnly)
		if err != nil {
			return err
		}
		n++
		prevLine, prevStd, prevPath := 0, true, ""
		for i, imp := range f.Imports {
			path, _ := strconv.Unquote(imp.Path.Value)
			std := !strings.Contains(strings.SplitN(path, "/", 2)[0], ".")
			line := fset.Position(imp.Pos()).Line
			newGroup := i > 0 && line > prevLine+1
			switch {
			case i > 0 && std && !prevStd:
				t.Errorf("%s: %q: a standard library import after another module's", p, path)
			case i > 0 && !std && prevStd && !newGroup:
				t.Errorf("%s: %q: in the standard library's group", p, path)
			case i > 0 && std == prevStd && newGroup:
				t.Errorf("%s: %q: a group of its own (one group for the standard library, one for the rest)", p, path)
			case i > 0 && std == prevStd && path < prevPath:
				t.Errorf("%s: %q: not sorted", p, path)
			}
			prevLine, prevStd, prevPath = fset.Position(imp.End()).Line, std, path
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if n < 100 {
		t.Fatalf("looked at %d files: the walk missed the sources", n)
	}
}

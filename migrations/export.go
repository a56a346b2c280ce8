package migrations

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

// Export formats.
const (
	// FormatGolangMigrate writes NNN_name.up.sql / NNN_name.down.sql, as in this package.
	FormatGolangMigrate = "golang-migrate"
	// FormatGoose writes one NNN_name.sql per version with goose's -- +goose Up / Down
	// annotations (goose cannot read separate up and down files).
	FormatGoose = "goose"
)

// ErrSharedDir means an export's directory already holds other migration files: txoutbox's
// versions (1, 2, …) would collide with the application's, or be counted in its version.
var ErrSharedDir = errors.New("migrations: the export directory holds other migration files")

// Export writes the migrations into dir (created if needed) in format, for deploy tools that
// keep their own copy. It refuses to overwrite an existing file, and to write into a
// directory holding any other .sql file (ErrSharedDir): txoutbox's migrations go in a
// directory of their own, applied with a version table of their own (goose -table
// txoutbox_goose_db_version; golang-migrate x-migrations-table=txoutbox_golang_migrate) or in a
// schema of their own, so that they never mix with the application's.
func Export(dir, format string) ([]string, error) {
	ms, err := Load(FS)
	if err != nil {
		return nil, err
	}
	files := map[string]string{}
	var order []string
	add := func(name, body string) {
		files[name] = body
		order = append(order, name)
	}
	for _, m := range ms {
		base := fmt.Sprintf("%03d_%s", m.Version, m.Name)
		switch format {
		case FormatGolangMigrate:
			add(base+".up.sql", m.Up)
			add(base+".down.sql", m.Down)
		case FormatGoose:
			add(base+".sql", gooseFile(m))
		default:
			return nil, fmt.Errorf("migrations: unknown export format %q (want %s or %s)", format, FormatGolangMigrate, FormatGoose)
		}
	}
	if others, _ := filepath.Glob(filepath.Join(dir, "*.sql")); len(others) > 0 {
		return nil, fmt.Errorf("%w: %s holds %s: export into a directory of its own and apply it with a version table of its own "+
			"(goose -dir DIR -table %s; golang-migrate -path DIR with x-migrations-table=%s in the database URL) or into a schema of its own",
			ErrSharedDir, dir, filepath.Base(others[0]), OwnGooseTable, OwnGolangMigrateTable)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	var written []string
	for _, name := range order {
		path := filepath.Join(dir, name)
		f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
		if err != nil {
			return written, fmt.Errorf("migrations: %w", err)
		}
		_, err = f.WriteString(files[name])
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return written, fmt.Errorf("migrations: write %s: %w", path, err)
		}
		written = append(written, path)
	}
	return written, nil
}

// gooseFile is m as one goose migration file. Each direction is one statement block, so goose
// runs it as written (functions, DO blocks and all).
func gooseFile(m Migration) string {
	var b strings.Builder
	b.WriteString("-- +goose Up\n-- +goose StatementBegin\n")
	b.WriteString(strings.TrimRight(m.Up, "\n"))
	b.WriteString("\n-- +goose StatementEnd\n\n-- +goose Down\n-- +goose StatementBegin\n")
	b.WriteString(strings.TrimRight(m.Down, "\n"))
	b.WriteString("\n-- +goose StatementEnd\n")
	return b.String()
}

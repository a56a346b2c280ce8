package migrations

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/txoutbox/txoutbox"
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

// ErrExportDiffers means an export's directory holds a file of one of txoutbox's migration
// names whose contents are not that migration's (edited, or exported by a build whose
// migration differed): Export never overwrites it.
var ErrExportDiffers = errors.New("migrations: an exported migration file differs from txoutbox's")

// earlierDowns are the down steps earlier txoutbox versions had, by migration version, for
// migrations whose down step changed since (only what the step does when it runs, never what
// the up step created): a file exported with one of them is txoutbox's, of an earlier version,
// and Export replaces it. Migration 001's down step drops the producer grants' functions since
// the evening of 2026-12-07.
var earlierDowns = map[int][]string{
	1: {"DROP TABLE txoutbox_consumer_dedup;\nDROP TABLE txoutbox_messages;\n"},
}

// Export writes the migrations into dir (created if needed) in format, for deploy tools that
// keep their own copy, and returns the paths of the files it wrote. Run again on the same
// directory (after an upgrade that adds migrations, say), it writes the files that are
// missing, leaves those whose contents are already the migration's, and replaces those an
// earlier txoutbox version exported whose down step has changed since (a deploy tool keeps no
// checksum of a down step, and the new one is what going down should run); a file of one of
// the migrations' names with any other contents is never overwritten (ErrExportDiffers,
// naming it, and nothing is written). It refuses a directory holding any other .sql file (ErrSharedDir):
// txoutbox's migrations go in a directory of their own, applied with a version table of their
// own (goose -table txoutbox_goose_db_version; golang-migrate
// x-migrations-table=txoutbox_golang_migrate) or in a schema of their own, so that they never
// mix with the application's. A format other than FormatGolangMigrate and FormatGoose is a
// *txoutbox.ConfigError naming it (Field "format"; errors.Is(err, txoutbox.ErrInvalidConfig)
// holds), before anything is read or written; the errors of reading dir and writing files
// are returned wrapped.
func Export(dir, format string) ([]string, error) {
	if format != FormatGolangMigrate && format != FormatGoose {
		return nil, &txoutbox.ConfigError{Package: "migrations", Field: "format",
			Reason: fmt.Sprintf("%q is unknown: want %s or %s", format, FormatGolangMigrate, FormatGoose)}
	}
	ms, err := Load(FS)
	if err != nil {
		return nil, err
	}
	files := map[string]string{}
	earlier := map[string][]string{} // file name → the contents earlier versions exported
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
			earlier[base+".down.sql"] = earlierDowns[m.Version]
		case FormatGoose:
			add(base+".sql", gooseFile(m))
			for _, d := range earlierDowns[m.Version] {
				old := m
				old.Down = d
				earlier[base+".sql"] = append(earlier[base+".sql"], gooseFile(old))
			}
		}
	}
	// Every .sql file already there must be one of ours, with our contents, before anything
	// is written.
	present := map[string]bool{}
	replace := map[string]bool{} // an earlier version's copy
	entries, err := os.ReadDir(dir)
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("migrations: %w", err)
	}
	for _, e := range entries {
		name := e.Name()
		if !strings.HasSuffix(name, ".sql") {
			continue
		}
		path := filepath.Join(dir, name)
		body, ours := files[name]
		if !ours {
			return nil, fmt.Errorf("%w: %s holds %s, not one of txoutbox's %s migration files: export into a directory of its own and apply it "+
				"with a version table of its own (goose -dir DIR -table %s; golang-migrate -path DIR with x-migrations-table=%s in the "+
				"database URL) or into a schema of its own", ErrSharedDir, dir, name, format, OwnGooseTable, OwnGolangMigrateTable)
		}
		got, err := os.ReadFile(path)
		if err != nil {
			return nil, fmt.Errorf("migrations: %w", err)
		}
		if string(got) != body && slices.Contains(earlier[name], string(got)) {
			replace[name] = true
			continue
		}
		if string(got) != body {
			return nil, fmt.Errorf("%w: %s is not txoutbox's %s (edited, or exported by another txoutbox version): "+
				"nothing written; move it away to export this version's, or compare them", ErrExportDiffers, path, name)
		}
		present[name] = true
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	var written []string
	for _, name := range order {
		if present[name] {
			continue // already there, as it is
		}
		path := filepath.Join(dir, name)
		if replace[name] {
			// Written beside it, then renamed over it: never a half-written migration file.
			if err := replaceFile(dir, path, files[name]); err != nil {
				return written, err
			}
			written = append(written, path)
			continue
		}
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

// replaceFile replaces path (in dir) with body: written to a new file in dir, then renamed
// over path, so that a failed write leaves the old file as it was.
func replaceFile(dir, path, body string) error {
	f, err := os.CreateTemp(dir, ".txoutbox-export-*")
	if err != nil {
		return fmt.Errorf("migrations: %w", err)
	}
	tmp := f.Name()
	_, err = f.WriteString(body)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Chmod(tmp, 0o644)
	}
	if err == nil {
		err = os.Rename(tmp, path)
	}
	if err != nil {
		_ = os.Remove(tmp)
		return fmt.Errorf("migrations: write %s: %w", path, err)
	}
	return nil
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

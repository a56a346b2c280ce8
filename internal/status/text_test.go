package status

import (
	"bytes"
	"strings"
	"testing"

	"github.com/txoutbox/txoutbox/internal/store"
)

// `relay status` prints text from outside the relay (subjects, keys, last errors, relay ids,
// versions, panel cells, problems) escaped: an ESC sequence or a line break in it cannot act
// on the operator's terminal or forge a row.
func TestWriteTextEscapesControlCharacters(t *testing.T) {
	t.Parallel()
	const evil = "x\x1b[2J\r\nforged\u202e\tcol"
	s := &Snapshot{Schema: "public"}
	s.Subjects = []Subject{{SubjectStatus: store.SubjectStatus{Subject: "orders." + evil, Ready: 1}}}
	s.Blocked = []store.BlockedKey{{Key: "k" + evil, Ready: 1, DeadSubject: "d" + evil, DeadLastError: "boom" + evil}}
	s.Relays = []Relay{{RelayMember: store.RelayMember{RelayID: "r" + evil, RelayInfo: store.RelayInfo{Version: "v" + evil, Health: "ok", NATS: "CONNECTED"}}}}
	s.Panels = []Table{{Title: "panel", Columns: []string{"A"}, Rows: [][]string{{"cell" + evil}}, Note: "note" + evil}}
	s.Problems = []string{"problem" + evil}
	var b bytes.Buffer
	if err := WriteText(&b, s); err != nil {
		t.Fatal(err)
	}
	out := b.String()
	for _, bad := range []string{"\x1b", "\r", "\u202e", "\nforged"} {
		if strings.Contains(out, bad) {
			t.Fatalf("status text contains %q raw:\n%s", bad, out)
		}
	}
	for _, want := range []string{`orders.x\x1b[2J\r\nforged\u202e\tcol`, `kx\x1b`, `rx\x1b`, `cellx\x1b`, `problemx\x1b[2J\r\nforged\u202e` + "\tcol"} {
		if !strings.Contains(out, want) {
			t.Errorf("status text lacks %q:\n%s", want, out)
		}
	}
}

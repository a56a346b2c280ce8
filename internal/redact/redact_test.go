package redact

import (
	"strings"
	"testing"
)

func TestDSN(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ in, want string }{
		{"postgres://u:s3cret@db:5432/app?sslmode=disable", "postgres://u:xxxxx@db:5432/app?sslmode=disable"},
		{"postgresql://u:p@ss@db/app", "postgresql://u:xxxxx@db/app"},
		{"postgres://u@db/app", "postgres://u@db/app"},
		{"postgres://db/app?user=u&password=s3cret", "postgres://db/app?user=u&password=xxxxx"},
		{"nats://tok3n@n1:4222,nats://u:pw@n2:4222", "nats://xxxxx@n1:4222,nats://u:xxxxx@n2:4222"},
		{"nats://127.0.0.1:4222", "nats://127.0.0.1:4222"},
		{"host=db user=u password=s3cret dbname=app", "host=db user=u password=xxxxx dbname=app"},
		{"host=db password = 's3 cr\\'et' dbname=app", "host=db password = xxxxx dbname=app"},
		{"password=s3cret", "password=xxxxx"},
		{"sslpassword=k3y host=db", "sslpassword=xxxxx host=db"},
		{"postgres://app:hunter2@db:5432/x?sslmode=require", "postgres://app:xxxxx@db:5432/x?sslmode=require"},
		{"nats://s3cr3ttoken@a:4222", "nats://xxxxx@a:4222"},
		{"", ""},
	} {
		got := DSN(tc.in)
		if got != tc.want {
			t.Errorf("DSN(%q) = %q, want %q", tc.in, got, tc.want)
		}
		for _, secret := range []string{"s3cret", "tok3n", "pw@", "k3y", "hunter2", "s3cr3ttoken", "cr\\'et", "p@ss"} {
			if strings.Contains(got, secret) {
				t.Errorf("DSN(%q) = %q still holds %q", tc.in, got, secret)
			}
		}
	}
}

// NATS masks every server of a list, with or without a scheme (nats.go takes u:p@host as
// nats://u:p@host), and leaves what carries no credential as it was.
func TestNATS(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ in, want string }{
		{"u:Secret@127.0.0.1:1", "u:xxxxx@127.0.0.1:1"},
		{"s3cr3ttoken@127.0.0.1:4222", "xxxxx@127.0.0.1:4222"},
		{"u:Secret@127.0.0.1:14299/x", "u:xxxxx@127.0.0.1:14299/x"},
		{"nats://127.0.0.1:1,u:Secret@127.0.0.1:2", "nats://127.0.0.1:1,u:xxxxx@127.0.0.1:2"},
		{"nats://a:1, u:Secret@b:2", "nats://a:1, u:xxxxx@b:2"},
		{"nats://tok3n@n1:4222,tls://u:pw@n2:4222", "nats://xxxxx@n1:4222,tls://u:xxxxx@n2:4222"},
		{"wss://u:Secret@h:443/ws", "wss://u:xxxxx@h:443/ws"},
		{"127.0.0.1:4222", "127.0.0.1:4222"},
		{"nats://127.0.0.1:4222", "nats://127.0.0.1:4222"},
		// nats.go reads no query: every value there is masked (a token put in the wrong place).
		{"ws://usr:Secret@h:4222/p?q=tok3n", "ws://usr:xxxxx@h:4222/p?q=xxxxx"},
		{"nats://usr:Secret@h:4222?token=tok3n&x", "nats://usr:xxxxx@h:4222?token=xxxxx&x"},
		{"h:4222?token=s3cr3ttoken", "h:4222?token=xxxxx"},
		{"", ""},
	} {
		got := NATS(tc.in)
		if got != tc.want {
			t.Errorf("NATS(%q) = %q, want %q", tc.in, got, tc.want)
		}
		for _, secret := range []string{"Secret", "tok3n", "pw@", "s3cr3ttoken"} {
			if strings.Contains(got, secret) {
				t.Errorf("NATS(%q) = %q still holds %q", tc.in, got, secret)
			}
		}
	}
}

// KeyValues reads a libpq key=value string as keyValue masks it: quoted values with escapes,
// spaces around '='; the values unquoted and unescaped.
func TestKeyValues(t *testing.T) {
	got := KeyValues(`host=h  password = 'p w\'x' sslkey=/k\ ey user=u empty=''`)
	want := map[string]string{"host": "h", "password": `p w'x`, "sslkey": "/k ey", "user": "u", "empty": ""}
	if len(got) != len(want) {
		t.Fatalf("KeyValues = %q, want %q", got, want)
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("KeyValues[%q] = %q, want %q", k, got[k], v)
		}
	}
	if m := DSN(`host=h  password = 'p w\'x' sslkey=/k\ ey user=u`); m != `host=h  password = xxxxx sslkey=xxxxx user=u` {
		t.Errorf("DSN = %q", m)
	}
}

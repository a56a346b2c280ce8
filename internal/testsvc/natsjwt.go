package testsvc

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nkeys"
)

// Operator is a decentralised-auth setup (an operator, a system account and an application
// account with JetStream) for a nats-server in operator mode, whose users connect with
// credentials files, as nsc makes them.
type Operator struct {
	tb         testing.TB
	op         nkeys.KeyPair
	claims     *jwt.OperatorClaims
	sysPub     string
	account    nkeys.KeyPair
	accountPub string
	resolver   *server.MemAccResolver
}

// NewOperator makes the operator and its two accounts.
func NewOperator(tb testing.TB) *Operator {
	tb.Helper()
	must := func(err error) {
		if err != nil {
			tb.Fatal(err)
		}
	}
	o := &Operator{tb: tb, resolver: &server.MemAccResolver{}}
	var err error
	o.op, err = nkeys.CreateOperator()
	must(err)
	opPub, err := o.op.PublicKey()
	must(err)
	o.claims = jwt.NewOperatorClaims(opPub)
	o.claims.Name = "txoutbox-test"
	account := func(name string, js bool) (nkeys.KeyPair, string) {
		kp, err := nkeys.CreateAccount()
		must(err)
		pub, err := kp.PublicKey()
		must(err)
		ac := jwt.NewAccountClaims(pub)
		ac.Name = name
		if js {
			ac.Limits.JetStreamLimits = jwt.JetStreamLimits{MemoryStorage: -1, DiskStorage: -1, Streams: -1, Consumer: -1}
		}
		tok, err := ac.Encode(o.op)
		must(err)
		must(o.resolver.Store(pub, tok))
		return kp, pub
	}
	_, o.sysPub = account("SYS", false)
	o.claims.SystemAccount = o.sysPub
	o.account, o.accountPub = account("APP", true)
	return o
}

// Configure puts the server in operator mode with the operator's accounts.
func (o *Operator) Configure(so *server.Options) {
	so.TrustedOperators = []*jwt.OperatorClaims{o.claims}
	so.AccountResolver = o.resolver
	so.SystemAccount = o.sysPub
}

// UserCreds makes a user of the application account and writes its credentials file (its
// JWT and NKey seed) in a temporary directory; it returns the file's path.
func (o *Operator) UserCreds(name string) string {
	o.tb.Helper()
	return o.userCreds(name, time.Time{})
}

// UserCredsExpiring is UserCreds for a user whose JWT expires at expires (whole seconds): the
// server then disconnects the user's connections and refuses it.
func (o *Operator) UserCredsExpiring(name string, expires time.Time) string {
	o.tb.Helper()
	return o.userCreds(name, expires)
}

func (o *Operator) userCreds(name string, expires time.Time) string {
	tb := o.tb
	tb.Helper()
	kp, err := nkeys.CreateUser()
	if err != nil {
		tb.Fatal(err)
	}
	pub, _ := kp.PublicKey()
	seed, _ := kp.Seed()
	uc := jwt.NewUserClaims(pub)
	uc.Name = name
	uc.IssuerAccount = ""
	if !expires.IsZero() {
		uc.Expires = expires.Unix()
	}
	tok, err := uc.Encode(o.account)
	if err != nil {
		tb.Fatal(err)
	}
	creds, err := jwt.FormatUserConfig(tok, seed)
	if err != nil {
		tb.Fatal(err)
	}
	path := filepath.Join(tb.TempDir(), name+".creds")
	if err := os.WriteFile(path, creds, 0o600); err != nil {
		tb.Fatal(err)
	}
	return path
}

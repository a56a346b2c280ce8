package testsvc

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// Certs are a throwaway certificate authority and the certificates it signed for one test,
// written as PEM files in a temporary directory: a server certificate for 127.0.0.1 and
// localhost, and a client certificate.
type Certs struct {
	Dir string
	// CAFile is the CA certificate (the bundle clients and servers verify with).
	CAFile string
	// ServerCert and ServerKey are the server's certificate (SANs 127.0.0.1, ::1, localhost)
	// and key.
	ServerCert, ServerKey string
	// ClientCert and ClientKey are a client certificate (for client authentication, its
	// common name the one given to NewCerts) and its key.
	ClientCert, ClientKey string
	// CAPool holds the CA certificate.
	CAPool *x509.CertPool
}

// NewCerts makes a CA, a server certificate and a client certificate whose common name is
// clientName, in tb.TempDir(). Keys are ECDSA P-256 in PKCS #8, mode 0600.
func NewCerts(tb testing.TB, clientName string) *Certs {
	tb.Helper()
	dir := tb.TempDir()
	c := &Certs{Dir: dir, CAFile: filepath.Join(dir, "ca.pem"),
		ServerCert: filepath.Join(dir, "server.pem"), ServerKey: filepath.Join(dir, "server.key"),
		ClientCert: filepath.Join(dir, "client.pem"), ClientKey: filepath.Join(dir, "client.key")}
	now := time.Now()
	serial := int64(1)
	newKey := func() *ecdsa.PrivateKey {
		k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			tb.Fatal(err)
		}
		return k
	}
	write := func(path, typ string, der []byte) {
		if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
			tb.Fatal(err)
		}
	}
	writeKey := func(path string, k *ecdsa.PrivateKey) {
		der, err := x509.MarshalPKCS8PrivateKey(k)
		if err != nil {
			tb.Fatal(err)
		}
		write(path, "PRIVATE KEY", der)
	}
	caKey := newKey()
	caTmpl := &x509.Certificate{
		SerialNumber: big.NewInt(serial), Subject: pkix.Name{CommonName: "txoutbox test CA " + tb.Name()},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		tb.Fatal(err)
	}
	ca, err := x509.ParseCertificate(caDER)
	if err != nil {
		tb.Fatal(err)
	}
	write(c.CAFile, "CERTIFICATE", caDER)
	c.CAPool = x509.NewCertPool()
	c.CAPool.AddCert(ca)
	leaf := func(cn string, usage x509.ExtKeyUsage, certFile, keyFile string, server bool) {
		serial++
		k := newKey()
		tmpl := &x509.Certificate{
			SerialNumber: big.NewInt(serial), Subject: pkix.Name{CommonName: cn},
			NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour),
			KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{usage},
		}
		if server {
			tmpl.DNSNames = []string{"localhost"}
			tmpl.IPAddresses = []net.IP{net.ParseIP("127.0.0.1"), net.ParseIP("::1")}
		}
		der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &k.PublicKey, caKey)
		if err != nil {
			tb.Fatal(err)
		}
		write(certFile, "CERTIFICATE", der)
		writeKey(keyFile, k)
	}
	leaf("localhost", x509.ExtKeyUsageServerAuth, c.ServerCert, c.ServerKey, true)
	leaf(clientName, x509.ExtKeyUsageClientAuth, c.ClientCert, c.ClientKey, false)
	return c
}

// ServerTLS is a server configuration with the server certificate that requires and
// verifies client certificates signed by the CA.
func (c *Certs) ServerTLS(tb testing.TB) *tls.Config {
	tb.Helper()
	cert, err := tls.LoadX509KeyPair(c.ServerCert, c.ServerKey)
	if err != nil {
		tb.Fatal(err)
	}
	return &tls.Config{Certificates: []tls.Certificate{cert}, ClientCAs: c.CAPool,
		ClientAuth: tls.RequireAndVerifyClientCert, MinVersion: tls.VersionTLS12}
}

// Command producer-demo runs the whole txoutbox chain on this machine, with faults injected,
// and checks that every invariant held: `go run ./cmd/producer-demo`. With -chaos it runs the
// chaos proof. See internal/demo, and `go run ./cmd/producer-demo -help`.
package main

import (
	"os"

	"github.com/txoutbox/txoutbox/internal/demo"
)

func main() {
	os.Exit(demo.Main(os.Args[1:], os.Stdout, os.Stderr))
}

// Package leaktest fails an agent test binary whose tests leave goroutines
// running: a session, a server or a loop that a test did not stop. It is
// the agent's counterpart of pkg/pgtest.Main (the agent module does not
// import pkg/):
//
//	func TestMain(m *testing.M) { leaktest.Main(m) }
package leaktest

import (
	"fmt"
	"os"
	"testing"
	"time"

	"go.uber.org/goleak"
)

// Grace is how long [Main] keeps looking for leaked goroutines to end: a
// stopped gRPC server's or connection's goroutines can take a moment to
// exit on a busy machine.
const Grace = 10 * time.Second

// Main runs m's tests and, when they pass, fails the binary if goroutines
// they started are still running after [Grace]; it exits with the code.
func Main(m *testing.M) {
	code := m.Run()
	if code == 0 {
		if err := Find(Grace); err != nil {
			fmt.Fprintln(os.Stderr, "leaktest: goroutines leaked by the tests:", err)
			code = 1
		}
	}
	os.Exit(code)
}

// Find looks for goroutines other than the caller's and the test
// framework's (see [goleak.Find]) until none are left or within passes,
// and returns goleak's report of the last look; nil when none were left.
func Find(within time.Duration, opts ...goleak.Option) error {
	err := goleak.Find(opts...)
	for deadline := time.Now().Add(within); err != nil && time.Now().Before(deadline); {
		err = goleak.Find(opts...)
	}
	return err
}

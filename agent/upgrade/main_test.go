package upgrade_test

import (
	"testing"

	"github.com/bettercompute/bettercompute/agent/internal/leaktest"
)

// TestMain fails the package's tests if they leave goroutines running.
func TestMain(m *testing.M) { leaktest.Main(m) }

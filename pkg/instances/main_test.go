package instances_test

import (
	"testing"

	"github.com/bettercompute/bettercompute/pkg/pgtest"
)

// TestMain stops the package's database server when its tests end and
// fails them if they leave goroutines running.
func TestMain(m *testing.M) { pgtest.Main(m) }

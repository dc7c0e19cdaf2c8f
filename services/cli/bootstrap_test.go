package cli_test

import (
	"regexp"
	"strings"
	"testing"

	"github.com/bettercompute/bettercompute/pkg/pgtest"
)

func TestBootstrapPrintsARootCredential(t *testing.T) {
	t.Parallel()
	url := pgtest.NewDB(t)
	key := regexp.MustCompile(`bck_[a-z2-7]{16}\.[a-z2-7]{52}`)
	code, out, errOut := run(t, "bootstrap", "--database-url", url)
	if code != 0 || !key.MatchString(out) {
		t.Fatalf("bootstrap: %d\n%s\n%s", code, out, errOut)
	}
	code, again, _ := run(t, "bootstrap", "--database-url", url)
	if code != 0 || key.FindString(again) == key.FindString(out) {
		t.Fatalf("a second bootstrap mints another key: %d %s", code, again)
	}

	code, _, errOut = run(t, "bootstrap", "--database-url", pgtest.NewEmptyDB(t))
	if code == 0 || !strings.Contains(errOut, "migrate") {
		t.Fatalf("an unmigrated database: %d %s", code, errOut)
	}
}

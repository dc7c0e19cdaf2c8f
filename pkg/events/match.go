package events

import (
	"fmt"
	"regexp"
	"strings"
)

// MaxPatterns bounds the type patterns of one filter or webhook.
const MaxPatterns = 64

// patternRE is an exact type name ("node.spec.changed"), a prefix pattern
// ("node.*", "command.*") or "*".
var patternRE = regexp.MustCompile(`^(\*|[a-z][a-zA-Z]*(\.[a-z][a-zA-Z_]*)*(\.\*)?)$`)

// CheckPattern reports why p is not a type pattern: an exact type name, a
// name followed by ".*" (every type under it, at any depth), or "*".
func CheckPattern(p string) error {
	if len(p) > 128 || !patternRE.MatchString(p) {
		return fmt.Errorf("%q is not an event type or pattern: expected a type such as node.updated, a prefix such as node.*, or *", p)
	}
	return nil
}

// Match reports whether typ matches any of patterns; no patterns match
// everything.
func Match(patterns []string, typ string) bool {
	if len(patterns) == 0 {
		return true
	}
	for _, p := range patterns {
		switch {
		case p == "*" || p == typ:
			return true
		case strings.HasSuffix(p, ".*") && strings.HasPrefix(typ, p[:len(p)-1]):
			return true
		}
	}
	return false
}

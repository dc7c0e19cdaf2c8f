package main

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
)

// tsconfig type-checks one file against the generated types, strictly, with
// only the standard library's and the DOM's declarations (fetch).
const tsconfig = `{
  "compilerOptions": {
    "strict": true,
    "noEmit": true,
    "target": "ES2022",
    "module": "ESNext",
    "moduleResolution": "Bundler",
    "lib": ["ES2022", "DOM"],
    "types": [],
    "skipLibCheck": true
  },
  "files": ["FILE"]
}
`

// TestTypeScriptClient generates a TypeScript client from the committed
// OpenAPI 3 document with openapi-typescript and type-checks
// tools/openapi-ts/call.ts against it with tsc --noEmit: a typed nodes.get
// with the bearer header, the error envelope, and a switch over every stable
// code. tools/openapi-ts/bad.ts must fail, on each of its BAD lines, so the
// check is known to check. Needs Node.js and `npm ci` in tools/openapi-ts
// (.ci/run does it); without them it skips, except under CI, where it fails.
func TestTypeScriptClient(t *testing.T) {
	root := repoRoot(t)
	pkg := filepath.Join(root, "tools", "openapi-ts")
	unavailable := func(why string) {
		t.Helper()
		if os.Getenv("CI") != "" {
			t.Fatalf("CI: %s", why)
		}
		t.Skipf("TypeScript client check skipped: %s", why)
	}
	if _, err := exec.LookPath("node"); err != nil {
		unavailable("node is not installed (needs Node.js 18+ and npm)")
	}
	npx, err := exec.LookPath("npx")
	if err != nil {
		unavailable("npx is not installed (needs npm)")
	}
	for _, bin := range []string{"openapi-typescript", "tsc"} {
		if _, err := os.Stat(filepath.Join(pkg, "node_modules", ".bin", bin)); err != nil {
			unavailable("tools/openapi-ts has no " + bin + ": run `npm ci` in tools/openapi-ts")
		}
	}

	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Minute)
	defer cancel()
	// npx --no runs the package's own pinned binaries and never installs.
	run := func(args ...string) (string, error) {
		cmd := exec.CommandContext(ctx, npx, append([]string{"--no", "--"}, args...)...)
		cmd.Dir = pkg
		cmd.Env = append(os.Environ(), "NO_COLOR=1", "FORCE_COLOR=0", "npm_config_update_notifier=false")
		out, err := cmd.CombinedOutput()
		return string(out), err
	}

	tmp := t.TempDir()
	doc := filepath.Join(root, "proto", "openapi", "compute.openapi.json")
	if out, err := run("openapi-typescript", doc, "-o", filepath.Join(tmp, "compute.ts")); err != nil {
		t.Fatalf("openapi-typescript refused %s: %v\n%s", doc, err, out)
	}
	check := func(file string) (string, error) {
		src, err := os.ReadFile(filepath.Join(pkg, file))
		if err != nil {
			t.Fatal(err)
		}
		dir := filepath.Join(tmp, strings.TrimSuffix(file, ".ts"))
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		gen, err := os.ReadFile(filepath.Join(tmp, "compute.ts"))
		if err != nil {
			t.Fatal(err)
		}
		for name, b := range map[string][]byte{
			"compute.ts":    gen,
			file:            src,
			"tsconfig.json": []byte(strings.Replace(tsconfig, "FILE", file, 1)),
		} {
			if err := os.WriteFile(filepath.Join(dir, name), b, 0o644); err != nil { //nolint:gosec // test files
				t.Fatal(err)
			}
		}
		return run("tsc", "-p", filepath.Join(dir, "tsconfig.json"))
	}

	if out, err := check("call.ts"); err != nil {
		t.Fatalf("tsc --noEmit refused call.ts against the generated client: %v\n%s", err, out)
	}

	out, err := check("bad.ts")
	if err == nil {
		t.Fatal("tsc accepted bad.ts: the generated types check nothing")
	}
	src, err := os.ReadFile(filepath.Join(pkg, "bad.ts"))
	if err != nil {
		t.Fatal(err)
	}
	var want []string
	for i, line := range strings.Split(string(src), "\n") {
		if strings.Contains(line, "// BAD:") {
			want = append(want, "bad.ts("+strconv.Itoa(i+1)+",")
		}
	}
	var got []string
	for _, m := range regexp.MustCompile(`bad\.ts\((\d+),`).FindAllString(out, -1) {
		if !slices.Contains(got, m) {
			got = append(got, m)
		}
	}
	if !slices.Equal(got, want) {
		t.Errorf("tsc's errors in bad.ts are on %v, want exactly the BAD lines %v:\n%s", got, want, out)
	}
}

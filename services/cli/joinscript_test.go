package cli_test

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/bettercompute/bettercompute/agent/join"
	"github.com/bettercompute/bettercompute/services/cli"
	"github.com/bettercompute/bettercompute/services/joinservice"
)

const testJoinToken = "bcjt_abcdefghijklmnop." + "abcdefghijklmnopqrstuvwxyz234567abcdefghijklmnopqrst"

// joinScriptFixture makes a PKI, exports it and prints a join script.
func joinScriptFixture(t *testing.T, extra ...string) (dir, export, script string) {
	t.Helper()
	tmp := t.TempDir()
	dir, export = filepath.Join(tmp, "pki"), filepath.Join(tmp, "public")
	mustBC(t, "pki", "init", "--dir", dir)
	mustBC(t, "pki", "export", "--dir", dir, "--out", export)
	args := append([]string{"join-script", "--token", testJoinToken, "--gateway", "gw.example:8443", "--export-dir", export}, extra...)
	rc, out, errs := bc(t, args...)
	if rc != 0 {
		t.Fatalf("join-script: exit %d: %s", rc, errs)
	}
	if !strings.Contains(errs, "secret") {
		t.Errorf("join-script does not warn that the script holds the token: %q", errs)
	}
	return dir, export, out
}

// runScript runs the script with sh in a clean environment plus env.
func runScript(t *testing.T, script string, env ...string) (string, error) {
	t.Helper()
	p := filepath.Join(t.TempDir(), "join.sh")
	if err := os.WriteFile(p, []byte(script), 0o700); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("sh", p)
	cmd.Env = append([]string{"PATH=" + os.Getenv("PATH")}, env...)
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// TestJoinScriptWritesThePinnedConfiguration runs the script's
// configuration part with sh: the files bcd reads are the export's, and
// bcd.env pins the gateway and the command key.
func TestJoinScriptWritesThePinnedConfiguration(t *testing.T) {
	t.Parallel()
	dir, export, script := joinScriptFixture(t)
	if !strings.HasPrefix(script, "#!/bin/sh\n") || !strings.Contains(script, testJoinToken) {
		t.Fatalf("not a sh script with the token:\n%s", script)
	}
	if err := exec.Command("sh", "-n", "-c", script).Run(); err != nil {
		t.Fatalf("sh -n: %v", err)
	}
	conf := filepath.Join(t.TempDir(), "etc-bcd")
	out, err := runScript(t, script, "BCD_CONFIG_DIR="+conf, "BCD_ROOT=/nonexistent/bcd", "BCD_JOIN=no")
	if err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	for _, n := range []string{cli.PKIExportCA, cli.PKIExportJoin, cli.PKIExportCmd} {
		if !bytes.Equal(read(t, filepath.Join(conf, n)), read(t, filepath.Join(export, n))) {
			t.Errorf("%s differs from the export", n)
		}
	}
	// The key bcd join reads is joinservice's, with its id.
	key, err := joinservice.LoadKey(filepath.Join(dir, cli.PKIHPKEKey))
	if err != nil {
		t.Fatal(err)
	}
	if _, id, err := join.ParsePublicKey(read(t, filepath.Join(conf, cli.PKIExportJoin))); err != nil || id != key.ID() {
		t.Errorf("joinservice key id %q (%v), want %q", id, err, key.ID())
	}
	env := string(read(t, filepath.Join(conf, "bcd.env")))
	for _, want := range []string{"BCD_GATEWAY=gw.example:8443\n", "BCD_ROOT=/nonexistent/bcd\n", "BCD_COMMAND_KEY=" + filepath.Join(conf, cli.PKIExportCmd) + "\n"} {
		if !strings.Contains(env, want) {
			t.Errorf("bcd.env lacks %q:\n%s", want, env)
		}
	}
	if strings.Contains(env, "bcjt_") {
		t.Error("bcd.env holds the join token")
	}
}

// TestJoinScriptRunsJoinThenNode runs the whole script with a stand-in bcd
// that records how it is called: join with the pinned files, the key id and
// the token in the environment (not on the command line), then node with
// bcd.env; a second run does not join again.
func TestJoinScriptRunsJoinThenNode(t *testing.T) {
	t.Parallel()
	_, _, script := joinScriptFixture(t, "--server-name", "gw.internal")
	tmp := t.TempDir()
	conf, root, log := filepath.Join(tmp, "etc"), filepath.Join(tmp, "root"), filepath.Join(tmp, "calls")
	bcd := filepath.Join(tmp, "bcd")
	stub := `#!/bin/sh
echo "$1 args=$* token=${BCD_TOKEN:-} gateway=${BCD_GATEWAY:-} key=${BCD_COMMAND_KEY:-} server=${BCD_SERVER_NAME:-}" >>` + log + `
if [ "$1" = join ]; then mkdir -p ` + root + ` && echo node_1 >` + root + `/node_id && echo cert >` + root + `/cert.pem; fi
`
	if err := os.WriteFile(bcd, []byte(stub), 0o755); err != nil {
		t.Fatal(err)
	}
	env := []string{"BCD_CONFIG_DIR=" + conf, "BCD_ROOT=" + root, "BCD_BIN=" + bcd}
	if out, err := runScript(t, script, env...); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	calls := strings.Split(strings.TrimSpace(string(read(t, log))), "\n")
	if len(calls) != 2 || !strings.HasPrefix(calls[0], "join ") || !strings.HasPrefix(calls[1], "node ") {
		t.Fatalf("calls:\n%s", strings.Join(calls, "\n"))
	}
	for _, want := range []string{"--gateway gw.example:8443", "--root " + root, "--ca " + filepath.Join(conf, "ca.pem"),
		"--joinservice-key " + filepath.Join(conf, "joinservice.pub"), "--joinservice-key-id ", "--server-name gw.internal", "token=" + testJoinToken} {
		if !strings.Contains(calls[0], want) {
			t.Errorf("join call lacks %q: %s", want, calls[0])
		}
	}
	if strings.Contains(strings.SplitN(calls[0], " token=", 2)[0], "bcjt_") {
		t.Errorf("the token is on bcd's command line: %s", calls[0])
	}
	if want := "node args=node token= gateway=gw.example:8443 key=" + filepath.Join(conf, "command-signing.pub") + " server=gw.internal"; calls[1] != want {
		t.Errorf("node call %q, want %q", calls[1], want)
	}

	out, err := runScript(t, script, env...)
	if err != nil || !strings.Contains(out, "already joined as node_1") {
		t.Fatalf("second run: %v: %s", err, out)
	}
	if n := strings.Count(string(read(t, log)), "join args="); n != 1 {
		t.Errorf("joined %d times, want once", n)
	}

	// Without bcd and without --bcd-url the script stops, downloading nothing.
	out, err = runScript(t, script, "BCD_CONFIG_DIR="+conf, "BCD_ROOT="+root, "BCD_BIN="+filepath.Join(tmp, "missing"))
	if err == nil || !strings.Contains(out, "no bcd at") {
		t.Errorf("without bcd: %v: %s", err, out)
	}
}

// TestJoinScriptRefusesBadInput: what the script would embed is checked.
func TestJoinScriptRefusesBadInput(t *testing.T) {
	t.Parallel()
	_, export, _ := joinScriptFixture(t)
	for _, args := range [][]string{
		{"--token", "not-a-token", "--gateway", "gw:1"},
		{"--token", testJoinToken + "'; rm -rf /; '", "--gateway", "gw:1"},
		{"--token", testJoinToken, "--gateway", "gw"},
		{"--token", testJoinToken, "--gateway", "gw:1'$(id)"},
		{"--token", testJoinToken, "--gateway", "gw:1", "--bcd-url", "http://insecure.example/bcd"},
		{"--token", testJoinToken, "--gateway", "gw:1", "--bcd-sha256", "abc"},
	} {
		if rc, out, _ := bc(t, append(append([]string{"join-script"}, args...), "--export-dir", export)...); rc == 0 || out != "" {
			t.Errorf("join-script %v: exit %d, printed %d bytes", args, rc, len(out))
		}
	}
	if rc, _, _ := bc(t, "join-script", "--token", testJoinToken, "--gateway", "gw:1", "--export-dir", t.TempDir()); rc == 0 {
		t.Error("join-script took an empty export dir")
	}
}

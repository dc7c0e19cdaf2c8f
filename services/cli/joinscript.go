package cli

import (
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"text/template"

	"github.com/spf13/cobra"

	"github.com/bettercompute/bettercompute/agent/command"
	"github.com/bettercompute/bettercompute/agent/join"
	"github.com/bettercompute/bettercompute/pkg/jointoken"
	"github.com/bettercompute/bettercompute/services/cli/serve"
)

func newJoinScript(stdout, stderr io.Writer) *cobra.Command {
	var s joinScript
	var exportDir string
	cmd := &cobra.Command{
		Use:   "join-script --token bcjt_… --gateway host:port --export-dir OUT",
		Short: "Print a node's install script: bcd's pinned configuration, then bcd join and bcd node",
		Long: "join-script prints a POSIX sh script for a server to run as root. It writes bcd's pinned configuration " +
			"(the gateway, the node CA bundle, joinservice's public key and key id, the command-signing public key, all " +
			"embedded from OUT, which `better-compute pki export` wrote) under $BCD_CONFIG_DIR (/etc/bcd), installs bcd " +
			"from --bcd-url when it is not at $BCD_BIN (/usr/local/bin/bcd), runs `bcd join` with the token unless the " +
			"node has joined, then runs `bcd node` (as the systemd unit bcd.service where systemd runs). The script " +
			"holds the join token: hand it over as you would the token.\n\n" +
			"  better-compute join-script --token \"$JT\" --gateway gw.example:443 --export-dir pki-public | ssh root@server sh",
		Args: cobra.NoArgs,
		RunE: func(_ *cobra.Command, _ []string) error {
			if s.Token == "" || s.Gateway == "" || exportDir == "" {
				return serve.Usage(errors.New("--token, --gateway and --export-dir are required"))
			}
			if err := s.load(exportDir); err != nil {
				return err
			}
			if err := s.validate(); err != nil {
				return err
			}
			fmt.Fprintln(stderr, "the script holds the join token: treat it as a secret")
			return joinScriptTmpl.Execute(stdout, &s)
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&s.Token, "token", "", "join token bcjt_<id>.<secret> (joinTokens.create); required")
	fl.StringVar(&s.Gateway, "gateway", "", "the gateway's host:port as nodes dial it; required")
	fl.StringVar(&exportDir, "export-dir", "", "the directory `pki export --out` wrote; required")
	fl.StringVar(&s.ServerName, "server-name", "", "the name on the gateway's certificate (default: the host of --gateway)")
	fl.StringVar(&s.BCDURL, "bcd-url", "", "https:// URL the script fetches bcd from when it is not installed")
	fl.StringVar(&s.BCDSHA256, "bcd-sha256", "", "SHA-256 (hex) that bcd fetched from --bcd-url must have")
	return cmd
}

// joinScript is what the install script embeds.
type joinScript struct {
	Token, Gateway, ServerName, BCDURL, BCDSHA256 string
	CA, JoinKey, CommandKey                       string
	KeyID                                         string
}

// load reads the exported files and checks each parses as bcd reads it.
func (s *joinScript) load(dir string) error {
	read := func(name string) (string, error) {
		b, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil {
			return "", fmt.Errorf("--export-dir: %w (write it with `better-compute pki export`)", err)
		}
		if len(b) > 0 && b[len(b)-1] != '\n' {
			b = append(b, '\n')
		}
		return string(b), nil
	}
	var err error
	if s.CA, err = read(PKIExportCA); err != nil {
		return err
	}
	if !strings.Contains(s.CA, "-----BEGIN CERTIFICATE-----") {
		return fmt.Errorf("%s: no PEM certificate", filepath.Join(dir, PKIExportCA))
	}
	if s.JoinKey, err = read(PKIExportJoin); err != nil {
		return err
	}
	pub, id, err := join.ParsePublicKey([]byte(s.JoinKey))
	if err != nil {
		return err
	}
	if s.KeyID = id; s.KeyID == "" {
		s.KeyID = join.KeyID(pub)
	}
	if s.CommandKey, err = read(PKIExportCmd); err != nil {
		return err
	}
	if _, err := command.ParsePublicKey([]byte(s.CommandKey)); err != nil {
		return err
	}
	return nil
}

var (
	hostRE   = regexp.MustCompile(`^[A-Za-z0-9.:\[\]-]{1,253}$`)
	sha256RE = regexp.MustCompile(`^[0-9a-f]{64}$`)
	keyIDRE  = regexp.MustCompile(`^[0-9a-f]{1,64}$`)
	// heredoc is the delimiter of the embedded files; no PEM line is it.
	heredocRE = regexp.MustCompile(`(?m)^BCD_EOF$`)
)

// validate checks every value the script embeds, so none needs quoting
// beyond the single quotes the template puts around it.
func (s *joinScript) validate() error {
	if _, _, err := jointoken.Parse(s.Token); err != nil || strings.ContainsAny(s.Token, "'\\\n") {
		return serve.Usage(errors.New("--token: expected a join token bcjt_<id>.<secret>"))
	}
	host, port, err := net.SplitHostPort(s.Gateway)
	if err != nil || host == "" || port == "" || !hostRE.MatchString(s.Gateway) {
		return serve.Usage(fmt.Errorf("--gateway: expected host:port, got %q", s.Gateway))
	}
	if s.ServerName != "" && !hostRE.MatchString(s.ServerName) {
		return serve.Usage(fmt.Errorf("--server-name: expected a host name, got %q", s.ServerName))
	}
	if s.BCDURL != "" {
		u, err := url.Parse(s.BCDURL)
		if err != nil || u.Scheme != "https" || u.Host == "" || strings.ContainsAny(s.BCDURL, "'\\\n ") {
			return serve.Usage(fmt.Errorf("--bcd-url: expected an https:// URL, got %q", s.BCDURL))
		}
	}
	if s.BCDSHA256 != "" && (!sha256RE.MatchString(s.BCDSHA256) || s.BCDURL == "") {
		return serve.Usage(errors.New("--bcd-sha256: expected 64 lower-case hex digits, with --bcd-url"))
	}
	if !keyIDRE.MatchString(s.KeyID) {
		return fmt.Errorf("joinservice key id %q: expected hex", s.KeyID)
	}
	for _, f := range []string{s.CA, s.JoinKey, s.CommandKey} {
		if heredocRE.MatchString(f) {
			return errors.New("an exported file holds the line BCD_EOF")
		}
	}
	return nil
}

var joinScriptTmpl = template.Must(template.New("join").Parse(`#!/bin/sh
# Better Compute node install, made by better-compute join-script.
# It holds a join token: treat this script as a secret. Run it as root:
#   sh join.sh
# Environment: BCD_BIN (default /usr/local/bin/bcd), BCD_CONFIG_DIR
# (/etc/bcd), BCD_ROOT (/var/lib/bcd); BCD_JOIN=no only writes the
# configuration; BCD_START=no joins without starting bcd node.
set -eu
gateway='{{.Gateway}}'
server_name='{{.ServerName}}'
joinservice_key_id='{{.KeyID}}'
bcd_url='{{.BCDURL}}'
bcd_sha256='{{.BCDSHA256}}'
: "${BCD_BIN:=/usr/local/bin/bcd}"
: "${BCD_CONFIG_DIR:=/etc/bcd}"
: "${BCD_ROOT:=/var/lib/bcd}"

umask 022
mkdir -p "$BCD_CONFIG_DIR"
# The node CA's trust bundle: the gateway's certificate must chain to it.
cat >"$BCD_CONFIG_DIR/ca.pem" <<'BCD_EOF'
{{.CA}}BCD_EOF
# joinservice's HPKE public key: the join token is sealed to it.
cat >"$BCD_CONFIG_DIR/joinservice.pub" <<'BCD_EOF'
{{.JoinKey}}BCD_EOF
# The command-signing public key: destructive commands must be signed by it.
cat >"$BCD_CONFIG_DIR/command-signing.pub" <<'BCD_EOF'
{{.CommandKey}}BCD_EOF
# bcd reads its flags from BCD_* variables: this file is bcd node's.
{
	echo "BCD_GATEWAY=$gateway"
	echo "BCD_ROOT=$BCD_ROOT"
	echo "BCD_COMMAND_KEY=$BCD_CONFIG_DIR/command-signing.pub"
	if [ -n "$server_name" ]; then echo "BCD_SERVER_NAME=$server_name"; fi
} >"$BCD_CONFIG_DIR/bcd.env"
echo "bcd configuration written to $BCD_CONFIG_DIR"
if [ "${BCD_JOIN:-yes}" = no ]; then exit 0; fi

if [ ! -x "$BCD_BIN" ] && [ -n "$bcd_url" ]; then
	tmp="$BCD_BIN.download.$$"
	mkdir -p "$(dirname "$BCD_BIN")"
	if command -v curl >/dev/null 2>&1; then curl -fsSL --proto '=https' -o "$tmp" "$bcd_url"; else wget -q -O "$tmp" "$bcd_url"; fi
	if [ -n "$bcd_sha256" ] && ! echo "$bcd_sha256  $tmp" | sha256sum -c - >/dev/null 2>&1; then
		rm -f "$tmp"
		echo "bcd from $bcd_url does not have SHA-256 $bcd_sha256" >&2
		exit 1
	fi
	chmod 0755 "$tmp"
	mv "$tmp" "$BCD_BIN"
fi
if [ ! -x "$BCD_BIN" ]; then
	echo "no bcd at $BCD_BIN: install it there (or set BCD_BIN), then run this again" >&2
	exit 1
fi

if [ -s "$BCD_ROOT/node_id" ] && [ -s "$BCD_ROOT/cert.pem" ]; then
	echo "already joined as $(cat "$BCD_ROOT/node_id")"
else
	set -- join --gateway "$gateway" --root "$BCD_ROOT" --ca "$BCD_CONFIG_DIR/ca.pem" \
		--joinservice-key "$BCD_CONFIG_DIR/joinservice.pub" --joinservice-key-id "$joinservice_key_id"
	if [ -n "$server_name" ]; then set -- "$@" --server-name "$server_name"; fi
	# The token goes in the environment, not on the command line (ps shows that).
	BCD_TOKEN='{{.Token}}' "$BCD_BIN" "$@"
fi
if [ "${BCD_START:-yes}" = no ]; then exit 0; fi

if [ -d /run/systemd/system ] && command -v systemctl >/dev/null 2>&1; then
	cat >/etc/systemd/system/bcd.service <<BCD_EOF
[Unit]
Description=Better Compute node daemon
Wants=network-online.target
After=network-online.target

[Service]
EnvironmentFile=$BCD_CONFIG_DIR/bcd.env
ExecStart=$BCD_BIN node
Restart=always
RestartSec=5

[Install]
WantedBy=multi-user.target
BCD_EOF
	systemctl daemon-reload
	systemctl enable --now bcd.service
	echo "bcd node runs as bcd.service"
else
	set -a
	. "$BCD_CONFIG_DIR/bcd.env"
	set +a
	exec "$BCD_BIN" node
fi
`))

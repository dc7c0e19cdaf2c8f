package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"sync"
	"time"

	"github.com/coder/websocket"
	"github.com/spf13/cobra"

	"github.com/bettercompute/bettercompute/pkg/version"
)

// The tunnel's WebSocket (api.TunnelConnectPath, api.TunnelTokenHeader):
// the client keeps its own copy so it links nothing of the server.
const (
	tunnelConnectPath = "/api/compute/tunnels/connect"
	tunnelTokenHeader = "X-Tunnel-Token"
	// tunnelFrame is the most one binary message carries.
	tunnelFrame = 32 << 10
)

type tunnelFlags struct {
	api                   apiFlags
	tenant, target, local string
	reason                string
	stdio                 bool
	lifetime              time.Duration
}

func (f *tunnelFlags) register(cmd *cobra.Command, withLocal bool) {
	fl := cmd.Flags()
	fl.StringVar(&f.api.url, "url", "", "API base URL (default $"+EnvURL+", client.url, "+DefaultURL+")")
	fl.StringVar(&f.api.token, "token", "", "API key sent as a bearer token (default $"+EnvToken+", client.token)")
	fl.StringVar(&f.api.clientConfig, "client-config", "", "client config file (default $"+EnvClientConfig+", ~/.config/better-compute/client.yaml)")
	fl.StringVar(&f.tenant, "tenant", "root", "the node's tenant")
	fl.StringVar(&f.reason, "reason", "", "why, for the audit log")
	fl.DurationVar(&f.lifetime, "for", time.Hour, "how long each tunnel may stay open (at most 8h)")
	if withLocal {
		fl.StringVar(&f.target, "target", "", "what the node connects to: host:port or unix:/path (required)")
		fl.StringVar(&f.local, "local", "", "local address to listen on (host:port); each connection opens a tunnel")
		fl.BoolVar(&f.stdio, "stdio", false, "carry one tunnel on stdin and stdout (for ssh's ProxyCommand)")
	} else {
		fl.StringVar(&f.target, "target", "127.0.0.1:22", "the node's sshd: host:port the node connects to")
	}
}

func newTunnel(stdout, stderr io.Writer) *cobra.Command {
	f := &tunnelFlags{}
	cmd := &cobra.Command{
		Use:   "tunnel <nodeId> --target host:port (--local host:port | --stdio)",
		Short: "Forward a local port (or stdin and stdout) to a target on a node",
		Long: "tunnel opens port forwards through the node's own connection to its gateway (tunnels.open, then the " +
			"WebSocket " + tunnelConnectPath + "), like kubectl port-forward. The node connects only to targets its " +
			"tunnels allowlist allows (pools.update and nodes.update, mask tunnels). With --local every accepted " +
			"connection is its own tunnel, until interrupted; with --stdio one tunnel carries stdin and stdout.",
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			switch {
			case f.target == "":
				return errors.New("--target is required")
			case f.stdio == (f.local != ""):
				return errors.New("give exactly one of --local and --stdio")
			}
			cc, err := resolveClient(&f.api, os.Getenv)
			if err != nil {
				return err
			}
			if f.stdio {
				return runTunnel(cmd.Context(), cc, f, args[0], stdioConn{in: cmd.InOrStdin(), out: stdout})
			}
			return serveLocal(cmd.Context(), cc, f, args[0], stdout, stderr)
		},
	}
	f.register(cmd, true)
	return cmd
}

func newSSH(stdout, stderr io.Writer) *cobra.Command {
	f := &tunnelFlags{}
	cmd := &cobra.Command{
		Use:   "ssh [user@]<nodeId> [ssh args]",
		Short: "Run ssh to a node through a tunnel (ProxyCommand: better-compute tunnel --stdio)",
		Long: "ssh runs OpenSSH's ssh with ProxyCommand set to this binary's `tunnel <nodeId> --stdio --target " +
			"<target>` (the node's sshd, 127.0.0.1:22 by default) and HostKeyAlias set to the node id; the remaining " +
			"arguments go to ssh after the destination (options, then a command). The API's URL and token reach the " +
			"ProxyCommand through the environment, never its command line.",
		Args:               cobra.MinimumNArgs(1),
		DisableFlagParsing: false,
		RunE: func(cmd *cobra.Command, args []string) error {
			cc, err := resolveClient(&f.api, os.Getenv)
			if err != nil {
				return err
			}
			self, err := os.Executable()
			if err != nil {
				return err
			}
			dest := args[0]
			node := dest
			if _, n, ok := strings.Cut(dest, "@"); ok {
				node = n
			}
			proxy := fmt.Sprintf("%s tunnel %s --stdio --target %s --tenant %s --for %s", shellQuote(self), shellQuote(node),
				shellQuote(f.target), shellQuote(f.tenant), f.lifetime)
			if f.reason != "" {
				proxy += " --reason " + shellQuote(f.reason)
			}
			sshArgs := append([]string{"-o", "ProxyCommand=" + proxy, "-o", "HostKeyAlias=" + node, dest}, args[1:]...)
			c := exec.CommandContext(cmd.Context(), "ssh", sshArgs...)
			c.Stdin, c.Stdout, c.Stderr = cmd.InOrStdin(), stdout, stderr
			c.Env = append(os.Environ(), EnvURL+"="+cc.URL, EnvToken+"="+cc.Token)
			return c.Run()
		},
	}
	f.register(cmd, false)
	cmd.Flags().SetInterspersed(false) // everything after the node is ssh's
	return cmd
}

// shellQuote quotes s for the shell ssh runs ProxyCommand with.
func shellQuote(s string) string {
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

// localConn is the caller's end of one tunnel.
type localConn interface {
	io.Reader
	io.Writer
	// CloseWrite says the target sent all it will.
	CloseWrite() error
	Close() error
}

// stdioConn is stdin and stdout as a localConn.
type stdioConn struct {
	in  io.Reader
	out io.Writer
}

func (s stdioConn) Read(p []byte) (int, error)  { return s.in.Read(p) }
func (s stdioConn) Write(p []byte) (int, error) { return s.out.Write(p) }
func (s stdioConn) CloseWrite() error {
	if c, ok := s.out.(io.Closer); ok {
		return c.Close()
	}
	return nil
}
func (s stdioConn) Close() error { return s.CloseWrite() }

// serveLocal listens on --local and opens a tunnel per connection.
func serveLocal(ctx context.Context, cc clientConfig, f *tunnelFlags, node string, stdout, stderr io.Writer) error {
	var lc net.ListenConfig
	ln, err := lc.Listen(ctx, "tcp", f.local)
	if err != nil {
		return err
	}
	stop := context.AfterFunc(ctx, func() { _ = ln.Close() })
	defer stop()
	_, _ = fmt.Fprintf(stdout, "Forwarding %s -> %s on %s (Ctrl-C to stop)\n", ln.Addr(), f.target, node)
	var wg sync.WaitGroup
	defer wg.Wait()
	for {
		c, err := ln.Accept()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return err
		}
		wg.Go(func() {
			if err := runTunnel(ctx, cc, f, node, c.(*net.TCPConn)); err != nil {
				_, _ = fmt.Fprintf(stderr, "tunnel from %s: %v\n", c.RemoteAddr(), err)
			}
		})
	}
}

// openedTunnel is tunnels.open's answer.
type openedTunnel struct {
	Tunnel       struct{ ID string }
	ConnectToken string
}

// runTunnel opens one tunnel and relays local through it until both sides
// are done.
func runTunnel(ctx context.Context, cc clientConfig, f *tunnelFlags, node string, local localConn) error {
	defer func() { _ = local.Close() }()
	body, _ := json.Marshal(map[string]any{"tenantId": f.tenant, "nodeId": node, "target": f.target, "reason": f.reason,
		"notAfterSeconds": int64(f.lifetime / time.Second)})
	var o openedTunnel
	if err := postAPI(ctx, cc, "tunnels/open", body, &o); err != nil {
		return err
	}
	wsURL := "ws" + strings.TrimPrefix(strings.TrimRight(cc.URL, "/"), "http") + tunnelConnectPath
	c, resp, err := websocket.Dial(ctx, wsURL, &websocket.DialOptions{HTTPHeader: http.Header{tunnelTokenHeader: {o.ConnectToken}}})
	if resp != nil && resp.Body != nil {
		_ = resp.Body.Close()
	}
	if err != nil {
		return fmt.Errorf("connect tunnel %s: %w", o.Tunnel.ID, err)
	}
	c.SetReadLimit(tunnelFrame + 1024)
	if _, _, err := c.Read(ctx); err != nil { // the tunnel, once the node connected
		return fmt.Errorf("tunnel %s: %w", o.Tunnel.ID, closeErr(err))
	}
	return pumpTunnel(ctx, c, local)
}

// pumpTunnel copies both ways: an empty binary message is a half-close.
func pumpTunnel(ctx context.Context, c *websocket.Conn, local localConn) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	up := make(chan error, 1)
	go func() {
		buf := make([]byte, tunnelFrame)
		for {
			n, err := local.Read(buf)
			if n > 0 {
				if werr := c.Write(ctx, websocket.MessageBinary, buf[:n]); werr != nil {
					up <- werr
					return
				}
			}
			if err != nil {
				if errors.Is(err, io.EOF) {
					up <- c.Write(ctx, websocket.MessageBinary, nil)
					return
				}
				up <- err
				return
			}
		}
	}()
	for {
		_, b, err := c.Read(ctx)
		if err != nil {
			if websocket.CloseStatus(err) == websocket.StatusNormalClosure {
				return nil
			}
			return closeErr(err)
		}
		if len(b) == 0 {
			_ = local.CloseWrite()
			continue
		}
		if _, err := local.Write(b); err != nil {
			_ = c.Close(websocket.StatusNormalClosure, "")
			return err
		}
	}
}

// closeErr says why the server closed the tunnel.
func closeErr(err error) error {
	var ce websocket.CloseError
	if errors.As(err, &ce) && ce.Reason != "" {
		return errors.New(ce.Reason)
	}
	return err
}

// postAPI calls an API method over REST and decodes its answer.
func postAPI(ctx context.Context, cc clientConfig, method string, body []byte, out any) error {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	endpoint := strings.TrimRight(cc.URL, "/") + apiPrefix + method
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, endpoint, bytes.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("User-Agent", "better-compute/"+version.Get().Version)
	if cc.Token != "" {
		req.Header.Set("Authorization", "Bearer "+cc.Token)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return fmt.Errorf("cannot reach the API at %s: %w", endpoint, err)
	}
	defer func() { _ = resp.Body.Close() }()
	answer, err := io.ReadAll(io.LimitReader(resp.Body, maxAnswerBytes))
	if err != nil {
		return err
	}
	if resp.StatusCode/100 != 2 {
		return fmt.Errorf("%s answered %d: %s", method, resp.StatusCode, strings.TrimSpace(string(answer)))
	}
	return json.Unmarshal(answer, out)
}

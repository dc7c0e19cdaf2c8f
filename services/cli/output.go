package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/bettercompute/bettercompute/pkg/version"
)

// outputPath is commands.getOutput's REST path.
const outputPath = apiPrefix + "commands/getOutput"

func newCommandsCmd(stdout, stderr io.Writer) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "commands",
		Short: "Read what a node's commands produced",
		Args:  cobra.NoArgs,
	}
	f := &apiFlags{}
	var follow bool
	var interval time.Duration
	output := &cobra.Command{
		Use:   "output tenantId=<tenant> nodeId=<node> commandId=<cmd>",
		Short: "Print a command's output (logs.collect's log) as it arrives",
		Long: "output reads commands.getOutput with the api command's URL and token and writes the command's output, " +
			"as is, to stdout: what the node has streamed so far, and everything once the command finished. " +
			"With --follow it keeps reading every --interval until the command finishes and all of it is written; " +
			"without, it stops at what has arrived (saying on stderr when more may come).",
		Args: cobra.ArbitraryArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			return runCommandsOutput(cmd.Context(), f, args, follow, interval, stdout, stderr)
		},
	}
	fl := output.Flags()
	fl.StringVar(&f.url, "url", "", "API base URL (default $"+EnvURL+", client.url, "+DefaultURL+")")
	fl.StringVar(&f.token, "token", "", "API key sent as a bearer token (default $"+EnvToken+", client.token)")
	fl.StringVar(&f.clientConfig, "client-config", "", "client config file (default $"+EnvClientConfig+", ~/.config/better-compute/client.yaml)")
	fl.DurationVar(&f.timeout, "timeout", 30*time.Second, "how long to wait for each answer")
	fl.BoolVar(&follow, "follow", false, "keep reading until the command finishes")
	fl.DurationVar(&interval, "interval", time.Second, "with --follow, how long to wait when nothing new has arrived")
	cmd.AddCommand(output)
	return cmd
}

// outputPage is commands.getOutput's answer (proto3 JSON).
type outputPage struct {
	Data          []byte `json:"data"`
	NextPageToken string `json:"nextPageToken"`
	State         string `json:"state"`
}

// runCommandsOutput pages through a command's output, writing each page.
func runCommandsOutput(ctx context.Context, f *apiFlags, args []string, follow bool, interval time.Duration, stdout, stderr io.Writer) error {
	req := map[string]any{"maxBytes": 1 << 20}
	for _, a := range args {
		k, v, ok := strings.Cut(a, "=")
		switch {
		case !ok:
			return fmt.Errorf("argument %q: expected key=value", a)
		case k == "tenantId" || k == "nodeId" || k == "commandId":
			req[k] = v
		default:
			return fmt.Errorf("argument %q: expected tenantId, nodeId or commandId", k)
		}
	}
	for _, k := range []string{"tenantId", "nodeId", "commandId"} {
		if req[k] == nil || req[k] == "" {
			return fmt.Errorf("%s=<…> is required", k)
		}
	}
	if interval <= 0 {
		return errors.New("--interval must be positive")
	}
	cc, err := resolveClient(f, os.Getenv)
	if err != nil {
		return err
	}
	endpoint := strings.TrimRight(cc.URL, "/") + outputPath
	for {
		p, err := outputOnce(ctx, endpoint, cc.Token, f.timeout, req, stderr)
		if err != nil {
			return err
		}
		if _, err := stdout.Write(p.Data); err != nil {
			return err
		}
		if p.NextPageToken == "" {
			return nil // finished, all written
		}
		req["pageToken"] = p.NextPageToken
		if len(p.Data) > 0 {
			continue
		}
		if !follow {
			_, _ = fmt.Fprintf(stderr, "the command is %s: more may come (--follow waits for it)\n", p.State)
			return nil
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(interval):
		}
	}
}

// outputOnce makes one commands.getOutput call; a refusal's envelope goes
// to stderr.
func outputOnce(ctx context.Context, endpoint, token string, timeout time.Duration, body map[string]any, stderr io.Writer) (outputPage, error) {
	b, _ := json.Marshal(body)
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, endpoint, bytes.NewReader(b))
	if err != nil {
		return outputPage{}, err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("User-Agent", "better-compute/"+version.Get().Version)
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return outputPage{}, fmt.Errorf("cannot reach the API at %s: %w", endpoint, err)
	}
	defer func() { _ = resp.Body.Close() }()
	answer, err := io.ReadAll(io.LimitReader(resp.Body, maxAnswerBytes))
	if err != nil {
		return outputPage{}, fmt.Errorf("reading the answer of %s: %w", endpoint, err)
	}
	if resp.StatusCode/100 != 2 {
		env := envelopeOfAnswer(resp, answer)
		enc := json.NewEncoder(stderr)
		enc.SetIndent("", "  ")
		_ = enc.Encode(env)
		return outputPage{}, &apiCallError{method: "commands.getOutput", status: resp.StatusCode, env: env}
	}
	var p outputPage
	if err := json.Unmarshal(answer, &p); err != nil {
		return outputPage{}, fmt.Errorf("commands.getOutput answered %s", err)
	}
	return p, nil
}

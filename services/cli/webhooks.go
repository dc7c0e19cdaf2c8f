package cli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/spf13/cobra"

	"github.com/bettercompute/bettercompute/pkg/webhooks"
)

// maxWebhookBody bounds what the listener reads of a request.
const maxWebhookBody = 4 << 20

func newWebhooks(stdout, stderr io.Writer) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "webhooks",
		Short: "Receive webhooks",
		Args:  cobra.NoArgs,
	}
	var addr, secret string
	listen := &cobra.Command{
		Use:   "listen --addr 127.0.0.1:9000 --secret whsec_…",
		Short: "Run a webhook receiver that verifies each delivery and prints it",
		Long: "listen serves HTTP on --addr, verifies every request as Standard Webhooks with --secret (or " +
			"$BETTER_COMPUTE_WEBHOOK_SECRET; several comma-separated during a rotation), answers 204 to a valid one " +
			"and 401 to the rest, and prints one JSON line per valid delivery: webhook-id, type, the time it arrived, " +
			"and the payload. Duplicates (the same webhook-id) are printed with \"duplicate\":true. A receiver to try " +
			"webhooks with, and to build yours from.",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if secret == "" {
				secret = os.Getenv("BETTER_COMPUTE_WEBHOOK_SECRET")
			}
			return runWebhooksListen(cmd.Context(), addr, secret, stdout, stderr)
		},
	}
	listen.Flags().StringVar(&addr, "addr", "127.0.0.1:9000", "address to listen on")
	listen.Flags().StringVar(&secret, "secret", "", "the webhook's signing secret, whsec_… (default $BETTER_COMPUTE_WEBHOOK_SECRET)")
	cmd.AddCommand(listen)
	return cmd
}

func runWebhooksListen(ctx context.Context, addr, secrets string, stdout, stderr io.Writer) error {
	var keys [][]byte
	for _, s := range splitComma(secrets) {
		k, err := webhooks.ParseSecret(s)
		if err != nil {
			return err
		}
		keys = append(keys, k)
	}
	if len(keys) == 0 {
		return errors.New("--secret whsec_… is required (the secret webhooks.create returned)")
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	_, _ = fmt.Fprintf(stderr, "listening on http://%s\n", ln.Addr())
	var mu sync.Mutex
	seen := map[string]bool{}
	enc := json.NewEncoder(stdout)
	srv := &http.Server{ReadHeaderTimeout: 10 * time.Second, Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		at := time.Now()
		body, err := io.ReadAll(io.LimitReader(r.Body, maxWebhookBody))
		if err != nil {
			w.WriteHeader(http.StatusBadRequest)
			return
		}
		var verr error
		for _, k := range keys {
			if verr = webhooks.Verify(k, r.Header, body, at, webhooks.DefaultTolerance); verr == nil {
				break
			}
		}
		if verr != nil {
			_, _ = fmt.Fprintf(stderr, "refused a delivery: %v\n", verr)
			w.WriteHeader(http.StatusUnauthorized)
			return
		}
		var msg struct {
			Type string          `json:"type"`
			Data json.RawMessage `json:"data"`
		}
		_ = json.Unmarshal(body, &msg)
		id := r.Header.Get(webhooks.HeaderID)
		mu.Lock()
		dup := seen[id]
		seen[id] = true
		_ = enc.Encode(map[string]any{"id": id, "type": msg.Type, "received": at.UTC().Format(time.RFC3339Nano), "duplicate": dup, "data": msg.Data})
		mu.Unlock()
		w.WriteHeader(http.StatusNoContent)
	})}
	go func() {
		<-ctx.Done()
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(sctx)
	}()
	if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

// splitComma splits a comma-separated list, dropping blanks.
func splitComma(s string) []string {
	var out []string
	for p := range strings.SplitSeq(s, ",") {
		if p = strings.TrimSpace(p); p != "" {
			out = append(out, p)
		}
	}
	return out
}

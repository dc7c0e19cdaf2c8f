package cli

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/bettercompute/bettercompute/pkg/version"
)

// watchPath is the API's Server-Sent Events endpoint of events.watch.
const watchPath = "/api/compute/events/watch"

func newEvents(stdout, stderr io.Writer) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "events",
		Short: "Read the event log",
		Args:  cobra.NoArgs,
	}
	f := &apiFlags{}
	var raw bool
	watch := &cobra.Command{
		Use:   "watch tenantId=<tenant> [types=node.*,command.*] [subject=<id>] [after=<cursor>] [includeDescendants=true]",
		Short: "Print a tenant's events as they happen",
		Long: "watch streams events.watch (Server-Sent Events at " + watchPath + ") with the api command's URL and token " +
			"and prints one line per event: cursor, time, type, subject and payload. after=<cursor> resumes after that " +
			"event; without it only new events are printed. On a dropped connection it reconnects and resumes after the " +
			"last event printed, so nothing is missed or printed twice. --json prints each event's JSON instead.",
		Args: cobra.ArbitraryArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			return runEventsWatch(cmd.Context(), f, args, raw, stdout, stderr)
		},
	}
	fl := watch.Flags()
	fl.StringVar(&f.url, "url", "", "API base URL (default $"+EnvURL+", client.url, "+DefaultURL+")")
	fl.StringVar(&f.token, "token", "", "API key sent as a bearer token (default $"+EnvToken+", client.token)")
	fl.StringVar(&f.clientConfig, "client-config", "", "client config file (default $"+EnvClientConfig+", ~/.config/better-compute/client.yaml)")
	fl.BoolVar(&raw, "json", false, "print each event's JSON")
	cmd.AddCommand(watch)
	return cmd
}

// watchEvent is what the stream sends (proto3 JSON of Event).
type watchEvent struct {
	ID      string          `json:"id"`
	Cursor  string          `json:"cursor"`
	Type    string          `json:"type"`
	Subject string          `json:"subject"`
	Time    string          `json:"time"`
	Data    json.RawMessage `json:"data"`
}

// runEventsWatch streams until ctx ends, reconnecting after errors.
func runEventsWatch(ctx context.Context, f *apiFlags, args []string, raw bool, stdout, stderr io.Writer) error {
	q := url.Values{}
	var after string
	for _, a := range args {
		k, v, ok := strings.Cut(a, "=")
		switch {
		case !ok:
			return fmt.Errorf("argument %q: expected key=value", a)
		case k == "after":
			after = v
		case k == "tenantId" || k == "types" || k == "subject" || k == "includeDescendants":
			q.Set(k, v)
		default:
			return fmt.Errorf("argument %q: expected tenantId, types, subject, after or includeDescendants", k)
		}
	}
	if q.Get("tenantId") == "" {
		return errors.New("tenantId=<tenant> is required")
	}
	cc, err := resolveClient(f, os.Getenv)
	if err != nil {
		return err
	}
	endpoint := strings.TrimRight(cc.URL, "/") + watchPath + "?" + q.Encode()
	backoff := time.Second
	for {
		err := watchOnce(ctx, endpoint, cc.Token, &after, func(e watchEvent, line string) {
			if raw {
				_, _ = fmt.Fprintln(stdout, line)
				return
			}
			_, _ = fmt.Fprintf(stdout, "%s\t%s\t%s\t%s\t%s\n", e.Cursor, e.Time, e.Type, e.Subject, e.Data)
		})
		if ctx.Err() != nil {
			return nil //nolint:nilerr // the watch ends when its context does
		}
		var fatal *watchRefused
		if errors.As(err, &fatal) {
			return err
		}
		_, _ = fmt.Fprintf(stderr, "watch: %v; reconnecting in %s\n", err, backoff)
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, 30*time.Second)
	}
}

// watchRefused is an answer that retrying will not change.
type watchRefused struct{ msg string }

func (e *watchRefused) Error() string { return e.msg }

// watchOnce reads one connection's events, moving *after past each.
func watchOnce(ctx context.Context, endpoint, token string, after *string, emit func(watchEvent, string)) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, endpoint, nil)
	if err != nil {
		return &watchRefused{err.Error()}
	}
	req.Header.Set("Accept", "text/event-stream")
	req.Header.Set("User-Agent", "better-compute/"+version.Get().Version)
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	if *after != "" {
		req.Header.Set("Last-Event-ID", *after)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer func() { _ = resp.Body.Close() }()
	if resp.StatusCode != http.StatusOK {
		body, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
		err := fmt.Errorf("events.watch answered %d: %s", resp.StatusCode, strings.TrimSpace(string(body)))
		if resp.StatusCode/100 == 4 && resp.StatusCode != http.StatusTooManyRequests {
			return &watchRefused{err.Error()}
		}
		return err
	}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 8<<20)
	var id, data string
	for sc.Scan() {
		line := sc.Text()
		switch {
		case strings.HasPrefix(line, "id: "):
			id = strings.TrimPrefix(line, "id: ")
		case strings.HasPrefix(line, "data: "):
			data = strings.TrimPrefix(line, "data: ")
		case line == "" && data != "":
			var e watchEvent
			if err := json.Unmarshal([]byte(data), &e); err == nil {
				emit(e, data)
			}
			if id != "" {
				*after = id
			}
			id, data = "", ""
		}
	}
	if err := sc.Err(); err != nil {
		return err
	}
	return errors.New("the stream ended")
}

package app_test

import (
	"errors"
	"io"
	"net/http"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	reflectionv1 "google.golang.org/grpc/reflection/grpc_reflection_v1"
	"google.golang.org/grpc/status"

	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
)

// defaultConfig is the API role with nothing about the admin listener
// configured: server.adminAddr unset, as a fresh deployment has it.
func defaultConfig(t *testing.T) *config.Config {
	t.Helper()
	cfg := testConfig(pgtest.NewDB(t))
	cfg.Roles = []string{string(config.RoleAPI)}
	if cfg.Server.AdminAddr != "" {
		t.Fatalf("the defaults set server.adminAddr %q", cfg.Server.AdminAddr)
	}
	return cfg
}

// TestMetricsNotServedOnAPIListenerByDefault: with the default
// configuration, anyone who reached the API's port used to read /metrics
// (and pprof) anonymously. Now they are served only on the admin listener,
// on loopback; the API port answers 404, and /healthz and /readyz (the
// probes) stay on it.
func TestMetricsNotServedOnAPIListenerByDefault(t *testing.T) {
	t.Parallel()
	a := start(t, defaultConfig(t))
	if code, _ := get(t, "http://"+a.Addr()+"/metrics"); code != http.StatusNotFound {
		t.Fatalf("GET /metrics on the API port: %d, want 404", code)
	}
	if code, _ := get(t, "http://"+a.Addr()+"/debug/pprof/"); code != http.StatusNotFound {
		t.Fatalf("GET /debug/pprof/ on the API port: %d, want 404", code)
	}
	for _, p := range []string{"/healthz", "/readyz"} {
		if code, _ := get(t, "http://"+a.Addr()+p); code != http.StatusOK {
			t.Fatalf("GET %s on the API port: %d, want 200", p, code)
		}
	}
	admin := a.AdminAddr()
	if admin == "" {
		t.Fatal("no admin listener by default")
	}
	if code, _ := get(t, "http://"+admin+"/metrics"); code != http.StatusOK {
		t.Fatalf("GET /metrics on the admin listener %s: %d", admin, code)
	}
	// server.adminAddr "api" is the explicit opt-in to the old behaviour.
	cfg := defaultConfig(t)
	cfg.Server.AdminAddr = config.AdminOnAPIPort
	b := start(t, cfg)
	if code, _ := get(t, "http://"+b.Addr()+"/metrics"); code != http.StatusOK || b.AdminAddr() != "" {
		t.Fatalf("server.adminAddr=api: /metrics on the API port %d, admin listener %q", code, b.AdminAddr())
	}
}

// TestReflectionNotOnAPIListenerByDefault: gRPC reflection (the list of
// every service and method) answered anyone on the API port by default;
// now the API port answers Unimplemented and the admin listener serves it.
func TestReflectionNotOnAPIListenerByDefault(t *testing.T) {
	t.Parallel()
	a := start(t, defaultConfig(t))
	list := func(addr string) error {
		conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			return err
		}
		defer func() { _ = conn.Close() }()
		stream, err := reflectionv1.NewServerReflectionClient(conn).ServerReflectionInfo(t.Context())
		if err != nil {
			return err
		}
		// A stream the server ended answers Send with io.EOF; its status
		// comes with Recv.
		if err := stream.Send(&reflectionv1.ServerReflectionRequest{MessageRequest: &reflectionv1.ServerReflectionRequest_ListServices{}}); err != nil && !errors.Is(err, io.EOF) {
			return err
		}
		_, err = stream.Recv()
		return err
	}
	if err := list(a.Addr()); status.Code(err) != codes.Unimplemented {
		t.Fatalf("reflection on the API port: %v, want Unimplemented", err)
	}
	if err := list(a.AdminAddr()); err != nil {
		t.Fatalf("reflection on the admin listener: %v", err)
	}
}

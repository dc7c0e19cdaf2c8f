package computev1_test

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/grpc-ecosystem/grpc-gateway/v2/runtime"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"
)

type systemServer struct {
	computev1.UnimplementedSystemServiceServer
}

func (systemServer) Version(context.Context, *computev1.VersionRequest) (*computev1.VersionResponse, error) {
	return &computev1.VersionResponse{Version: "v1.2.3", GoVersion: "go1.26.8", RequiredSchemaVersion: 7}, nil
}

func (systemServer) Health(context.Context, *computev1.HealthRequest) (*computev1.HealthResponse, error) {
	return &computev1.HealthResponse{
		Status: computev1.HealthStatus_HEALTH_STATUS_OK,
		Checks: []*computev1.HealthCheck{{Name: "database", Ok: true}},
	}, nil
}

// TestGatewayRoutes checks the HTTP rules in http.yaml reached the generated
// gateway: POST /api/compute/{group}/{method} with a JSON body.
func TestGatewayRoutes(t *testing.T) {
	mux := runtime.NewServeMux()
	if err := computev1.RegisterSystemServiceHandlerServer(context.Background(), mux, systemServer{}); err != nil {
		t.Fatal(err)
	}

	for _, tc := range []struct{ path, want string }{
		{"/api/compute/system/version", `"requiredSchemaVersion":"7"`},
		{"/api/compute/system/health", `"status":"HEALTH_STATUS_OK"`},
	} {
		rec := httptest.NewRecorder()
		mux.ServeHTTP(rec, httptest.NewRequest(http.MethodPost, tc.path, strings.NewReader("{}")))
		if rec.Code != http.StatusOK {
			t.Fatalf("POST %s: status %d: %s", tc.path, rec.Code, rec.Body)
		}
		if !json.Valid(rec.Body.Bytes()) || !strings.Contains(strings.ReplaceAll(rec.Body.String(), " ", ""), tc.want) {
			t.Errorf("POST %s: body %s, want it to contain %s", tc.path, rec.Body, tc.want)
		}
	}

	rec := httptest.NewRecorder()
	mux.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/api/compute/system/version", nil))
	if rec.Code == http.StatusOK {
		t.Errorf("GET /api/compute/system/version: status 200, want the route to be POST only")
	}
}

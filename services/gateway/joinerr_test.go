package gateway_test

import (
	"context"
	"crypto/x509"
	"errors"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"

	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/services/gateway"
)

// rawJoiner fails the way an unmapped joinservice did: with a plain error
// carrying internal detail.
type rawJoiner struct{}

var errRaw = errors.New(`join tx: failed to connect to host=db.internal user=bc: password authentication failed`)

func (rawJoiner) Join(context.Context, *agentv1.JoinRequest) (*agentv1.JoinResponse, error) {
	return nil, errRaw
}

func (rawJoiner) Renew(context.Context, []*x509.Certificate, *agentv1.RenewRequest) (*agentv1.RenewResponse, error) {
	return nil, errRaw
}

// Security review 13 #11: a Join error reached the unauthenticated caller
// as codes.Unknown with its raw text. The gateway answers an error that is
// not a gRPC status INTERNAL with a generic message.
func TestJoinRawErrorTextNeverReachesTheCaller(t *testing.T) {
	t.Parallel()
	f := &harness{ca: newCA(t), db: pgtest.New(t), joiner: &joiner{}, revoked: map[string]bool{},
		tune: func(c *gateway.Config) { c.Joiner = rawJoiner{} }}
	_, addr := f.serve(t, "gw-raw")
	_, err := f.client(t, addr, nil).Join(t.Context(), &agentv1.JoinRequest{})
	st, _ := status.FromError(err)
	if st.Code() != codes.Internal || st.Message() != "internal error" || strings.Contains(err.Error(), "password") {
		t.Fatalf("Join: %v, want Internal with a generic message", err)
	}
	cert := f.ca.node(t, "node_r")
	if _, err := f.client(t, addr, &cert).Renew(t.Context(), &agentv1.RenewRequest{}); err == nil || strings.Contains(err.Error(), "password") {
		t.Fatalf("Renew: %v", err)
	}
}

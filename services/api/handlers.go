package api

import (
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"regexp"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/bettercompute/bettercompute/pkg/admission"
	"github.com/bettercompute/bettercompute/pkg/authz"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/iam"
	"github.com/bettercompute/bettercompute/pkg/outbox"
)

// call describes the current RPC for admission: caller, method, action,
// tenant and request id.
func (s *Server) call(ctx context.Context, tenant string) (admission.Call, error) {
	p, ok := iam.PrincipalFrom(ctx)
	if !ok {
		return admission.Call{}, fault.New(fault.Unauthenticated, "authorization", "no credential")
	}
	method, _ := grpc.Method(ctx)
	return admission.Call{
		Principal: p,
		Method:    method,
		Action:    s.methods[method].Action,
		TenantID:  tenant,
		RequestID: RequestID(ctx),
	}, nil
}

// read authorizes a read of res: the one decision, no audit row.
func (s *Server) read(ctx context.Context, tenant string, res authz.Resource) error {
	c, err := s.call(ctx, tenant)
	if err != nil {
		return err
	}
	return s.adm.Read(ctx, c, res)
}

// create runs a request-as-resource create and decodes its (fresh or
// replayed) response into out.
func (s *Server) create(ctx context.Context, req proto.Message, key string, c admission.Create, out proto.Message) (admission.Result, error) {
	call, err := s.call(ctx, c.TenantID)
	if err != nil {
		return admission.Result{}, err
	}
	c.Call = call
	c.IdempotencyKey = key
	c.RequestHash = requestHash(req)
	res, err := s.adm.Create(ctx, c)
	if err != nil {
		return admission.Result{}, err
	}
	if err := protojson.Unmarshal(res.Response, out); err != nil {
		return admission.Result{}, fmt.Errorf("decode stored response: %w", err)
	}
	return res, nil
}

// mutate runs any other mutation and decodes its response into out.
func (s *Server) mutate(ctx context.Context, m admission.Mutation, out proto.Message) error {
	call, err := s.call(ctx, m.TenantID)
	if err != nil {
		return err
	}
	m.Call = call
	b, err := s.adm.Mutate(ctx, m)
	if err != nil {
		return err
	}
	if err := protojson.Unmarshal(b, out); err != nil {
		return fmt.Errorf("decode response: %w", err)
	}
	return nil
}

// outcome marshals resp as the stored response of a mutation.
func outcome(resp proto.Message, event string, res *authz.Resource) (admission.Outcome, error) {
	b, err := protojson.Marshal(resp)
	if err != nil {
		return admission.Outcome{}, fmt.Errorf("encode response: %w", err)
	}
	return admission.Outcome{Response: b, Event: outbox.Event{Type: event}, Resource: res}, nil
}

// requestHash identifies a request under its idempotency key: the
// deterministic encoding of the request without the key.
func requestHash(req proto.Message) []byte {
	m := proto.Clone(req)
	fd := m.ProtoReflect().Descriptor().Fields().ByName("idempotency_key")
	if fd != nil {
		m.ProtoReflect().Clear(fd)
	}
	b, _ := proto.MarshalOptions{Deterministic: true}.Marshal(m)
	h := sha256.Sum256(b)
	return h[:]
}

// Paging.

const (
	defaultPage = 100
	maxPage     = 1000
)

func pageSize(n int32) (int, error) {
	switch {
	case n < 0 || n > maxPage:
		return 0, fault.New(fault.InvalidInput, "pageSize", "expected 0 (meaning %d) to %d, got %d", defaultPage, maxPage, n)
	case n == 0:
		return defaultPage, nil
	}
	return int(n), nil
}

// pageRequest is a list request paged by pageSize and pageToken.
type pageRequest interface {
	GetPageSize() int32
	GetPageToken() string
}

// page is the part of a listing one list call returns: at most size items,
// ordered by key, after the one whose key is after ("" from the first).
type page struct {
	size  int
	after string
}

// readPage checks a list request's pageSize and pageToken. (EventsService.List
// reads only pageSize: it pages by event cursor, the one Watch resumes from.)
func readPage(req pageRequest) (page, error) {
	size, err := pageSize(req.GetPageSize())
	if err != nil {
		return page{}, err
	}
	after, err := decodeCursor(req.GetPageToken())
	if err != nil {
		return page{}, err
	}
	return page{size: size, after: after}, nil
}

type cursor struct {
	After string `json:"a"`
}

// decodeCursor reads a page token; "" starts at the beginning.
func decodeCursor(tok string) (string, error) {
	if tok == "" {
		return "", nil
	}
	b, err := base64.RawURLEncoding.DecodeString(tok)
	var c cursor
	if err == nil {
		err = json.Unmarshal(b, &c)
	}
	if err != nil || c.After == "" {
		return "", fault.New(fault.InvalidInput, "pageToken", "not a page token from this API")
	}
	return c.After, nil
}

// nextPage returns the token of the page after pg, which held items, each
// keyed by key: "" when they did not fill it.
func nextPage[T any](pg page, items []T, key func(T) string) string {
	if len(items) == 0 || len(items) < pg.size {
		return ""
	}
	b, _ := json.Marshal(cursor{After: key(items[len(items)-1])})
	return base64.RawURLEncoding.EncodeToString(b)
}

// Validation.

var (
	nameRE     = regexp.MustCompile(`^[a-z0-9]([a-z0-9-]{0,62}[a-z0-9])?$`)
	identityRE = regexp.MustCompile(`^[a-z0-9]([a-z0-9._@-]{0,62}[a-z0-9])?$`)
	labelKeyRE = regexp.MustCompile(`^[A-Za-z0-9]([A-Za-z0-9._/-]{0,61}[A-Za-z0-9])?$`)
)

func required(field, v string) error {
	if v == "" {
		return fault.New(fault.InvalidInput, field, "required")
	}
	return nil
}

func validName(field, v string) error {
	if err := required(field, v); err != nil {
		return err
	}
	if !nameRE.MatchString(v) {
		return fault.New(fault.InvalidInput, field, "%q: expected lowercase letters, digits and inner hyphens, at most 64 characters", v)
	}
	return nil
}

func validLabels(labels map[string]string) error {
	if len(labels) > 64 {
		return fault.New(fault.InvalidInput, "labels", "at most 64 labels, got %d", len(labels))
	}
	for k, v := range labels {
		if !labelKeyRE.MatchString(k) {
			return fault.New(fault.InvalidInput, "labels", "label key %q: expected letters, digits, '.', '_', '/', '-', at most 63 characters", k)
		}
		if len(v) > 256 {
			return fault.New(fault.InvalidInput, "labels", "label %s: value longer than 256 characters", k)
		}
	}
	return nil
}

func ts(t time.Time) *timestamppb.Timestamp { return timestamppb.New(t) }

func tsp(t *time.Time) *timestamppb.Timestamp {
	if t == nil {
		return nil
	}
	return timestamppb.New(*t)
}

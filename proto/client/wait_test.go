package client_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"
	"github.com/bettercompute/bettercompute/proto/client"
)

// script is a server whose Get and List answers are scripted: each call takes
// the next answer, the last one repeating. An answer with a hook runs it
// first (to cancel the caller's context at a known call).
type script struct {
	mu       sync.Mutex
	commands []answer[*computev1.Command]
	rsvs     []answer[*computev1.Reservation]
	pages    [][]answer[*computev1.NodesServiceListResponse] // per look, per page
	calls    int
	requests []string // what each call asked for
}

type answer[T any] struct {
	v    T
	err  error
	hook func()
}

func next[T any](s *script, as []answer[T]) (T, error) {
	a := as[min(s.calls, len(as)-1)]
	s.calls++
	if a.hook != nil {
		a.hook()
	}
	return a.v, a.err
}

// cmdServer answers CommandsService.Get from its script.
type cmdServer struct {
	computev1.UnimplementedCommandsServiceServer
	*script
}

func (s cmdServer) Get(_ context.Context, r *computev1.CommandsServiceGetRequest) (*computev1.CommandsServiceGetResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.requests = append(s.requests, r.GetTenantId()+"/"+r.GetNodeId()+"/"+r.GetCommandId())
	c, err := next(s.script, s.commands)
	if err != nil {
		return nil, err
	}
	return &computev1.CommandsServiceGetResponse{Command: c}, nil
}

// rsvServer answers ReservationsService.Get from its script.
type rsvServer struct {
	computev1.UnimplementedReservationsServiceServer
	*script
}

func (s rsvServer) Get(_ context.Context, req *computev1.ReservationsServiceGetRequest) (*computev1.ReservationsServiceGetResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.requests = append(s.requests, req.GetTenantId()+"/"+req.GetReservationId())
	v, err := next(s.script, s.rsvs)
	if err != nil {
		return nil, err
	}
	return &computev1.ReservationsServiceGetResponse{Reservation: v}, nil
}

// nodeServer answers NodesService.List from its script: each look (a
// call without a page token) takes the next list of pages.
type nodeServer struct {
	computev1.UnimplementedNodesServiceServer
	*script
}

func (s nodeServer) List(_ context.Context, r *computev1.NodesServiceListRequest) (*computev1.NodesServiceListResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.requests = append(s.requests, fmt.Sprintf("%s/%s/%s", r.GetTenantId(), r.GetPoolId(), r.GetPageToken()))
	if r.GetPageToken() == "" {
		s.calls++ // a new look
	}
	look := s.pages[min(s.calls-1, len(s.pages)-1)]
	page := 0
	if r.GetPageToken() != "" {
		_, _ = fmt.Sscanf(r.GetPageToken(), "p%d", &page)
	}
	a := look[page]
	if a.err != nil {
		return nil, a.err
	}
	return a.v, nil
}

// start serves s over real gRPC and returns a Client with a millisecond
// poll interval.
func (s *script) start(t *testing.T) *client.Client {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	computev1.RegisterCommandsServiceServer(srv, cmdServer{script: s})
	computev1.RegisterReservationsServiceServer(srv, rsvServer{script: s})
	computev1.RegisterNodesServiceServer(srv, nodeServer{script: s})
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	conn, err := client.New(lis.Addr().String(), client.WithInsecure())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	c := client.NewClient(conn)
	c.PollInterval = time.Millisecond
	return c
}

// count is how many reads (looks, for List) the server answered.
func (s *script) count() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.calls
}

// asked is what each call asked for.
func (s *script) asked() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.requests...)
}

func cmd(state, reason string) answer[*computev1.Command] {
	return answer[*computev1.Command]{v: &computev1.Command{Id: "cmd_1", State: state, Reason: reason}}
}

func apiError(c codes.Code, code client.Code, field, msg string) error {
	st, _ := status.New(c, msg).WithDetails(&errdetails.ErrorInfo{Reason: string(code), Domain: client.ErrorDomain, Metadata: map[string]string{"field": field}})
	return st.Err()
}

func TestWaitCommand(t *testing.T) {
	t.Parallel()

	t.Run("polls until the command finishes and returns it", func(t *testing.T) {
		t.Parallel()
		s := &script{commands: []answer[*computev1.Command]{cmd("pending", ""), cmd("in_flight", ""), cmd("succeeded", "")}}
		c := s.start(t)
		got, err := c.WaitCommand(t.Context(), "root", "node_1", "cmd_1")
		if err != nil {
			t.Fatal(err)
		}
		if got.GetState() != client.CommandSucceeded || s.count() != 3 {
			t.Fatalf("got %v after %d reads, want succeeded after 3", got, s.count())
		}
		if want := "root/node_1/cmd_1"; s.asked()[0] != want {
			t.Fatalf("asked for %q, want %q", s.asked()[0], want)
		}
	})

	t.Run("a failed command is a result, not an error", func(t *testing.T) {
		t.Parallel()
		s := &script{commands: []answer[*computev1.Command]{cmd("in_flight", ""), cmd("failed", "UNSUPPORTED")}}
		got, err := s.start(t).WaitCommand(t.Context(), "root", "node_1", "cmd_1")
		if err != nil || got.GetState() != client.CommandFailed || got.GetReason() != "UNSUPPORTED" {
			t.Fatalf("got %v, %v", got, err)
		}
	})

	t.Run("UNAVAILABLE is retried", func(t *testing.T) {
		t.Parallel()
		s := &script{commands: []answer[*computev1.Command]{
			cmd("in_flight", ""),
			{err: status.Error(codes.Unavailable, "restarting")},
			cmd("expired", "timeout"),
		}}
		got, err := s.start(t).WaitCommand(t.Context(), "root", "node_1", "cmd_1")
		if err != nil || got.GetState() != client.CommandExpired {
			t.Fatalf("got %v, %v", got, err)
		}
	})

	t.Run("another failure is returned at once, with its envelope", func(t *testing.T) {
		t.Parallel()
		s := &script{commands: []answer[*computev1.Command]{{err: apiError(codes.NotFound, client.CodeNotFound, "commandId", "no command cmd_1")}, cmd("succeeded", "")}}
		got, err := s.start(t).WaitCommand(t.Context(), "root", "node_1", "cmd_1")
		env := client.EnvelopeOf(err)
		if got != nil || env.Code != client.CodeNotFound || env.Field != "commandId" || s.count() != 1 {
			t.Fatalf("got %v, %v after %d reads", got, env, s.count())
		}
	})

	t.Run("the end of ctx returns the last command read and ctx's error", func(t *testing.T) {
		t.Parallel()
		ctx, cancel := context.WithCancel(t.Context())
		defer cancel()
		s := &script{commands: []answer[*computev1.Command]{cmd("pending", ""), cmd("in_flight", ""), {v: &computev1.Command{Id: "cmd_1", State: "in_flight"}, hook: cancel}}}
		got, err := s.start(t).WaitCommand(ctx, "root", "node_1", "cmd_1")
		if !errors.Is(err, context.Canceled) || got.GetState() != client.CommandInFlight {
			t.Fatalf("got %v, %v", got, err)
		}
		if !strings.Contains(err.Error(), "command cmd_1: it is in_flight") {
			t.Fatalf("error %q does not say how the command stood", err)
		}
		if env := client.EnvelopeOf(err); env.Code != client.CodeUnavailable {
			t.Fatalf("envelope %v", env)
		}
	})

	t.Run("a ctx already ended returns at once", func(t *testing.T) {
		t.Parallel()
		ctx, cancel := context.WithCancel(t.Context())
		cancel()
		s := &script{commands: []answer[*computev1.Command]{cmd("pending", "")}}
		got, err := s.start(t).WaitCommand(ctx, "root", "node_1", "cmd_1")
		if !errors.Is(err, context.Canceled) || got != nil || s.count() > 1 {
			t.Fatalf("got %v, %v after %d reads", got, err, s.count())
		}
	})
}

func TestWaitReservation(t *testing.T) {
	t.Parallel()
	rsv := func(state, reason string) answer[*computev1.Reservation] {
		return answer[*computev1.Reservation]{v: &computev1.Reservation{Id: "rsv_1", State: state, Reason: reason}}
	}

	t.Run("waits through pending and placed until bound", func(t *testing.T) {
		t.Parallel()
		s := &script{rsvs: []answer[*computev1.Reservation]{rsv("pending", "starts later"), rsv("placed", ""), rsv("bound", "")}}
		got, err := s.start(t).WaitReservation(t.Context(), "root", "rsv_1")
		if err != nil || got.GetState() != client.ReservationBound || s.count() != 3 || s.asked()[0] != "root/rsv_1" {
			t.Fatalf("got %v, %v after %d reads (%v)", got, err, s.count(), s.asked())
		}
	})

	t.Run("a failed reservation settles", func(t *testing.T) {
		t.Parallel()
		s := &script{rsvs: []answer[*computev1.Reservation]{rsv("placed", ""), rsv("failed", "node lost")}}
		got, err := s.start(t).WaitReservation(t.Context(), "root", "rsv_1")
		if err != nil || got.GetState() != client.ReservationFailed || got.GetReason() != "node lost" {
			t.Fatalf("got %v, %v", got, err)
		}
	})

	t.Run("the end of ctx says the state and reason", func(t *testing.T) {
		t.Parallel()
		ctx, cancel := context.WithCancel(t.Context())
		defer cancel()
		// The read that cancels may fail with ctx's error: the one before
		// it says how the reservation stood.
		a := rsv("pending", "NO_CAPACITY")
		a.hook = cancel
		s := &script{rsvs: []answer[*computev1.Reservation]{rsv("pending", "NO_CAPACITY"), a}}
		_, err := s.start(t).WaitReservation(ctx, "root", "rsv_1")
		if !errors.Is(err, context.Canceled) || !strings.Contains(err.Error(), "is pending (NO_CAPACITY)") {
			t.Fatalf("error %v", err)
		}
	})
}

func TestWaitSchedulable(t *testing.T) {
	t.Parallel()
	node := func(id string, schedulable bool) *computev1.Node {
		return &computev1.Node{Id: id, State: "adopted", Schedulable: schedulable}
	}
	page := func(token string, nodes ...*computev1.Node) answer[*computev1.NodesServiceListResponse] {
		return answer[*computev1.NodesServiceListResponse]{v: &computev1.NodesServiceListResponse{Nodes: nodes, NextPageToken: token}}
	}

	t.Run("reads every page until enough nodes are schedulable", func(t *testing.T) {
		t.Parallel()
		s := &script{pages: [][]answer[*computev1.NodesServiceListResponse]{
			{page("p1", node("node_a", false)), page("", node("node_b", false))},
			{page("p1", node("node_a", true)), page("", node("node_b", false))},
			{page("p1", node("node_a", true)), page("", node("node_b", true), node("node_c", false))},
		}}
		got, err := s.start(t).WaitSchedulable(t.Context(), "root", "pool_1", 2)
		if err != nil {
			t.Fatal(err)
		}
		if len(got) != 2 || got[0].GetId() != "node_a" || got[1].GetId() != "node_b" || s.count() != 3 {
			t.Fatalf("got %v after %d looks", got, s.count())
		}
		if want := []string{"root/pool_1/", "root/pool_1/p1"}; s.asked()[0] != want[0] || s.asked()[1] != want[1] {
			t.Fatalf("asked %v, want %v first", s.asked(), want)
		}
	})

	t.Run("n out of range is refused naming n", func(t *testing.T) {
		t.Parallel()
		c := client.NewClient(&client.Conn{})
		for _, n := range []int{0, -1, client.MaxWaitNodes + 1} {
			if _, err := c.WaitSchedulable(t.Context(), "root", "pool_1", n); err == nil || !strings.Contains(err.Error(), fmt.Sprintf("n is %d", n)) {
				t.Errorf("n=%d: %v", n, err)
			}
		}
	})

	t.Run("a failed page is returned", func(t *testing.T) {
		t.Parallel()
		s := &script{pages: [][]answer[*computev1.NodesServiceListResponse]{
			{page("p1", node("node_a", true)), {err: apiError(codes.InvalidArgument, client.CodeInvalidInput, "pageToken", "bad token")}},
		}}
		_, err := s.start(t).WaitSchedulable(t.Context(), "root", "pool_1", 1)
		if env := client.EnvelopeOf(err); env.Code != client.CodeInvalidInput || env.Field != "pageToken" {
			t.Fatalf("got %v", env)
		}
	})
}

func TestStates(t *testing.T) {
	t.Parallel()
	for _, s := range []string{client.CommandPending, client.CommandInFlight, "", "bogus"} {
		if client.CommandFinished(s) {
			t.Errorf("CommandFinished(%q)", s)
		}
	}
	for _, s := range []string{client.CommandSucceeded, client.CommandFailed, client.CommandExpired, client.CommandCancelled} {
		if !client.CommandFinished(s) {
			t.Errorf("!CommandFinished(%q)", s)
		}
	}
	for _, s := range []string{client.ReservationPending, client.ReservationPlaced, ""} {
		if client.ReservationSettled(s) {
			t.Errorf("ReservationSettled(%q)", s)
		}
	}
	for _, s := range []string{client.ReservationBound, client.ReservationReleased, client.ReservationExpired, client.ReservationFailed} {
		if !client.ReservationSettled(s) {
			t.Errorf("!ReservationSettled(%q)", s)
		}
	}
}

package client

import (
	"cmp"
	"context"
	"fmt"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"
)

// The states of a command (computev1.Command.State).
const (
	CommandPending   = "pending"
	CommandInFlight  = "in_flight"
	CommandSucceeded = "succeeded"
	CommandFailed    = "failed"
	CommandExpired   = "expired"
	CommandCancelled = "cancelled"
)

// CommandFinished reports whether a command in state will not change any
// more: succeeded, failed, expired or cancelled.
func CommandFinished(state string) bool {
	switch state {
	case CommandSucceeded, CommandFailed, CommandExpired, CommandCancelled:
		return true
	}
	return false
}

// The states of a reservation (computev1.Reservation.State).
const (
	ReservationPending  = "pending"
	ReservationPlaced   = "placed"
	ReservationBound    = "bound"
	ReservationReleased = "released"
	ReservationExpired  = "expired"
	ReservationFailed   = "failed"
)

// ReservationSettled reports whether a reservation in state has stopped
// moving on its own: bound (its nodes expose the GPUs), or finished
// (released, expired or failed).
func ReservationSettled(state string) bool {
	switch state {
	case ReservationBound, ReservationReleased, ReservationExpired, ReservationFailed:
		return true
	}
	return false
}

// MaxWaitNodes bounds the n of [Client.WaitSchedulable].
const MaxWaitNodes = 10000

// maxListPages bounds the pages WaitSchedulable reads per look (1,000 nodes
// a page), so a server that keeps answering a next page cannot hold it.
const maxListPages = 1000

// WaitCommand reads the command with Commands.Get until it has finished
// ([CommandFinished]) and returns it. A failed, expired or cancelled
// command is returned without an error: its State and Reason say what
// became of it, and Result holds what the node reported.
//
// A read failing with UNAVAILABLE (an API server restarting) is retried;
// any other failure is returned as is. When ctx ends first, WaitCommand
// returns the command as last read (nil if never) and an error wrapping
// ctx.Err(); the command itself goes on (see Commands.Cancel).
func (c *Client) WaitCommand(ctx context.Context, tenantID, nodeID, commandID string) (*computev1.Command, error) {
	req := &computev1.CommandsServiceGetRequest{TenantId: tenantID, NodeId: nodeID, CommandId: commandID}
	return poll(ctx, c, "command "+commandID,
		func(ctx context.Context) (*computev1.Command, error) {
			resp, err := c.Commands.Get(ctx, req)
			return resp.GetCommand(), err
		},
		func(cmd *computev1.Command) (bool, string) {
			return CommandFinished(cmd.GetState()), "is " + cmd.GetState()
		})
}

// WaitReservation reads the reservation with Reservations.Get until it has
// settled ([ReservationSettled]) and returns it: normally bound, with its
// bookings; a failed one says why in Reason. A reservation that starts
// later stays pending until then, so bound the wait with ctx.
//
// Failures and the end of ctx are handled as by [Client.WaitCommand].
func (c *Client) WaitReservation(ctx context.Context, tenantID, reservationID string) (*computev1.Reservation, error) {
	req := &computev1.ReservationsServiceGetRequest{TenantId: tenantID, ReservationId: reservationID}
	return poll(ctx, c, "reservation "+reservationID,
		func(ctx context.Context) (*computev1.Reservation, error) {
			resp, err := c.Reservations.Get(ctx, req)
			return resp.GetReservation(), err
		},
		func(r *computev1.Reservation) (bool, string) {
			s := "is " + r.GetState()
			if r.GetReason() != "" {
				s += " (" + r.GetReason() + ")"
			}
			return ReservationSettled(r.GetState()), s
		})
}

// WaitSchedulable lists the tenant's nodes in the pool (every pool of the
// tenant when poolID is empty) with Nodes.List until at least n of them are
// schedulable — adopted and running their desired state, so placement can
// book their GPUs — and returns the schedulable ones in the order listed.
// It is how an operator waits for the nodes a join token let in. n is 1 to
// [MaxWaitNodes].
//
// Failures and the end of ctx are handled as by [Client.WaitCommand].
func (c *Client) WaitSchedulable(ctx context.Context, tenantID, poolID string, n int) ([]*computev1.Node, error) {
	if n < 1 || n > MaxWaitNodes {
		return nil, fmt.Errorf("client: WaitSchedulable: n is %d; want 1 to %d", n, MaxWaitNodes)
	}
	what := fmt.Sprintf("%d schedulable nodes of tenant %s", n, tenantID)
	if poolID != "" {
		what = fmt.Sprintf("%d schedulable nodes in pool %s", n, poolID)
	}
	return poll(ctx, c, what,
		func(ctx context.Context) ([]*computev1.Node, error) {
			var ready []*computev1.Node
			req := &computev1.NodesServiceListRequest{TenantId: tenantID, PoolId: poolID, PageSize: 1000}
			for range maxListPages {
				resp, err := c.Nodes.List(ctx, req)
				if err != nil {
					return nil, err
				}
				for _, node := range resp.GetNodes() {
					if node.GetSchedulable() {
						ready = append(ready, node)
					}
				}
				if req.PageToken = resp.GetNextPageToken(); req.PageToken == "" {
					return ready, nil
				}
			}
			return nil, fmt.Errorf("client: nodes.list answered more than %d pages", maxListPages)
		},
		func(ready []*computev1.Node) (bool, string) {
			return len(ready) >= n, fmt.Sprintf("has %d", len(ready))
		})
}

// poll calls get until done reports true for its result, pausing c's poll
// interval between calls, and returns that result. An UNAVAILABLE failure is
// retried; any other is returned. When ctx ends it returns the last result
// and an error wrapping ctx.Err() that says how things stood (done's
// description) and the last failure, if any.
func poll[T any](ctx context.Context, c *Client, what string, get func(context.Context) (T, error), done func(T) (bool, string)) (T, error) {
	interval := cmp.Or(c.PollInterval, DefaultPollInterval)
	var last T
	stood, lastErr := "was never read", error(nil)
	timer := time.NewTimer(0)
	defer timer.Stop()
	for {
		v, err := get(ctx)
		switch {
		case err == nil:
			last, lastErr = v, nil
			var ok bool
			if ok, stood = done(v); ok {
				return v, nil
			}
		case ctx.Err() != nil:
			// The call failed because ctx ended: report that below.
		case status.Code(err) == codes.Unavailable:
			lastErr = err
		default:
			return last, err
		}
		if ctx.Err() == nil {
			timer.Reset(interval)
			select {
			case <-ctx.Done():
			case <-timer.C:
				continue
			}
		}
		if lastErr != nil {
			return last, fmt.Errorf("client: wait for %s: it %s, last read failed (%s): %w", what, stood, status.Convert(lastErr).Message(), ctx.Err())
		}
		return last, fmt.Errorf("client: wait for %s: it %s: %w", what, stood, ctx.Err())
	}
}

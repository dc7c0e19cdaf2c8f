package api

import (
	"context"
	"encoding/json"
	"slices"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"

	"github.com/bettercompute/bettercompute/pkg/admission"
	"github.com/bettercompute/bettercompute/pkg/authz"
	"github.com/bettercompute/bettercompute/pkg/events"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/iam"
	"github.com/bettercompute/bettercompute/pkg/outbound"
	"github.com/bettercompute/bettercompute/pkg/outbox"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
	"github.com/bettercompute/bettercompute/pkg/webhooks"
)

// Bounds on a webhook's fields.
const (
	maxWebhookDescription = 256
	maxWebhookEventTypes  = events.MaxPatterns
)

// webhooksAPI implements computev1.WebhooksServiceServer.
type webhooksAPI struct {
	*Server
	computev1.UnimplementedWebhooksServiceServer
}

func webhookPB(w webhooks.Webhook) *computev1.Webhook {
	return &computev1.Webhook{
		Id: w.ID, TenantId: w.TenantID, Url: w.URL, EventTypes: w.EventTypes, Description: w.Description,
		IncludeDescendants: w.IncludeDescendants, Enabled: w.Enabled, DisabledReason: w.DisabledReason,
		CreateTime: ts(w.CreatedAt), UpdateTime: ts(w.UpdatedAt), PreviousSecretExpireTime: tsp(w.PreviousExpiresAt),
		CreatedBy: w.CreatedBy,
	}
}

func deliveryPB(d webhooks.Delivery) *computev1.WebhookDelivery {
	out := &computev1.WebhookDelivery{
		Id: strconv.FormatInt(d.ID, 10), WebhookId: d.WebhookID, EventId: events.EventID(d.EventID), EventType: d.EventType,
		State: d.State, Attempts: int32(d.Attempts), LastStatusCode: int32(d.LastStatus), LastError: d.LastError,
		CreateTime: ts(d.CreatedAt), FinishTime: tsp(d.FinishedAt),
	}
	if d.State == webhooks.Pending {
		out.NextAttemptTime = ts(d.NextAttemptAt)
	}
	return out
}

// checkURL validates a webhook endpoint under the configured outbound
// rules.
func (s *webhooksAPI) checkURL(u string) error {
	if err := required("url", u); err != nil {
		return err
	}
	return webhooks.CheckEndpoint(u, outbound.Options{Setting: "webhooks", AllowInsecure: s.allowInsecureWebhooks, AllowPrivateNetworks: s.allowPrivateWebhooks})
}

// checkTypes validates a webhook's event types.
func checkTypes(types []string) error {
	if len(types) == 0 {
		return fault.New(fault.InvalidInput, "eventTypes", "required: at least one event type or pattern (\"*\" for all)")
	}
	if len(types) > maxWebhookEventTypes {
		return fault.New(fault.InvalidInput, "eventTypes", "at most %d, got %d", maxWebhookEventTypes, len(types))
	}
	for _, t := range types {
		if err := events.CheckPattern(t); err != nil {
			return fault.New(fault.InvalidInput, "eventTypes", "%v", err)
		}
		if !strings.HasSuffix(t, "*") {
			if _, ok := events.Lookup(t); !ok {
				return fault.New(fault.InvalidInput, "eventTypes", "%q is not an event type (see docs/events.md)", t)
			}
		}
	}
	return nil
}

func (s *webhooksAPI) Create(ctx context.Context, req *computev1.WebhooksServiceCreateRequest) (*computev1.WebhooksServiceCreateResponse, error) {
	if err := s.checkURL(req.GetUrl()); err != nil {
		return nil, err
	}
	if err := checkTypes(req.GetEventTypes()); err != nil {
		return nil, err
	}
	if len(req.GetDescription()) > maxWebhookDescription {
		return nil, fault.New(fault.InvalidInput, "description", "at most %d characters", maxWebhookDescription)
	}
	token, key := webhooks.NewSecret() // returned only by the call that stores it
	newID := webhooks.NewID()
	out := &computev1.WebhooksServiceCreateResponse{}
	res, err := s.create(ctx, req, req.GetIdempotencyKey(), admission.Create{
		Call:     admission.Call{TenantID: req.GetTenantId()},
		Resource: authz.Resource{Type: authz.TypeWebhook, ID: newID, TenantID: req.GetTenantId()},
		Work: func(ctx context.Context, tx pgx.Tx, q *reconcile.Queue, id string) (admission.Outcome, error) {
			if id != newID {
				return admission.Outcome{}, fault.New(fault.Conflict, "idempotencyKey", "a request under idempotency key %q is still creating this webhook; retry to read its result", req.GetIdempotencyKey())
			}
			caller, _ := iam.PrincipalFrom(ctx)
			w, err := webhooks.Create(ctx, tx, webhooks.Webhook{
				ID: id, TenantID: req.GetTenantId(), URL: req.GetUrl(), EventTypes: req.GetEventTypes(),
				Description: req.GetDescription(), IncludeDescendants: req.GetIncludeDescendants(), Secret: key,
				CreatedBy: caller.IdentityID,
			})
			if err != nil {
				return admission.Outcome{}, err
			}
			// The stored (and replayed) response, and the event, carry no secret.
			return outcome(&computev1.WebhooksServiceCreateResponse{Webhook: webhookPB(w)}, "webhook.created", nil)
		},
	}, out)
	if err != nil {
		return nil, err
	}
	if !res.Replayed && res.ResourceID == newID {
		out.Secret = token
	}
	return out, nil
}

// resource reads the webhook's projection row (NOT_FOUND in another
// tenant).
func (s *webhooksAPI) resource(ctx context.Context, tenant, id string) (authz.Resource, error) {
	if err := required("webhookId", id); err != nil {
		return authz.Resource{}, err
	}
	return authz.Get(ctx, s.db, tenant, authz.TypeWebhook, id, "webhookId")
}

func (s *webhooksAPI) Get(ctx context.Context, req *computev1.WebhooksServiceGetRequest) (*computev1.WebhooksServiceGetResponse, error) {
	res, err := s.resource(ctx, req.GetTenantId(), req.GetWebhookId())
	if err != nil {
		return nil, err
	}
	if err := s.read(ctx, req.GetTenantId(), res); err != nil {
		return nil, err
	}
	w, err := webhooks.Get(ctx, s.db, req.GetTenantId(), req.GetWebhookId())
	if err != nil {
		return nil, err
	}
	return &computev1.WebhooksServiceGetResponse{Webhook: webhookPB(w)}, nil
}

func (s *webhooksAPI) List(ctx context.Context, req *computev1.WebhooksServiceListRequest) (*computev1.WebhooksServiceListResponse, error) {
	pg, err := readPage(req)
	if err != nil {
		return nil, err
	}
	if err := s.read(ctx, req.GetTenantId(), authz.TenantResource(req.GetTenantId())); err != nil {
		return nil, err
	}
	ws, err := webhooks.List(ctx, s.db, req.GetTenantId(), pg.after, pg.size)
	if err != nil {
		return nil, err
	}
	out := &computev1.WebhooksServiceListResponse{}
	for _, w := range ws {
		out.Webhooks = append(out.Webhooks, webhookPB(w))
	}
	out.NextPageToken = nextPage(pg, ws, func(w webhooks.Webhook) string { return w.ID })
	return out, nil
}

func (s *webhooksAPI) Update(ctx context.Context, req *computev1.WebhooksServiceUpdateRequest) (*computev1.WebhooksServiceUpdateResponse, error) {
	if req.Url != nil {
		if err := s.checkURL(req.GetUrl()); err != nil {
			return nil, err
		}
	}
	if len(req.GetEventTypes()) > 0 {
		if err := checkTypes(req.GetEventTypes()); err != nil {
			return nil, err
		}
	}
	if len(req.GetDescription()) > maxWebhookDescription {
		return nil, fault.New(fault.InvalidInput, "description", "at most %d characters", maxWebhookDescription)
	}
	res, err := s.resource(ctx, req.GetTenantId(), req.GetWebhookId())
	if err != nil {
		return nil, err
	}
	out := &computev1.WebhooksServiceUpdateResponse{}
	err = s.mutate(ctx, admission.Mutation{
		Call:     admission.Call{TenantID: req.GetTenantId()},
		Resource: res,
		Work: func(ctx context.Context, tx pgx.Tx, q *reconcile.Queue) (admission.Outcome, error) {
			w, err := webhooks.Lock(ctx, tx, req.GetTenantId(), req.GetWebhookId())
			if err != nil {
				return admission.Outcome{}, err
			}
			if req.Url != nil {
				w.URL = req.GetUrl()
			}
			if len(req.GetEventTypes()) > 0 {
				w.EventTypes = slices.Clone(req.GetEventTypes())
			}
			if req.Description != nil {
				w.Description = req.GetDescription()
			}
			if req.IncludeDescendants != nil {
				w.IncludeDescendants = req.GetIncludeDescendants()
			}
			if req.Enabled != nil {
				w.Enabled = req.GetEnabled()
				w.DisabledReason = ""
				if !w.Enabled {
					w.DisabledReason = webhooks.ReasonByRequest
				}
			}
			if w, err = webhooks.Save(ctx, tx, w); err != nil {
				return admission.Outcome{}, err
			}
			return outcome(&computev1.WebhooksServiceUpdateResponse{Webhook: webhookPB(w)}, "webhook.updated", nil)
		},
	}, out)
	if err != nil {
		return nil, err
	}
	return out, nil
}

func (s *webhooksAPI) Delete(ctx context.Context, req *computev1.WebhooksServiceDeleteRequest) (*computev1.WebhooksServiceDeleteResponse, error) {
	res, err := s.resource(ctx, req.GetTenantId(), req.GetWebhookId())
	if err != nil {
		return nil, err
	}
	out := &computev1.WebhooksServiceDeleteResponse{}
	err = s.mutate(ctx, admission.Mutation{
		Call:     admission.Call{TenantID: req.GetTenantId()},
		Resource: res,
		Work: func(ctx context.Context, tx pgx.Tx, q *reconcile.Queue) (admission.Outcome, error) {
			w, err := webhooks.Lock(ctx, tx, req.GetTenantId(), req.GetWebhookId())
			if err != nil {
				return admission.Outcome{}, err
			}
			if err := webhooks.Delete(ctx, tx, req.GetTenantId(), req.GetWebhookId()); err != nil {
				return admission.Outcome{}, err
			}
			if err := authz.Delete(ctx, tx, authz.TypeWebhook, req.GetWebhookId()); err != nil {
				return admission.Outcome{}, err
			}
			return outcome(&computev1.WebhooksServiceDeleteResponse{Webhook: webhookPB(w)}, "webhook.deleted", nil)
		},
	}, out)
	if err != nil {
		return nil, err
	}
	return out, nil
}

func (s *webhooksAPI) RotateSecret(ctx context.Context, req *computev1.WebhooksServiceRotateSecretRequest) (*computev1.WebhooksServiceRotateSecretResponse, error) {
	res, err := s.resource(ctx, req.GetTenantId(), req.GetWebhookId())
	if err != nil {
		return nil, err
	}
	token, key := webhooks.NewSecret()
	out := &computev1.WebhooksServiceRotateSecretResponse{}
	err = s.mutate(ctx, admission.Mutation{
		Call:     admission.Call{TenantID: req.GetTenantId()},
		Resource: res,
		Work: func(ctx context.Context, tx pgx.Tx, q *reconcile.Queue) (admission.Outcome, error) {
			w, err := webhooks.Lock(ctx, tx, req.GetTenantId(), req.GetWebhookId())
			if err != nil {
				return admission.Outcome{}, err
			}
			until := s.now().Add(webhooks.RotationOverlap)
			w.Previous, w.PreviousExpiresAt, w.Secret = w.Secret, &until, key
			if w, err = webhooks.Save(ctx, tx, w); err != nil {
				return admission.Outcome{}, err
			}
			// The response stored as the event's payload has no secret.
			return outcome(&computev1.WebhooksServiceRotateSecretResponse{Webhook: webhookPB(w)}, "webhook.secret_rotated", nil)
		},
	}, out)
	if err != nil {
		return nil, err
	}
	out.Secret = token
	return out, nil
}

func (s *webhooksAPI) Test(ctx context.Context, req *computev1.WebhooksServiceTestRequest) (*computev1.WebhooksServiceTestResponse, error) {
	res, err := s.resource(ctx, req.GetTenantId(), req.GetWebhookId())
	if err != nil {
		return nil, err
	}
	out := &computev1.WebhooksServiceTestResponse{}
	err = s.mutate(ctx, admission.Mutation{
		Call:     admission.Call{TenantID: req.GetTenantId()},
		Resource: res,
		Work: func(ctx context.Context, tx pgx.Tx, q *reconcile.Queue) (admission.Outcome, error) {
			// The test event and its one delivery commit together; the
			// fan-out sends webhook.test only to the webhook it names, so it
			// adds nothing.
			payload, _ := json.Marshal(map[string]string{"webhookId": req.GetWebhookId(), "message": "a test event from webhooks.test"})
			id, err := outbox.Write(ctx, tx, outbox.Event{TenantID: req.GetTenantId(), Type: "webhook.test", Resource: req.GetWebhookId(), Payload: json.RawMessage(payload)})
			if err != nil {
				return admission.Outcome{}, err
			}
			d, err := webhooks.InsertOne(ctx, tx, webhooks.Planned{WebhookID: req.GetWebhookId(), EventID: id, TenantID: req.GetTenantId()})
			if err != nil {
				return admission.Outcome{}, err
			}
			d.EventType = "webhook.test"
			q.WakeDeliveries()
			return outcome(&computev1.WebhooksServiceTestResponse{Delivery: deliveryPB(d)}, "webhook.tested", nil)
		},
	}, out)
	if err != nil {
		return nil, err
	}
	return out, nil
}

func (s *webhooksAPI) ListDeliveries(ctx context.Context, req *computev1.WebhooksServiceListDeliveriesRequest) (*computev1.WebhooksServiceListDeliveriesResponse, error) {
	pg, err := readPage(req)
	if err != nil {
		return nil, err
	}
	var before int64
	if pg.after != "" {
		if before, err = strconv.ParseInt(pg.after, 10, 64); err != nil {
			return nil, fault.New(fault.InvalidInput, "pageToken", "not a page token from this API")
		}
	}
	if st := req.GetState(); st != "" && st != webhooks.Pending && st != webhooks.Succeeded && st != webhooks.Failed {
		return nil, fault.New(fault.InvalidInput, "state", "expected pending, succeeded or failed, got %q", st)
	}
	if err := required("webhookId", req.GetWebhookId()); err != nil {
		return nil, err
	}
	res, err := authz.Get(ctx, s.db, req.GetTenantId(), authz.TypeWebhook, req.GetWebhookId(), "webhookId")
	if err != nil {
		return nil, err
	}
	if err := s.read(ctx, req.GetTenantId(), res); err != nil {
		return nil, err
	}
	ds, err := webhooks.ListDeliveries(ctx, s.db, webhooks.DeliveryFilter{
		TenantID: req.GetTenantId(), WebhookID: req.GetWebhookId(), State: req.GetState(), BeforeID: before, Limit: pg.size,
	})
	if err != nil {
		return nil, err
	}
	out := &computev1.WebhooksServiceListDeliveriesResponse{}
	for _, d := range ds {
		out.Deliveries = append(out.Deliveries, deliveryPB(d))
	}
	out.NextPageToken = nextPage(pg, ds, func(d webhooks.Delivery) string { return strconv.FormatInt(d.ID, 10) })
	return out, nil
}

func (s *webhooksAPI) Redeliver(ctx context.Context, req *computev1.WebhooksServiceRedeliverRequest) (*computev1.WebhooksServiceRedeliverResponse, error) {
	if err := required("deliveryId", req.GetDeliveryId()); err != nil {
		return nil, err
	}
	id, err := strconv.ParseInt(req.GetDeliveryId(), 10, 64)
	if err != nil || id <= 0 {
		return nil, fault.New(fault.InvalidInput, "deliveryId", "expected a delivery id from webhooks.listDeliveries, got %q", req.GetDeliveryId())
	}
	d, err := webhooks.GetDelivery(ctx, s.db, req.GetTenantId(), id)
	if err != nil {
		return nil, err
	}
	res, err := authz.Get(ctx, s.db, req.GetTenantId(), authz.TypeWebhook, d.WebhookID, "deliveryId")
	if err != nil {
		return nil, err
	}
	out := &computev1.WebhooksServiceRedeliverResponse{}
	err = s.mutate(ctx, admission.Mutation{
		Call:     admission.Call{TenantID: req.GetTenantId()},
		Resource: res,
		Work: func(ctx context.Context, tx pgx.Tx, q *reconcile.Queue) (admission.Outcome, error) {
			d, err := webhooks.Redeliver(ctx, tx, req.GetTenantId(), id)
			if err != nil {
				return admission.Outcome{}, err
			}
			q.WakeDeliveries()
			return outcome(&computev1.WebhooksServiceRedeliverResponse{Delivery: deliveryPB(d)}, "webhook.redelivered", nil)
		},
	}, out)
	if err != nil {
		return nil, err
	}
	return out, nil
}

package api

import (
	"context"
	"encoding/base64"
	"encoding/hex"
	"strconv"

	"google.golang.org/protobuf/types/known/structpb"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"

	"github.com/bettercompute/bettercompute/pkg/audit"
	"github.com/bettercompute/bettercompute/pkg/authz"
	"github.com/bettercompute/bettercompute/pkg/fault"
)

// auditLog implements computev1.AuditServiceServer.
type auditLog struct {
	*Server
	computev1.UnimplementedAuditServiceServer
}

func (s *auditLog) List(ctx context.Context, req *computev1.AuditServiceListRequest) (*computev1.AuditServiceListResponse, error) {
	pg, err := readPage(req)
	if err != nil {
		return nil, err
	}
	f := audit.Filter{
		TenantID: req.GetTenantId(), Actor: req.GetActor(), Action: req.GetAction(),
		Resource: req.GetResource(), Decision: req.GetDecision(), Limit: pg.size,
	}
	if pg.after != "" {
		if f.BeforeID, err = strconv.ParseInt(pg.after, 10, 64); err != nil {
			return nil, fault.New(fault.InvalidInput, "pageToken", "not a page token from this API")
		}
	}
	if d := f.Decision; d != "" && d != audit.Allow && d != audit.Deny {
		return nil, fault.New(fault.InvalidInput, "decision", "expected allow or deny, got %q", d)
	}
	if req.StartTime != nil {
		f.Since = req.GetStartTime().AsTime()
	}
	if req.EndTime != nil {
		f.Until = req.GetEndTime().AsTime()
	}
	if err := s.read(ctx, req.GetTenantId(), authz.TenantResource(req.GetTenantId())); err != nil {
		return nil, err
	}
	rs, err := audit.List(ctx, s.db, f)
	if err != nil {
		return nil, err
	}
	out := &computev1.AuditServiceListResponse{}
	for _, r := range rs {
		detail, _ := structpb.NewStruct(r.Detail)
		out.Records = append(out.Records, &computev1.AuditRecord{
			Id: strconv.FormatInt(r.ID, 10), Time: ts(r.At), TenantId: r.TenantID, Actor: r.Actor,
			ActorTenantId: r.ActorTenantID, Action: r.Action, Resource: r.Resource, Decision: r.Decision,
			RequestId: r.RequestID, Method: r.Method, Detail: detail,
		})
	}
	out.NextPageToken = nextPage(pg, rs, func(r audit.Record) string { return strconv.FormatInt(r.ID, 10) })
	return out, nil
}

// Verify recomputes the audit hash chain and checks its checkpoints with the
// configured audit key. The chain spans every tenant, so it is verified on
// root only.
func (s *auditLog) Verify(ctx context.Context, req *computev1.AuditServiceVerifyRequest) (*computev1.AuditServiceVerifyResponse, error) {
	if t := req.GetTenantId(); t != "" && t != "root" {
		return nil, fault.New(fault.InvalidInput, "tenantId", "the audit chain spans every tenant: verify on root")
	}
	if err := s.read(ctx, "root", authz.TenantResource("root")); err != nil {
		return nil, err
	}
	v, err := audit.Verify(ctx, s.db, s.auditKey)
	if err != nil {
		return nil, err
	}
	out := &computev1.AuditServiceVerifyResponse{
		Ok: v.OK, RecordsChecked: v.RecordsChecked, FirstBadRecordId: v.FirstBadID, Reason: v.Reason,
		RecordsUnchained: v.Unchained,
	}
	if cp := v.LastCheckpoint; cp != nil {
		out.LastCheckpoint = &computev1.AuditCheckpoint{
			ChainSeq: strconv.FormatInt(cp.ChainSeq, 10), HeadHash: hex.EncodeToString(cp.HeadHash), Time: ts(cp.At),
			Signature: base64.StdEncoding.EncodeToString(cp.Signature), KeyId: cp.KeyID,
		}
	}
	return out, nil
}

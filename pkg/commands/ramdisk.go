package commands

import (
	"cmp"
	"context"
	"crypto/ed25519"
	"fmt"
	"slices"

	"github.com/jackc/pgx/v5"
	"google.golang.org/protobuf/proto"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
	"github.com/bettercompute/bettercompute/proto/resultsig"

	"github.com/bettercompute/bettercompute/pkg/nodeca"
)

// Commands and the ramdisk.
//
// A node in its ramdisk (bcd ramdisk: a session whose certificate has role
// ramdisk) is sent only the commissioning flow's kinds (Kind.Ramdisk or
// Kind.RamdiskOnly: diag.nvml, disk.wipe, image.deploy, node.kexec), and a
// node that is not is never sent a RamdiskOnly kind. [Registry.ClaimSession]
// fails any other due command at dispatch, with [ReasonInRamdisk] or
// [ReasonRamdiskOnly], in the statement that claims the rest.
//
// The ramdisk signs the update that finishes every command it ran with its
// Ed25519 key (proto/resultsig); [Registry.Apply] stores that signature with
// the outcome and reason it signed ([NodeSignature]), and
// [VerifyNodeSignature] checks a finished command's stored result against
// the key of the ramdisk certificate the control plane issued to the node —
// so a gateway, which only relays, can neither report a wipe that did not
// happen nor change what one reported.

// Reasons a command is failed at dispatch.
const (
	// ReasonInRamdisk: the node is in its ramdisk, which runs only the
	// commissioning flow's kinds.
	ReasonInRamdisk = "refused: the node is in its ramdisk"
	// ReasonRamdiskOnly: the kind runs only in a node's ramdisk (bcd
	// ramdisk), and this session is not one.
	ReasonRamdiskOnly = "refused: the kind runs only in the node's ramdisk (bcd ramdisk)"
)

// SendableTo reports whether a session (in its ramdisk or not) is sent
// commands of kind name. A kind this registry does not know is sent only
// to a node that is not in its ramdisk.
func (r *Registry) SendableTo(name string, ramdisk bool) bool {
	k, ok := r.Lookup(name)
	if !ok {
		return !ramdisk
	}
	return k.SendableTo(ramdisk)
}

// ClaimSession is [Claim] for a session that is, or is not, a node's
// ramdisk (ramdisk): in one statement, in tx, it claims the node's due
// pending commands of the kinds the session may be sent (in flight,
// attempts + 1) and fails the others with [ReasonInRamdisk] or
// [ReasonRamdiskOnly], writing each one's event and waking the owners of
// the failed ones through w — only while epoch is the node's session
// epoch. It returns the claimed ones by seq, ready to send.
func (r *Registry) ClaimSession(ctx context.Context, tx pgx.Tx, w Waker, nodeID string, epoch int64, ramdisk bool) ([]Command, error) {
	// For a ramdisk, the kinds it may be sent; otherwise the kinds it
	// may not.
	var list []string
	for _, k := range r.Kinds() {
		if ramdisk && k.SendableTo(true) || !ramdisk && !k.SendableTo(false) {
			list = append(list, k.Name)
		}
	}
	if list == nil {
		list = []string{}
	}
	cs, err := collect(tx.Query(ctx, `
		WITH due AS (
			SELECT c.id, CASE WHEN $3 THEN c.kind = ANY($4) ELSE NOT (c.kind = ANY($4)) END AS ok
			  FROM commands c JOIN nodes n ON n.id = c.node_id AND n.session_epoch = $2
			 WHERE c.node_id = $1 AND c.state = 'pending' AND c.next_attempt_at <= now() AND c.not_after > now()
			 ORDER BY c.seq FOR UPDATE OF c SKIP LOCKED)
		UPDATE commands c SET state = CASE WHEN due.ok THEN 'in_flight' ELSE 'failed' END,
		       attempts = c.attempts + CASE WHEN due.ok THEN 1 ELSE 0 END,
		       dispatched_at = CASE WHEN due.ok THEN now() ELSE c.dispatched_at END,
		       reason = CASE WHEN due.ok THEN c.reason WHEN $3 THEN $5 ELSE $6 END,
		       finished_at = CASE WHEN due.ok THEN c.finished_at ELSE now() END,
		       updated_at = now()
		  FROM due WHERE c.id = due.id
		RETURNING `+qualified("c"), nodeID, epoch, ramdisk, list, ReasonInRamdisk, ReasonRamdiskOnly))
	if err != nil {
		return nil, fmt.Errorf("claim commands of %s: %w", nodeID, err)
	}
	out := cs[:0:0]
	for _, c := range cs {
		if err := event(ctx, tx, c); err != nil {
			return nil, err
		}
		if c.State == InFlight {
			out = append(out, c)
			continue
		}
		if c.OwnerKind != "" && w != nil {
			if err := w.Enqueue(ctx, c.OwnerKind, c.OwnerKey); err != nil {
				return nil, fmt.Errorf("wake owner of %s: %w", c.ID, err)
			}
		}
	}
	slices.SortFunc(out, func(a, b Command) int { return cmp.Compare(a.Seq, b.Seq) })
	return out, nil
}

// NodeSignature is a node's signature over the update that finished a
// command (agentv1.NodeSignature), stored with the outcome and reason the
// node reported and signed (the stored state and reason are derived from
// them; the result is stored as reported).
type NodeSignature struct {
	KeyID     string `json:"keyId"`
	Algorithm string `json:"algorithm"`
	Signature []byte `json:"signature"`
	// Outcome is the signed outcome's enum name, e.g.
	// "COMMAND_OUTCOME_SUCCEEDED".
	Outcome string `json:"outcome"`
	// Reason is the signed reason, as reported.
	Reason string `json:"reason"`
}

// Bounds of a stored node signature: one that exceeds them is not stored
// (the command then reads as unsigned and fails verification).
const (
	maxNodeSigReason = 4096
)

// nodeSignatureOf returns u's node signature to store, or nil when u has
// none or it is out of bounds.
func nodeSignatureOf(u *agentv1.CommandUpdate) *NodeSignature {
	sig := u.GetNodeSignature()
	if sig == nil || len(sig.GetKeyId()) > resultsig.KeyIDLen || len(sig.GetAlgorithm()) > resultsig.MaxAlgorithm ||
		len(sig.GetSignature()) > ed25519.SignatureSize || len(u.GetReason()) > maxNodeSigReason {
		return nil
	}
	return &NodeSignature{KeyID: sig.GetKeyId(), Algorithm: sig.GetAlgorithm(), Signature: sig.GetSignature(),
		Outcome: u.GetOutcome().String(), Reason: u.GetReason()}
}

// settled is the state and reason a command takes from a final update's
// outcome (SUCCEEDED, FAILED or CANCELLED) and reason.
func settled(o agentv1.CommandOutcome, reason string) (State, string) {
	switch o {
	case agentv1.CommandOutcome_COMMAND_OUTCOME_SUCCEEDED:
		return Succeeded, ""
	case agentv1.CommandOutcome_COMMAND_OUTCOME_FAILED:
		return Failed, cmp.Or(reason, "failed")
	case agentv1.CommandOutcome_COMMAND_OUTCOME_CANCELLED:
		return Cancelled, cmp.Or(reason, ReasonCancelled)
	}
	return "", ""
}

// VerifyNodeSignature checks that cmd, a finished command as read from the
// commands table, was finished by an update its node signed: the update is
// rebuilt from cmd (its id, seq, state, reason and result, and the stored
// signature with the outcome and reason it covers, which must be what
// produced cmd's state and reason) and verified (resultsig.Verify) for the
// subject taken from cmd — trustDomain, node, command id, kind, seq — with
// the key of the ramdisk certificate the control plane issued to the node
// that key id names (nodeca.RamdiskCertificates; the newest when none
// does). That certificate must have been valid, and not yet revoked, when
// the command finished.
//
// Every refusal wraps resultsig.ErrBadSignature: no signature (an unsigned
// update, or a command settled by the control plane, like a node.kexec that
// succeeds when the node reconnects), a state or reason that does not
// follow from what was signed, no ramdisk certificate, another key, a
// tampered result. Other errors are the database's.
func VerifyNodeSignature(ctx context.Context, q Querier, cmd Command, trustDomain string) error {
	sig := cmd.NodeSignature
	if sig == nil {
		return fmt.Errorf("command %s: %w: the update that finished it was unsigned (state %s)", cmd.ID, resultsig.ErrBadSignature, cmd.State)
	}
	v, ok := agentv1.CommandOutcome_value[sig.Outcome]
	outcome := agentv1.CommandOutcome(v)
	state, reason := settled(outcome, sig.Reason)
	if !ok || state == "" {
		return fmt.Errorf("command %s: %w: signed outcome %.32q is not a final one", cmd.ID, resultsig.ErrBadSignature, sig.Outcome)
	}
	if state != cmd.State || reason != cmd.Reason {
		return fmt.Errorf("command %s: %w: it is %s (%q), but the node signed %s (%q)", cmd.ID, resultsig.ErrBadSignature,
			cmd.State, cmd.Reason, state, reason)
	}
	u := &agentv1.CommandUpdate{Id: cmd.ID, Seq: cmd.Seq, Outcome: outcome, Reason: sig.Reason,
		NodeSignature: &agentv1.NodeSignature{KeyId: sig.KeyID, Algorithm: sig.Algorithm, Signature: sig.Signature}}
	if len(cmd.Result) > 0 {
		var res agentv1.CommandResult
		if err := proto.Unmarshal(cmd.Result, &res); err != nil {
			return fmt.Errorf("command %s: %w: the stored result does not decode: %v", cmd.ID, resultsig.ErrBadSignature, err)
		}
		u.Result = &res
	}
	certs, err := nodeca.RamdiskCertificates(ctx, q, cmd.NodeID)
	if err != nil {
		return err
	}
	if len(certs) == 0 {
		return fmt.Errorf("command %s: %w: node %s never held a ramdisk certificate", cmd.ID, resultsig.ErrBadSignature, cmd.NodeID)
	}
	cert := certs[0]
	if i := slices.IndexFunc(certs, func(c nodeca.RamdiskCertificate) bool { return resultsig.KeyID(c.PublicKey) == sig.KeyID }); i >= 0 {
		cert = certs[i]
	}
	if cmd.FinishedAt != nil {
		at := *cmd.FinishedAt
		switch {
		case at.Before(cert.NotBefore) || at.After(cert.NotAfter):
			return fmt.Errorf("command %s: %w: it finished at %s, outside ramdisk certificate %s (%s to %s)", cmd.ID, resultsig.ErrBadSignature,
				at.UTC().Format("15:04:05Z"), cert.Serial, cert.NotBefore.UTC().Format("15:04:05Z"), cert.NotAfter.UTC().Format("15:04:05Z"))
		case cert.RevokedAt != nil && cert.RevokedAt.Before(at):
			return fmt.Errorf("command %s: %w: it finished after ramdisk certificate %s was revoked", cmd.ID, resultsig.ErrBadSignature, cert.Serial)
		}
	}
	s := resultsig.Subject{TrustDomain: trustDomain, NodeID: cmd.NodeID, CommandID: cmd.ID, Kind: cmd.Kind, Seq: cmd.Seq}
	if err := resultsig.Verify(u, s, cert.PublicKey); err != nil {
		return fmt.Errorf("command %s: %w", cmd.ID, err)
	}
	return nil
}

package sites

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/nodeca"
	"github.com/bettercompute/bettercompute/pkg/secret"
)

// Agent is an enrolled site agent: one `bcd site` process's identity.
type Agent struct {
	ID         string
	TenantID   string
	SiteID     string
	TokenID    string
	Hostname   string
	CreatedAt  time.Time
	LastSeenAt *time.Time
	RevokedAt  *time.Time
}

// NewAgentID returns a new site agent id, "sag_…".
func NewAgentID() string { return "sag_" + secret.Random(10) }

const agentCols = `id, tenant_id, site_id, coalesce(token_id, ''), hostname, created_at, last_seen_at, revoked_at`

func scanAgent(r pgx.Row) (Agent, error) {
	var a Agent
	err := r.Scan(&a.ID, &a.TenantID, &a.SiteID, &a.TokenID, &a.Hostname, &a.CreatedAt, &a.LastSeenAt, &a.RevokedAt)
	return a, err
}

// CreateAgent stores a newly enrolled agent.
func CreateAgent(ctx context.Context, q Querier, a Agent) (Agent, error) {
	out, err := scanAgent(q.QueryRow(ctx, `
		INSERT INTO site_agents (id, tenant_id, site_id, token_id, hostname) VALUES ($1, $2, $3, nullif($4, ''), $5)
		RETURNING `+agentCols, a.ID, a.TenantID, a.SiteID, a.TokenID, a.Hostname))
	if err != nil {
		return Agent{}, fmt.Errorf("insert site agent: %w", err)
	}
	return out, nil
}

// GetAgent reads one agent; NOT_FOUND on "agentId" otherwise.
func GetAgent(ctx context.Context, q Querier, id string) (Agent, error) {
	a, err := scanAgent(q.QueryRow(ctx, `SELECT `+agentCols+` FROM site_agents WHERE id = $1`, id))
	if errors.Is(err, pgx.ErrNoRows) {
		return Agent{}, fault.New(fault.NotFound, "agentId", "site agent %q not found", id)
	}
	if err != nil {
		return Agent{}, fmt.Errorf("read site agent %s: %w", id, err)
	}
	return a, nil
}

// ListAgents returns every agent of one site, in id order (a site has a
// handful).
func ListAgents(ctx context.Context, q Querier, site string) ([]Agent, error) {
	rows, err := q.Query(ctx, `SELECT `+agentCols+` FROM site_agents WHERE site_id = $1 ORDER BY id LIMIT 1000`, site)
	if err != nil {
		return nil, fmt.Errorf("list site agents: %w", err)
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (Agent, error) { return scanAgent(r) })
}

// RevokedAgents returns which of ids are revoked agents, in one statement
// (a gateway's every site session at once).
func RevokedAgents(ctx context.Context, q Querier, ids []string) ([]string, error) {
	rows, err := q.Query(ctx, `SELECT id FROM site_agents WHERE id = ANY($1) AND revoked_at IS NOT NULL`, ids)
	if err != nil {
		return nil, fmt.Errorf("check site agents' revocation: %w", err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("check site agents' revocation: %w", err)
	}
	return out, nil
}

// Touch records that agent was seen now.
func Touch(ctx context.Context, q Querier, agent string) error {
	if _, err := q.Exec(ctx, `UPDATE site_agents SET last_seen_at = now() WHERE id = $1`, agent); err != nil {
		return fmt.Errorf("touch site agent %s: %w", agent, err)
	}
	return nil
}

// RevokeAgent marks an agent of site revoked, revokes its certificates
// (gateways close its session at their next check) and ends its boot lease
// if it holds one; NOT_FOUND on "agentId" otherwise.
func RevokeAgent(ctx context.Context, q Querier, site, agent string) (Agent, error) {
	a, err := scanAgent(q.QueryRow(ctx, `UPDATE site_agents SET revoked_at = coalesce(revoked_at, now())
		WHERE site_id = $1 AND id = $2 RETURNING `+agentCols, site, agent))
	if errors.Is(err, pgx.ErrNoRows) {
		return Agent{}, fault.New(fault.NotFound, "agentId", "site agent %q not found in site %s", agent, site)
	}
	if err != nil {
		return Agent{}, fmt.Errorf("revoke site agent %s: %w", agent, err)
	}
	if _, err := nodeca.RevokeSiteAgent(ctx, q, agent); err != nil {
		return Agent{}, err
	}
	if err := ReleaseLease(ctx, q, site, agent); err != nil {
		return Agent{}, err
	}
	return a, nil
}

package api_test

import (
	"crypto/ed25519"
	"crypto/rand"
	"encoding/base64"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"google.golang.org/protobuf/types/known/fieldmaskpb"

	"github.com/bettercompute/bettercompute/proto/agentrelease"
	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"

	"github.com/bettercompute/bettercompute/pkg/authz"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/fixture"
	"github.com/bettercompute/bettercompute/pkg/nodes"
	desired "github.com/bettercompute/bettercompute/pkg/nodespec"
	"github.com/bettercompute/bettercompute/pkg/poll"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
	"github.com/bettercompute/bettercompute/services/api"
)

// manifestText is a release manifest's JSON text, signed with key unless
// key is nil; edit changes it before it is signed.
func manifestText(t *testing.T, key ed25519.PrivateKey, edit func(*agentrelease.Manifest)) string {
	t.Helper()
	m := &agentrelease.Manifest{Version: "v0.2.0", URL: "https://cp.example/artifacts/bcd-v0.2.0-linux-amd64",
		SHA256: strings.Repeat("ab", 32), Size: 1000, Platform: "linux/amd64", NotAfter: time.Now().Add(time.Hour), Counter: 2}
	if edit != nil {
		edit(m)
	}
	if key != nil {
		if err := agentrelease.Sign(m, key); err != nil {
			t.Fatal(err)
		}
	}
	b, err := agentrelease.Encode(m)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// TestPoolsUpdateAgent: pools.update with mask agent takes a signed
// release manifest and contributes it as the agent section of every node of
// the pool; a manifest that does not parse, is malformed, unsigned or
// expired is INVALID_INPUT agent.releaseManifest and changes nothing; an
// empty one removes the section (the nodes keep their build).
func TestPoolsUpdateAgent(t *testing.T) {
	t.Parallel()
	h := setup(t, api.Tuning{})
	ctx := t.Context()
	_, key := h.member(t, "acme", "ops")
	h.policy(t, "acme", "members", `permit (principal in Tenant::"acme", action, resource in Tenant::"acme");`)
	pools := computev1.NewPoolsServiceClient(h.conn)
	p, err := pools.Create(as(key), &computev1.PoolsServiceCreateRequest{TenantId: "acme", Name: "a", Class: "gpu"})
	if err != nil {
		t.Fatal(err)
	}
	poolID := p.GetPool().GetId()
	for _, id := range []string{"node_x", "node_y"} {
		fixture.Node(t, h.db, fixture.NodeOpts{ID: id, Tenant: "acme", Pool: poolID, State: nodes.StateAdopted})
		if err := authz.Put(ctx, h.db, authz.Resource{Type: authz.TypeNode, ID: id, TenantID: "acme", PoolID: poolID}); err != nil {
			t.Fatal(err)
		}
		if err := reconcile.InTx(ctx, h.db, nil, func(_ pgx.Tx, q *reconcile.Queue) error { return desired.Invalidate(ctx, q, id) }); err != nil {
			t.Fatal(err)
		}
	}
	_, release, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	update := func(manifest string) error {
		_, err := pools.Update(as(key), &computev1.PoolsServiceUpdateRequest{TenantId: "acme", PoolId: poolID,
			Agent: &computev1.PoolAgentSettings{ReleaseManifest: manifest}, UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"agent"}}})
		return err
	}
	// agentOf is the node's spec's agent section's manifest ("" when none)
	// and its generation.
	agentOf := func(node string) (string, string) {
		code, body := h.rest(t, key, "nodes/getSpec", fmt.Sprintf(`{"tenantId":"acme","nodeId":%q}`, node))
		if code != http.StatusOK {
			t.Fatalf("%d %v", code, body)
		}
		spec, _ := body["spec"].(map[string]any)
		agent, _ := spec["agent"].(map[string]any)
		raw, _ := agent["releaseManifest"].(string)
		b, err := base64.StdEncoding.DecodeString(raw)
		if err != nil {
			t.Fatal(err)
		}
		gen, _ := body["generation"].(string)
		return string(b), gen
	}
	poll.Until(t, 20*time.Second, "the first specs", func() bool {
		_, gx := agentOf("node_x")
		_, gy := agentOf("node_y")
		return gx == "1" && gy == "1"
	})

	good := manifestText(t, release, nil)
	if err := update(good); err != nil {
		t.Fatal(err)
	}
	for _, node := range []string{"node_x", "node_y"} {
		poll.UntilNil(t, 20*time.Second, "the agent section in "+node+"'s spec", func() error {
			m, gen := agentOf(node)
			parsed, err := agentrelease.Parse([]byte(m))
			if gen == "2" && err == nil && parsed.Version == "v0.2.0" && len(parsed.Signature) > 0 {
				return nil
			}
			return fmt.Errorf("generation %s manifest %q", gen, m)
		})
	}

	for name, manifest := range map[string]string{
		"not JSON":   "bcd v0.3.0",
		"malformed":  strings.Replace(good, `"linux/amd64"`, `"linux"`, 1),
		"unsigned":   manifestText(t, nil, nil),
		"expired":    manifestText(t, release, func(m *agentrelease.Manifest) { m.NotAfter = time.Now().Add(-time.Minute) }),
		"no counter": strings.Replace(good, `"counter": 2`, `"counter": 0`, 1),
	} {
		wantCode(t, update(manifest), fault.InvalidInput, "agent.releaseManifest")
		if m, gen := agentOf("node_x"); gen != "2" || m == "" {
			t.Fatalf("%s: a refused manifest changed the spec: generation %s", name, gen)
		}
	}
	wantCode(t, update(strings.Repeat("x", agentrelease.MaxManifestBytes+1)), fault.InvalidInput, "agent.releaseManifest")

	// Removing it stops contributing: the section is gone.
	if err := update(""); err != nil {
		t.Fatal(err)
	}
	poll.UntilNil(t, 20*time.Second, "the agent section gone", func() error {
		if m, gen := agentOf("node_y"); gen != "3" || m != "" {
			return fmt.Errorf("generation %s manifest %q", gen, m)
		}
		return nil
	})
}

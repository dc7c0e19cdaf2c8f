package dev_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bettercompute/bettercompute/agent/converge"
	"github.com/bettercompute/bettercompute/agent/inventory"
	"github.com/bettercompute/bettercompute/agent/join"
	"github.com/bettercompute/bettercompute/agent/session"
	"github.com/bettercompute/bettercompute/agent/state"
	"github.com/bettercompute/bettercompute/pkg/natstest"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/poll"
	"github.com/bettercompute/bettercompute/pkg/workqueue"
	"github.com/bettercompute/bettercompute/services/dev"
)

// reservation is the part of a reservation the tests read.
type reservation struct {
	ID       string
	State    string
	Reason   string
	Bookings []struct{ NodeID, DeviceID string }
}

// tryCall posts body to an API method with the root credential and returns
// the HTTP status and the raw answer.
func tryCall(t testing.TB, env *dev.Env, method string, body any) (int, []byte) {
	t.Helper()
	b, _ := json.Marshal(body)
	req, _ := http.NewRequestWithContext(t.Context(), http.MethodPost, env.BaseURL()+"/api/compute/"+method, bytes.NewReader(b))
	req.Header.Set("Authorization", "Bearer "+env.Credential)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = resp.Body.Close() }()
	raw, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, raw
}

func getReservation(t testing.TB, env *dev.Env, id string) reservation {
	t.Helper()
	var out struct{ Reservation reservation }
	call(t, env, "reservations/get", map[string]any{"tenantId": "root", "reservationId": id}, &out)
	return out.Reservation
}

// waitState polls reservations.get until the reservation is in state.
func waitState(t testing.TB, env *dev.Env, id, state string) reservation {
	t.Helper()
	var r reservation
	poll.UntilNil(t, 60*time.Second, "reservation "+id+" to be "+state, func() error {
		r = getReservation(t, env, id)
		if r.State == state {
			return nil
		}
		return fmt.Errorf("it is %s (%s)", r.State, r.Reason)
	})
	return r
}

// exposed reads what a node's devices handler exposes: reservation → GPUs,
// from its CDI spec (nil when there is none).
func exposed(t testing.TB, dir string) map[string][]string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, converge.CDISpecFile))
	if os.IsNotExist(err) {
		return nil
	}
	if err != nil {
		t.Fatal(err)
	}
	// The spec (package agent/cdi) has a device per GPU, named by its UUID,
	// and one per reservation with exactly its GPUs' device nodes.
	var spec struct {
		Kind    string `json:"kind"`
		Devices []struct {
			Name           string `json:"name"`
			ContainerEdits struct {
				DeviceNodes []struct {
					Path string `json:"path"`
				} `json:"deviceNodes"`
			} `json:"containerEdits"`
		} `json:"devices"`
	}
	if err := json.Unmarshal(b, &spec); err != nil {
		t.Fatal(err)
	}
	if spec.Kind != converge.CDIKind {
		t.Fatalf("CDI kind %q", spec.Kind)
	}
	gpuOf := map[string]string{} // device node → UUID
	for _, d := range spec.Devices {
		if strings.HasPrefix(d.Name, "GPU-") && len(d.ContainerEdits.DeviceNodes) == 1 {
			gpuOf[d.ContainerEdits.DeviceNodes[0].Path] = d.Name
		}
	}
	out := map[string][]string{}
	for _, d := range spec.Devices {
		if strings.HasPrefix(d.Name, "GPU-") {
			continue
		}
		var gpus []string
		for _, n := range d.ContainerEdits.DeviceNodes {
			gpus = append(gpus, gpuOf[n.Path])
		}
		slices.Sort(gpus)
		out[d.Name] = gpus
	}
	return out
}

// booked is what the database books on node: reservation → GPUs.
func booked(t testing.TB, db *pgxpool.Pool, node string) map[string][]string {
	t.Helper()
	rows, err := db.Query(t.Context(), `SELECT reservation_id, device_id FROM bookings WHERE node_id = $1 AND active ORDER BY 1, 2`, node)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var out map[string][]string
	for rows.Next() {
		var rsv, dev string
		if err := rows.Scan(&rsv, &dev); err != nil {
			t.Fatal(err)
		}
		if out == nil {
			out = map[string][]string{}
		}
		out[rsv] = append(out[rsv], dev)
	}
	return out
}

// waitExposes waits until every node in dirs exposes exactly its bookings.
func waitExposes(t testing.TB, db *pgxpool.Pool, dirs map[string]string, what string) {
	t.Helper()
	poll.UntilNil(t, 60*time.Second, what, func() error {
		var wrong []string
		for node, dir := range dirs {
			if got, want := exposed(t, dir), booked(t, db, node); fmt.Sprint(got) != fmt.Sprint(want) {
				wrong = append(wrong, fmt.Sprintf("%s exposes %v, booked %v", node, got, want))
			}
		}
		if len(wrong) == 0 {
			return nil
		}
		return errors.New(strings.Join(wrong, "; "))
	})
}

// agentNode is one real agent (join, session, converge) with a mock DGX
// H200 whose GPUs keep their UUIDs across restarts of the daemon, as real
// hardware does.
type agentNode struct {
	id     string
	dir    string
	st     *state.Store
	inv    *inventory.Collector
	cancel context.CancelFunc
	done   chan error
	boots  int
}

// joinAgents joins n real agents to a new pool of env and starts them.
func joinAgents(t testing.TB, env *dev.Env, n int) (string, []*agentNode) {
	t.Helper()
	var pool struct{ Pool struct{ ID string } }
	call(t, env, "pools/create", map[string]any{"tenantId": "root", "name": "cap", "class": "gpu", "idempotencyKey": "cap-pool"}, &pool)
	var tok struct{ Token string }
	call(t, env, "joinTokens/create", map[string]any{"tenantId": "root", "poolId": pool.Pool.ID, "uses": n, "idempotencyKey": "cap-token"}, &tok)
	pub, keyID, roots := joinMaterial(t, env)
	var nodes []*agentNode
	for i := range n {
		dir := t.TempDir()
		st, err := state.Open(dir)
		if err != nil {
			t.Fatal(err)
		}
		host := fmt.Sprintf("cap-%d", i)
		inv, err := inventory.Open(inventory.Config{Backend: inventory.BackendMock, Hostname: host, MachineID: host + "-machine", SystemSerial: host + "-serial"})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = inv.Close() })
		id, err := join.Join(t.Context(), join.Config{Gateway: env.App.GatewayAddr(), RootCAs: roots, Token: tok.Token,
			JoinserviceKey: pub, JoinserviceKeyID: keyID, State: st, Claims: inv})
		if err != nil {
			t.Fatal(err)
		}
		a := &agentNode{id: id.NodeID, dir: dir, st: st, inv: inv}
		a.start(env)
		t.Cleanup(func() { a.stop(t) })
		nodes = append(nodes, a)
	}
	return pool.Pool.ID, nodes
}

// start runs the daemon's session (a new boot).
func (a *agentNode) start(env *dev.Env) {
	ctx, cancel := context.WithCancel(context.Background())
	a.cancel, a.done = cancel, make(chan error, 1)
	a.boots++
	boot := fmt.Sprintf("%s-boot-%d", a.id, a.boots)
	go func() {
		a.done <- session.Run(ctx, session.Config{Gateway: env.App.GatewayAddr(), State: a.st, Inventory: a.inv, BootID: boot,
			AgentVersion: "e2e", MinBackoff: 50 * time.Millisecond, Logger: slog.New(slog.DiscardHandler)})
	}()
}

// stop ends the daemon (idempotent).
func (a *agentNode) stop(t testing.TB) {
	if a.cancel == nil {
		return
	}
	a.cancel()
	if err := <-a.done; err != nil {
		t.Error(err)
	}
	a.cancel = nil
}

// TestReservationsEndToEnd runs real agents (mock DGX H200s) against the
// real control plane: place, bind, pack, restart, release, and bind with
// the bus stopped.
func TestReservationsEndToEnd(t *testing.T) {
	t.Parallel()
	const n = 2
	dbURL := pgtest.NewDB(t)
	db, err := pgxpool.New(t.Context(), dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	ns := natstest.New(t)
	env := chaosEnv(t, dbURL, t.TempDir(), freePort(t), ns.URL())
	defer env.Stop(context.Background())
	poolID, agents := joinAgents(t, env, n)
	waitSessions(t, db, n, 1, time.Now().Add(-time.Minute), "the agents joining")
	waitConverged(t, db, n, 1, "", "the agents applying generation 1")
	dirs := map[string]string{}
	byID := map[string]*agentNode{}
	for _, a := range agents {
		dirs[a.id], byID[a.id] = a.dir, a
	}

	var created struct{ Reservation reservation }
	call(t, env, "reservations/create", map[string]any{"tenantId": "root", "poolId": poolID, "gpuCount": 4,
		"constraints": map[string]any{"sameNode": true, "model": "NVIDIA H200"}, "idempotencyKey": "e2e-1"}, &created)
	if created.Reservation.State != "placed" || len(created.Reservation.Bookings) != 4 {
		t.Fatalf("created %+v", created.Reservation)
	}
	id := created.Reservation.ID
	node := created.Reservation.Bookings[0].NodeID

	t.Run("binds once the node exposes exactly the booked GPUs", func(t *testing.T) {
		waitState(t, env, id, "bound")
		waitExposes(t, db, dirs, "after binding")
		if got := exposed(t, dirs[node]); len(got[id]) != 4 {
			t.Fatalf("node %s exposes %v", node, got)
		}
		var reason string
		_ = db.QueryRow(t.Context(), `SELECT s->>'reason' FROM nodes, jsonb_array_elements(section_status) s
			WHERE id = $1 AND s->>'section' = 'devices'`, node).Scan(&reason)
		if !strings.HasPrefix(reason, "exposes 4 GPUs: "+id) {
			t.Fatalf("the devices section reports %q", reason)
		}
	})

	t.Run("a second reservation fills the used node first", func(t *testing.T) {
		var out struct{ Reservation reservation }
		call(t, env, "reservations/create", map[string]any{"tenantId": "root", "poolId": poolID, "gpuCount": 6, "idempotencyKey": "e2e-2"}, &out)
		onFirst := 0
		for _, b := range out.Reservation.Bookings {
			if b.NodeID == node {
				onFirst++
			}
		}
		if onFirst != 4 {
			t.Fatalf("6 GPUs with 4 free on %s and 8 on the other: %d landed on %s, want 4", node, onFirst, node)
		}
		waitState(t, env, out.Reservation.ID, "bound")
		waitExposes(t, db, dirs, "after the second reservation")
	})

	t.Run("capacity.get and the gauges report the rollup", func(t *testing.T) {
		for _, k := range []string{"capacity.rollup", "capacity.usage"} {
			if err := workqueue.Enqueue(t.Context(), db, k, "all"); err != nil {
				t.Fatal(err)
			}
		}
		type counts struct{ Free, Booked, Unavailable int }
		var got struct {
			Total  counts
			Models []struct {
				Model  string
				Counts counts
			}
			Tenants []struct {
				TenantID string
				Booked   int
			}
		}
		poll.UntilNil(t, 30*time.Second, "ten GPUs booked by one tenant", func() error {
			call(t, env, "capacity/get", map[string]any{"tenantId": "root", "poolId": poolID}, &got)
			if got.Total.Booked == 10 && len(got.Tenants) == 1 && got.Tenants[0].Booked == 10 {
				return nil
			}
			return fmt.Errorf("capacity %+v", got)
		})
		if got.Total.Free != 6 || len(got.Models) != 1 || !strings.HasPrefix(got.Models[0].Model, "NVIDIA H200") {
			t.Fatalf("capacity %+v", got)
		}
		resp, err := http.Get(env.BaseURL() + "/metrics")
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = resp.Body.Close() }()
		body, _ := io.ReadAll(resp.Body)
		if want := fmt.Sprintf(`bettercompute_capacity_atoms{model="",pool=%q,state="booked"} 10`, poolID); !strings.Contains(string(body), want) {
			t.Fatalf("/metrics lacks %s", want)
		}
	})

	t.Run("a node that restarts comes back exposing exactly its bookings", func(t *testing.T) {
		a := byID[node]
		a.stop(t)
		// While it is down its devices file is tampered with: a stale
		// reservation instead of its booked GPUs.
		stale := `{"cdiVersion":"0.6.0","kind":"` + converge.CDIKind + `","devices":[{"name":"rsv_stale","containerEdits":{"deviceNodes":[{"path":"/dev/nvidia7"}]}}]}`
		if err := os.WriteFile(filepath.Join(a.dir, converge.CDISpecFile), []byte(stale), 0o644); err != nil {
			t.Fatal(err)
		}
		a.start(env)
		waitExposes(t, db, dirs, "after the restart")
		if r := getReservation(t, env, id); r.State != "bound" {
			t.Fatalf("after the restart the reservation is %s", r.State)
		}
	})

	t.Run("release withdraws the GPUs from the node", func(t *testing.T) {
		var out struct{ Reservation reservation }
		call(t, env, "reservations/release", map[string]any{"tenantId": "root", "reservationId": id}, &out)
		if out.Reservation.State != "released" {
			t.Fatalf("released %+v", out.Reservation)
		}
		waitExposes(t, db, dirs, "after release")
		if _, ok := exposed(t, dirs[node])[id]; ok {
			t.Fatalf("node %s still exposes the released reservation", node)
		}
	})

	t.Run("no capacity through REST is 503 NO_CAPACITY naming gpuCount", func(t *testing.T) {
		status, raw := tryCall(t, env, "reservations/create", map[string]any{"tenantId": "root", "poolId": poolID, "gpuCount": 9,
			"constraints": map[string]any{"sameNode": true}})
		if status != http.StatusServiceUnavailable || !strings.Contains(string(raw), "NO_CAPACITY") || !strings.Contains(string(raw), "gpuCount") {
			t.Fatalf("%d %s", status, raw)
		}
	})

	t.Run("with the bus stopped a reservation still binds from the database", func(t *testing.T) {
		ns.Stop()
		var out struct{ Reservation reservation }
		call(t, env, "reservations/create", map[string]any{"tenantId": "root", "poolId": poolID, "gpuCount": 2, "idempotencyKey": "e2e-nobus"}, &out)
		waitState(t, env, out.Reservation.ID, "bound")
		waitExposes(t, db, dirs, "without the bus")
	})
}

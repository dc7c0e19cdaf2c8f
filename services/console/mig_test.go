package console_test

import (
	"fmt"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"golang.org/x/net/html"

	"github.com/bettercompute/bettercompute/agent/converge"
	"github.com/bettercompute/bettercompute/pkg/poll"
	"github.com/bettercompute/bettercompute/services/dev"
)

// migSlice and migGPU are what nodes.get says of a GPU's MIG layout and
// slices.
type migSlice struct {
	ID, Profile, ReservationID string
	Start                      int
}

type migGPU struct {
	ID        string
	Index     int
	MigLayout []string
	MigSlices []migSlice
}

// htRows are the <tr> of table id that carry attribute attr.
func htRows(t testing.TB, doc *html.Node, table, attr string) []*html.Node {
	t.Helper()
	return htAll(htByID(t, doc, "table", table), func(n *html.Node) bool { return n.Data == "tr" && htHasAttr(n, attr) })
}

// TestConsoleMIG: make run's MIG layout on node 0's GPU 0 (dev.RunOptions
// SimMig). A slice booked through the reservations form shows on the node
// page (the GPU's layout, each slice with its profile, MIG UUID and booking
// linked to the reservation), on the fleet page (slices free and booked by
// profile) and on the reservations page (profile and count); the node's
// Drifted condition shows its reasons, and the node page and the fleet page
// show the rollout it is in.
func TestConsoleMIG(t *testing.T) {
	f := htStartRun(t, dev.RunOptions{SimMig: true})
	root := f.env.Credential
	migNode := f.env.Fleet.Nodes()[0]
	other := f.nodes[0]
	if other == migNode {
		other = f.nodes[1]
	}

	nodeGet := func(id string, out any) {
		t.Helper()
		if err := htAPI(t, f, root, "nodes/get", map[string]any{"tenantId": "root", "nodeId": id}, out); err != nil {
			t.Fatal(err)
		}
	}
	var got struct {
		Node struct {
			PoolID  string
			Devices []migGPU
		}
	}
	poll.UntilNil(t, time.Minute, "GPU 0's four slices in nodes.get", func() error {
		nodeGet(migNode, &got)
		if len(got.Node.Devices) > 0 && len(got.Node.Devices[0].MigSlices) == 4 {
			return nil
		}
		return fmt.Errorf("devices %+v", got.Node.Devices)
	})
	pool := got.Node.PoolID
	g0 := got.Node.Devices[0]
	if want := []string{"3g.71gb", "2g.35gb", "1g.18gb", "1g.18gb"}; !slices.Equal(g0.MigLayout, want) {
		t.Fatalf("GPU 0's layout %v, want %v", g0.MigLayout, want)
	}

	s := htLogin(t, f, root)
	token := htCSRFOf(t, f, s)

	// One 2g.35gb slice, booked through the console's form.
	resp, body := htDo(t, f, htReq{method: http.MethodPost, path: "/console/reservations", session: s,
		form: url.Values{"csrf": {token}, "pool": {"sim"}, "gpus": {"1"}, "migProfile": {"2g.35gb"}, "name": {"ht-slice"}}})
	if resp.StatusCode != http.StatusSeeOther {
		t.Fatalf("create a slice reservation: %d %s", resp.StatusCode, body)
	}
	type booking struct{ NodeID, DeviceID, MigProfile, ParentDeviceID string }
	type reservation struct {
		ID, State, MigProfile string
		GpuCount              int
		Bookings              []booking
	}
	var rs struct{ Reservations []reservation }
	if err := htAPI(t, f, root, "reservations/list", map[string]any{"tenantId": "root"}, &rs); err != nil {
		t.Fatal(err)
	}
	if len(rs.Reservations) != 1 || rs.Reservations[0].MigProfile != "2g.35gb" || rs.Reservations[0].GpuCount != 1 {
		t.Fatalf("the form made %+v", rs.Reservations)
	}
	rsv := rs.Reservations[0].ID
	var r reservation
	poll.UntilNil(t, time.Minute, "the slice reservation bound", func() error {
		var out struct{ Reservation reservation }
		if err := htAPI(t, f, root, "reservations/get", map[string]any{"tenantId": "root", "reservationId": rsv}, &out); err != nil {
			return err
		}
		if r = out.Reservation; r.State != "bound" {
			return fmt.Errorf("it is %s", r.State)
		}
		return nil
	})
	if len(r.Bookings) != 1 || r.Bookings[0].NodeID != migNode || r.Bookings[0].ParentDeviceID != g0.ID || !strings.HasPrefix(r.Bookings[0].DeviceID, "MIG-") {
		t.Fatalf("bookings %+v", r.Bookings)
	}
	slice := r.Bookings[0].DeviceID

	t.Run("the node page shows each GPU's layout and its slices with their bookings", func(t *testing.T) {
		doc, _ := htGet(t, f, s, "/console/nodes/"+migNode, http.StatusOK)
		layouts := htRows(t, doc, "mig-layouts", "data-device-id")
		if len(layouts) != 1 {
			t.Fatalf("%d GPUs in #mig-layouts, want GPU 0 only", len(layouts))
		}
		l := layouts[0]
		if htAttr(l, "data-device-id") != g0.ID || htAttr(l, "data-layout") != strings.Join(g0.MigLayout, ",") ||
			htAttr(l, "data-slices") != "4" || htAttr(l, "data-booked") != "1" {
			t.Fatalf("#mig-layouts row %v", l.Attr)
		}
		if txt := htText(htAll(l, func(n *html.Node) bool { return htHasClass(n, "layout") })[0]); txt != "3g.71gb + 2g.35gb + 1g.18gb + 1g.18gb" {
			t.Fatalf("layout cell %q", txt)
		}

		rows := htRows(t, doc, "mig-slices", "data-slice-id")
		if len(rows) != 4 {
			t.Fatalf("%d slice rows, want 4", len(rows))
		}
		var profiles []string
		for _, row := range rows {
			id, prof := htAttr(row, "data-slice-id"), htAttr(row, "data-profile")
			profiles = append(profiles, prof)
			i := slices.IndexFunc(g0.MigSlices, func(x migSlice) bool { return x.ID == id })
			if i < 0 || g0.MigSlices[i].Profile != prof || htAttr(row, "data-parent-id") != g0.ID || htAttr(row, "data-start") != strconv.Itoa(g0.MigSlices[i].Start) {
				t.Fatalf("slice row %v; nodes.get has %+v", row.Attr, g0.MigSlices)
			}
			if !strings.Contains(htText(row), id) || !strings.Contains(htText(row), prof) {
				t.Fatalf("slice row %q does not show its UUID and profile", htText(row))
			}
			cell := htAll(row, func(n *html.Node) bool { return htHasClass(n, "booking") })[0]
			if id == slice {
				links := htAll(cell, func(n *html.Node) bool { return n.Data == "a" })
				if prof != "2g.35gb" || htAttr(row, "data-booked") != "true" || htAttr(row, "data-reservation-id") != rsv ||
					len(links) != 1 || htAttr(links[0], "href") != "/console/reservations#reservation-"+rsv || htText(links[0]) != rsv {
					t.Fatalf("the booked slice's row %v, booking %q", row.Attr, htText(cell))
				}
			} else if htAttr(row, "data-booked") != "false" || htHasAttr(row, "data-reservation-id") || htText(cell) != "free" {
				t.Fatalf("free slice row %v, booking %q", row.Attr, htText(cell))
			}
		}
		slices.Sort(profiles)
		want := slices.Sorted(slices.Values(g0.MigLayout))
		if !slices.Equal(profiles, want) {
			t.Fatalf("slice profiles %v, want the layout's %v", profiles, want)
		}
		dev := htAll(htByID(t, doc, "table", "devices"), func(n *html.Node) bool { return n.Data == "tr" && htAttr(n, "data-device-id") == g0.ID })
		if len(dev) != 1 || htText(htAll(dev[0], func(n *html.Node) bool { return htHasClass(n, "mig") })[0]) != "4 slices, 1 booked" {
			t.Fatalf("GPU 0's device row %v", dev)
		}

		doc, _ = htGet(t, f, s, "/console/nodes/"+other, http.StatusOK)
		if n := len(htAll(doc, func(n *html.Node) bool { id := htAttr(n, "id"); return id == "mig-layouts" || id == "mig-slices" })); n != 0 {
			t.Fatalf("node %s without MIG shows %d MIG tables", other, n)
		}
	})

	t.Run("the fleet page counts slices free and booked by profile", func(t *testing.T) {
		doc, _ := htGet(t, f, s, "/console/", http.StatusOK)
		counts := map[string]string{}
		for _, row := range htRows(t, doc, "mig-capacity", "data-profile") {
			if htAttr(row, "data-pool-id") != pool {
				t.Fatalf("a #mig-capacity row of pool %s", htAttr(row, "data-pool-id"))
			}
			cell := func(c string) string {
				return htText(htAll(row, func(n *html.Node) bool { return htHasClass(n, c) })[0])
			}
			counts[htAttr(row, "data-profile")] = cell("slices-free") + "/" + cell("slices-booked")
		}
		want := map[string]string{"3g.71gb": "1/0", "2g.35gb": "0/1", "1g.18gb": "2/0"}
		if fmt.Sprint(counts) != fmt.Sprint(want) {
			t.Fatalf("#mig-capacity free/booked %v, want %v", counts, want)
		}
		htByID(t, doc, "table", "pools")
		if rows := htRows(t, doc, "rollouts", "data-rollout-id"); len(rows) != 0 {
			t.Fatalf("%d rollouts listed before any", len(rows))
		}
	})

	t.Run("the reservations page shows a slice reservation's profile and count", func(t *testing.T) {
		doc, _ := htGet(t, f, s, "/console/reservations", http.StatusOK)
		row := htByID(t, doc, "tr", "reservation-"+rsv)
		if htAttr(row, "data-mig-profile") != "2g.35gb" || htAttr(row, "data-count") != "1" {
			t.Fatalf("row %v", row.Attr)
		}
		if c := htText(htAll(row, func(n *html.Node) bool { return htHasClass(n, "count") })[0]); c != "1 × 2g.35gb slice" {
			t.Fatalf("count cell %q", c)
		}
		if p := htText(htAll(row, func(n *html.Node) bool { return htHasClass(n, "placement") })[0]); !strings.Contains(p, slice) || !strings.Contains(p, g0.ID) {
			t.Fatalf("placement %q does not name slice %s of GPU %s", p, slice, g0.ID)
		}
		htInput(t, htByID(t, doc, "form", "create-reservation"), "migProfile")

		// A profile the pool's GPUs lack is the API's error, naming it.
		resp, body := htDo(t, f, htReq{method: http.MethodPost, path: "/console/reservations", session: s,
			form: url.Values{"csrf": {token}, "pool": {"sim"}, "gpus": {"1"}, "migProfile": {"9g.999gb"}}})
		doc, err := html.Parse(strings.NewReader(body))
		if err != nil || resp.StatusCode != http.StatusBadRequest {
			t.Fatalf("a bad profile: %d %v", resp.StatusCode, err)
		}
		htWantError(t, doc, "INVALID_INPUT", "migProfile")
	})

	t.Run("a Drifted condition shows its reasons", func(t *testing.T) {
		// The node's CDI spec, edited by hand: its daemon's next pass (a new
		// desired state here, sooner than a simulated daemon's drift check)
		// restores it and reports the devices section drifted (fleet.drift).
		spec := filepath.Join(f.env.Fleet.Root(0), "var/run/cdi", filepath.Base(converge.CDISpecFile))
		if err := os.WriteFile(spec, []byte(`{"cdiVersion":"0.6.0","kind":"`+converge.CDIKind+`","devices":[]}`), 0o644); err != nil {
			t.Fatal(err)
		}
		var upd map[string]any
		if err := htAPI(t, f, root, "nodes/update", map[string]any{"tenantId": "root", "nodeId": migNode, "labels": map[string]string{"rack": "r1"},
			"updateMask": "labels"}, &upd); err != nil {
			t.Fatal(err)
		}
		type cond struct {
			Type    string
			Status  bool
			Reasons []string
		}
		var reasons []string
		poll.UntilNil(t, time.Minute, "node 0 Drifted", func() error {
			var out struct{ Node struct{ Conditions []cond } }
			nodeGet(migNode, &out)
			for _, c := range out.Node.Conditions {
				if c.Type == "Drifted" && c.Status && len(c.Reasons) > 0 {
					reasons = c.Reasons
					return nil
				}
			}
			return fmt.Errorf("conditions %+v", out.Node.Conditions)
		})
		doc, _ := htGet(t, f, s, "/console/nodes/"+migNode, http.StatusOK)
		rows := htAll(htByID(t, doc, "table", "conditions"), func(n *html.Node) bool { return n.Data == "tr" && htAttr(n, "data-type") == "Drifted" })
		if len(rows) != 1 || htAttr(rows[0], "data-status") != "true" {
			t.Fatalf("Drifted rows %d", len(rows))
		}
		var shown []string
		for _, li := range htAll(rows[0], func(n *html.Node) bool { return n.Data == "li" && htHasClass(n.Parent, "reasons") }) {
			shown = append(shown, htText(li))
		}
		if !slices.Equal(shown, reasons) || !strings.Contains(reasons[0], "devices") {
			t.Fatalf("the page shows reasons %q; nodes.get has %q", shown, reasons)
		}
		doc, _ = htGet(t, f, s, "/console/", http.StatusOK)
		row := htAll(htByID(t, doc, "table", "pools"), func(n *html.Node) bool { return n.Data == "tr" && htAttr(n, "data-pool-id") == pool })
		cell := htAll(row[0], func(n *html.Node) bool { return htHasClass(n, "drifted") })
		if len(cell) != 1 || htText(cell[0]) != "1" {
			t.Fatalf("pool row's drifted cell %v", cell)
		}
		if a := htAll(cell[0], func(n *html.Node) bool { return n.Data == "a" }); len(a) != 1 || htAttr(a[0], "href") != "/console/?pool="+pool+"&condition=Drifted" {
			t.Fatalf("drifted cell links %v", a)
		}
	})

	t.Run("the node page and the fleet page show the rollout a node is in", func(t *testing.T) {
		var created struct{ Rollout struct{ ID string } }
		if err := htAPI(t, f, root, "rollouts/create", map[string]any{"tenantId": "root", "poolId": pool, "idempotencyKey": "console-rollout",
			"change":   map[string]any{"updateMask": "health", "health": map[string]any{"maxGpuTemperatureCelsius": 95}},
			"strategy": map[string]any{"batches": []map[string]any{{"count": 1}}, "bake": "3600s"}}, &created); err != nil {
			t.Fatal(err)
		}
		type member struct {
			RolloutID       string
			RolloutBatch    int
			RolloutReleased bool
		}
		in := map[string]member{}
		poll.UntilNil(t, time.Minute, "a node released in the rollout", func() error {
			released := 0
			for _, id := range f.nodes {
				var out struct{ Node member }
				nodeGet(id, &out)
				in[id] = out.Node
				if out.Node.RolloutReleased {
					released++
				}
			}
			if released != 1 {
				return fmt.Errorf("membership %+v", in)
			}
			return nil
		})
		for _, id := range f.nodes {
			m := in[id]
			if m.RolloutID != created.Rollout.ID {
				t.Fatalf("node %s in rollout %q, want %s", id, m.RolloutID, created.Rollout.ID)
			}
			doc, _ := htGet(t, f, s, "/console/nodes/"+id, http.StatusOK)
			p := htByID(t, doc, "p", "node-rollout")
			if htAttr(p, "data-rollout-id") != m.RolloutID || htAttr(p, "data-batch") != strconv.Itoa(m.RolloutBatch+1) ||
				htAttr(p, "data-batches") != "2" || htAttr(p, "data-released") != strconv.FormatBool(m.RolloutReleased) {
				t.Fatalf("node %s: #node-rollout %v; nodes.get %+v", id, p.Attr, m)
			}
			want := fmt.Sprintf("batch %d of 2", m.RolloutBatch+1)
			if !strings.Contains(htText(p), want) || !strings.Contains(htText(p), m.RolloutID) {
				t.Fatalf("node %s: #node-rollout %q does not say %q", id, htText(p), want)
			}
		}
		doc, _ := htGet(t, f, s, "/console/", http.StatusOK)
		rows := htRows(t, doc, "rollouts", "data-rollout-id")
		if len(rows) != 1 || htAttr(rows[0], "data-rollout-id") != created.Rollout.ID || htAttr(rows[0], "data-pool-id") != pool ||
			htAttr(rows[0], "data-batches") != "2" {
			t.Fatalf("#rollouts rows %v", rows)
		}
		if st := htAttr(rows[0], "data-state"); st != "progressing" && st != "paused" {
			t.Fatalf("the rollout shows state %s", st)
		}
		if b := htText(htAll(rows[0], func(n *html.Node) bool { return htHasClass(n, "batch") })[0]); b != "1/2" && b != "2/2" {
			t.Fatalf("batch cell %q", b)
		}
	})
}

// TestBrowserMIG drives the console in chromium against dev with make
// run's MIG layout on node 0's GPU 0: the fleet page counts the slices by
// profile, a 1g.18gb slice is booked through the reservations form (which
// shows its profile and count), the node page shows that slice booked with
// a link to the reservation's row, and the fleet page counts it booked.
func TestBrowserMIG(t *testing.T) {
	t.Parallel()
	ctx := browser(t)
	s := startSiteRun(t, 2, dev.RunOptions{SimMig: true})
	node := s.env.Fleet.Nodes()[0]
	var got struct{ Node struct{ Devices []migGPU } }
	poll.UntilNil(t, waitTimeout, "GPU 0's four slices in nodes.get", func() error {
		s.call(t, s.env.Credential, "nodes/get", map[string]any{"tenantId": "root", "nodeId": node}, &got)
		if len(got.Node.Devices) > 0 && len(got.Node.Devices[0].MigSlices) == 4 {
			return nil
		}
		return fmt.Errorf("devices %+v", got.Node.Devices)
	})
	g0 := got.Node.Devices[0]

	signIn(ctx, t, s.base, s.env.Credential)
	slicesShown := func(profile string) string {
		return `(() => {
			const r = document.querySelector('#mig-capacity tr[data-pool-id=` + quote(s.pool) + `][data-profile=` + quote(profile) + `]');
			if (!r) return "no #mig-capacity row for ` + profile + `";
			return r.querySelector(".slices-free").textContent.trim() + "/" + r.querySelector(".slices-booked").textContent.trim();
		})()`
	}
	if got := js[string](ctx, t, slicesShown("1g.18gb")); got != "2/0" {
		t.Fatalf("the fleet page shows 1g.18gb free/booked %s, want 2/0", got)
	}
	if got := js[string](ctx, t, slicesShown("3g.71gb")); got != "1/0" {
		t.Fatalf("the fleet page shows 3g.71gb free/booked %s, want 1/0", got)
	}

	navigate(ctx, t, s.base, "/console/reservations")
	waitFor(ctx, t, "the reservation form", `document.querySelector('form#create-reservation input[name="migProfile"]') ? "" : "no migProfile input"`)
	js[string](ctx, t, `(() => {
		const f = document.querySelector("form#create-reservation");
		f.querySelector('[name="pool"]').value = `+quote(s.pool)+`;
		f.querySelector('[name="gpus"]').value = "1";
		f.querySelector('[name="migProfile"]').value = "1g.18gb";
		f.querySelector('[name="name"]').value = "browser-slice";
		return "";
	})()`)
	do(ctx, t, chromedp.Click(chromedp.CSS(`#create-reservation-submit`)))
	waitFor(ctx, t, "the slice reservation in the list", `(() => {
		const d = document.querySelector("dialog#confirm-dialog");
		if (d && d.open) { document.querySelector("#confirm-yes").click(); return "confirming"; }
		if (location.pathname !== "/console/reservations") return "the page is at " + location.href;
		if (document.querySelector("#error")) return "error: " + document.querySelector("#error").textContent;
		return document.querySelector('tr[data-mig-profile="1g.18gb"]') ? "" : "no row with data-mig-profile";
	})()`)
	rsv := js[string](ctx, t, `document.querySelector('tr[data-mig-profile="1g.18gb"]').dataset.reservationId`)
	if c := js[string](ctx, t, `document.querySelector('tr[data-mig-profile="1g.18gb"] .count').textContent.trim()`); c != "1 × 1g.18gb slice" {
		t.Errorf("the row's count shows %q", c)
	}
	var placed struct {
		Reservation struct {
			State, MigProfile string
			Bookings          []struct{ NodeID, DeviceID, ParentDeviceID string }
		}
	}
	poll.UntilNil(t, waitTimeout, "reservation "+rsv+" bound", func() error {
		s.call(t, s.env.Credential, "reservations/get", map[string]any{"tenantId": "root", "reservationId": rsv}, &placed)
		if placed.Reservation.State != "bound" {
			return fmt.Errorf("it is %s", placed.Reservation.State)
		}
		return nil
	})
	if len(placed.Reservation.Bookings) != 1 || placed.Reservation.MigProfile != "1g.18gb" || placed.Reservation.Bookings[0].ParentDeviceID != g0.ID {
		t.Fatalf("the form booked %+v", placed.Reservation)
	}
	slice := placed.Reservation.Bookings[0].DeviceID

	navigate(ctx, t, s.base, "/console/nodes/"+node)
	row := `document.querySelector('#mig-slices tr[data-slice-id=` + quote(slice) + `]')`
	waitFor(ctx, t, "the booked slice's row", row+` ? "" : "no row for the slice"`)
	if got := js[string](ctx, t, `[`+row+`.dataset.profile, `+row+`.dataset.booked, `+row+`.dataset.reservationId, `+row+`.dataset.parentId].join(" ")`); got != "1g.18gb true "+rsv+" "+g0.ID {
		t.Fatalf("the slice's row says %q", got)
	}
	if free := js[int](ctx, t, `document.querySelectorAll('#mig-slices tr[data-booked="false"]').length`); free != 3 {
		t.Errorf("%d free slices on the node page, want 3", free)
	}
	if l := js[string](ctx, t, `document.querySelector('#mig-layouts tr[data-device-id=`+quote(g0.ID)+`]').dataset.layout`); l != strings.Join(g0.MigLayout, ",") {
		t.Errorf("GPU 0's layout shows %q", l)
	}
	do(ctx, t, chromedp.Click(chromedp.CSS(`#mig-slices tr[data-slice-id=`+quote(slice)+`] .booking a`)))
	waitFor(ctx, t, "the reservation's row", `location.pathname === "/console/reservations" && location.hash === `+quote("#reservation-"+rsv)+
		` && document.getElementById(`+quote("reservation-"+rsv)+`) ? "" : "at " + location.href`)

	navigate(ctx, t, s.base, "/console/")
	waitFor(ctx, t, "the fleet page", `document.querySelector("#mig-capacity") ? "" : "no #mig-capacity"`)
	if got := js[string](ctx, t, slicesShown("1g.18gb")); got != "1/1" {
		t.Fatalf("after the booking the fleet page shows 1g.18gb free/booked %s, want 1/1", got)
	}
}

package console_test

import (
	"bytes"
	"cmp"
	"context"
	"fmt"
	"image"
	"image/color"
	"image/draw"
	"image/png"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/chromedp/cdproto/cdp"
	"github.com/chromedp/cdproto/page"
	"github.com/chromedp/chromedp"

	"github.com/bettercompute/bettercompute/pkg/poll"
	"github.com/bettercompute/bettercompute/services/dev"
)

// ScreenshotsDirEnv names the directory TestScreenshots writes its PNGs to;
// without it the test is skipped. `make screenshots` sets it to
// docs/console.
const ScreenshotsDirEnv = "BC_SCREENSHOTS_DIR"

// maxShotHeight bounds a full-page screenshot's height in CSS pixels, so a
// long page (the events or audit list) keeps its PNG small.
const maxShotHeight = 2400

// TestScreenshots signs in to dev with three simulated nodes, a command run
// and a reservation bound, and writes a full-page PNG of each console page
// (login, fleet, node, command, reservations, events, audit) into
// $BC_SCREENSHOTS_DIR.
func TestScreenshots(t *testing.T) {
	t.Parallel()
	dir := os.Getenv(ScreenshotsDirEnv)
	if dir == "" {
		t.Skip(ScreenshotsDirEnv + " is not set: `make screenshots` writes the console's screenshots to docs/console")
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	ctx := browser(t)
	s := startSiteRun(t, 3, dev.RunOptions{SimMig: true}) // make run's MIG layout on the first node's GPU 0

	// Something on every page: a command that ran, a reservation bound, a
	// MIG slice booked.
	var run struct{ Command struct{ ID string } }
	s.call(t, s.env.Credential, "commands/run", map[string]any{"tenantId": "root", "nodeId": s.nodes[0], "kind": "inventory.refresh", "idempotencyKey": "screenshot"}, &run)
	var rsv struct{ Reservation struct{ ID string } }
	s.call(t, s.env.Credential, "reservations/create", map[string]any{"tenantId": "root", "poolId": s.pool, "gpuCount": 4, "idempotencyKey": "screenshot"}, &rsv)
	poll.UntilNil(t, waitTimeout, "the command and the reservation to settle", func() error {
		var c struct{ Command struct{ State string } }
		s.call(t, s.env.Credential, "commands/get", map[string]any{"tenantId": "root", "nodeId": s.nodes[0], "commandId": run.Command.ID}, &c)
		var r struct{ Reservation struct{ State string } }
		s.call(t, s.env.Credential, "reservations/get", map[string]any{"tenantId": "root", "reservationId": rsv.Reservation.ID}, &r)
		if c.Command.State != "succeeded" || r.Reservation.State != "bound" {
			return fmt.Errorf("command %s, reservation %s", c.Command.State, r.Reservation.State)
		}
		return nil
	})

	poll.UntilNil(t, waitTimeout, "GPU 0's slices", func() error {
		var n struct{ Node struct{ Devices []migGPU } }
		s.call(t, s.env.Credential, "nodes/get", map[string]any{"tenantId": "root", "nodeId": s.nodes[0]}, &n)
		if len(n.Node.Devices) == 0 || len(n.Node.Devices[0].MigSlices) != 4 {
			return fmt.Errorf("devices %+v", n.Node.Devices)
		}
		return nil
	})
	var sl struct{ Reservation struct{ ID string } }
	s.call(t, s.env.Credential, "reservations/create", map[string]any{"tenantId": "root", "poolId": s.pool, "migProfile": "2g.35gb", "count": 1, "idempotencyKey": "screenshot-slice"}, &sl)
	poll.UntilNil(t, waitTimeout, "the slice reservation to bind", func() error {
		var r struct{ Reservation struct{ State string } }
		s.call(t, s.env.Credential, "reservations/get", map[string]any{"tenantId": "root", "reservationId": sl.Reservation.ID}, &r)
		if r.Reservation.State != "bound" {
			return fmt.Errorf("it is %s", r.Reservation.State)
		}
		return nil
	})

	s.waitCapacity(t, 8*len(s.nodes)-1-4, 4) // GPU 0 of the first node is in MIG mode

	shot := func(name string) {
		t.Helper()
		// Let the page's own scripts (the live feed, htmx) settle first.
		waitFor(ctx, t, "the page to finish loading", `document.readyState === "complete" ? "" : document.readyState`)
		png, err := smaller(fullPage(ctx, t))
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		path := filepath.Join(dir, name+".png")
		if err := os.WriteFile(path, png, 0o644); err != nil {
			t.Fatal(err)
		}
		t.Logf("%s: %d bytes", path, len(png))
	}

	navigate(ctx, t, s.base, "/console/login")
	waitFor(ctx, t, "the login form", `document.querySelector("form#login") ? "" : "no form"`)
	shot("login")

	signIn(ctx, t, s.base, s.env.Credential)
	for _, id := range s.nodes {
		waitFor(ctx, t, "node "+id+"'s tile", tileReady(id, `r === "True"`))
	}
	shot("fleet")

	navigate(ctx, t, s.base, "/console/nodes/"+s.nodes[0])
	waitFor(ctx, t, "the node page", `document.querySelector("#node-ready") && document.querySelector("#mig-slices") ? "" : "no #node-ready or #mig-slices"`)
	shot("node")

	navigate(ctx, t, s.base, "/console/commands/"+run.Command.ID)
	waitFor(ctx, t, "the command page", `document.querySelector("#command-state") ? "" : "no #command-state"`)
	shot("command")

	navigate(ctx, t, s.base, "/console/reservations")
	waitFor(ctx, t, "the reservations page", `document.querySelector("tr[data-reservation-id]") ? "" : "no reservation rows"`)
	shot("reservations")

	navigate(ctx, t, s.base, "/console/events")
	waitFor(ctx, t, "the events page", `document.querySelector("#event-list li") ? "" : "no events"`)
	shot("events")

	navigate(ctx, t, s.base, "/console/audit")
	waitFor(ctx, t, "the audit page", `document.querySelector("#audit-log tr") ? "" : "no audit rows"`)
	shot("audit")
}

// fullPage captures the whole page of ctx's tab as a PNG, 1280 CSS pixels
// wide and as tall as the page (at most [maxShotHeight]).
func fullPage(ctx context.Context, t *testing.T) []byte {
	t.Helper()
	sctx, cancel := context.WithTimeout(ctx, stepTimeout)
	defer cancel()
	png, err := chromedp.Run(sctx, func(ctx context.Context, tg *chromedp.Target) ([]byte, error) {
		m, err := cdp.Call(ctx, tg, page.GetLayoutMetrics, cdp.Empty{})
		if err != nil {
			return nil, err
		}
		h := 800.0
		if m.CSSContentSize != nil {
			h = min(max(m.CSSContentSize.Height, h), maxShotHeight)
		}
		yes := true
		r, err := cdp.Call(ctx, tg, page.CaptureScreenshot, page.CaptureScreenshotParams{
			Format: page.CaptureScreenshotFormatPng, FromSurface: &yes, CaptureBeyondViewport: &yes,
			Clip: &page.Viewport{Width: 1280, Height: h, Scale: 1},
		})
		return r.Data, err
	})
	if err != nil {
		t.Fatalf("screenshot: %v%s", err, shown(ctx))
	}
	return png
}

// smaller re-encodes a screenshot with a palette of its 256 most frequent
// colours (each pixel mapped to the nearest; the console's flat colours and
// anti-aliased text lose nothing visible) at the best compression, and
// returns whichever PNG is smaller: a page of text in full colour is several
// times the size.
func smaller(b []byte) ([]byte, error) {
	img, err := png.Decode(bytes.NewReader(b))
	if err != nil {
		return nil, err
	}
	bounds := img.Bounds()
	counts := map[color.RGBA]int{}
	for y := bounds.Min.Y; y < bounds.Max.Y; y++ {
		for x := bounds.Min.X; x < bounds.Max.X; x++ {
			counts[color.RGBAModel.Convert(img.At(x, y)).(color.RGBA)]++
		}
	}
	colours := slices.Collect(maps.Keys(counts))
	slices.SortFunc(colours, func(a, b color.RGBA) int {
		if c := cmp.Compare(counts[b], counts[a]); c != 0 {
			return c
		}
		return cmp.Compare(uint32(a.R)<<24|uint32(a.G)<<16|uint32(a.B)<<8|uint32(a.A), uint32(b.R)<<24|uint32(b.G)<<16|uint32(b.B)<<8|uint32(b.A))
	})
	palette := make(color.Palette, 0, 256)
	for _, c := range colours[:min(256, len(colours))] {
		palette = append(palette, c)
	}
	p := image.NewPaletted(bounds, palette)
	draw.Draw(p, bounds, img, bounds.Min, draw.Src)
	var out bytes.Buffer
	if err := (&png.Encoder{CompressionLevel: png.BestCompression}).Encode(&out, p); err != nil {
		return nil, err
	}
	if out.Len() >= len(b) {
		return b, nil
	}
	return out.Bytes(), nil
}

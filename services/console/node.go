package console

import (
	"cmp"
	"crypto/rand"
	"encoding/hex"
	"net/http"
	"net/url"
	"regexp"
	"strconv"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"
	"github.com/bettercompute/bettercompute/proto/client"

	"github.com/bettercompute/bettercompute/pkg/fault"
)

// Node page bounds.
const (
	// nodeCommands is how many of a node's newest commands its page lists.
	nodeCommands = 20
	// nodeEvents is how many of a node's newest events its page lists.
	nodeEvents = 20
	// maxDrainSeconds bounds the drain form's deadline (the API's own
	// maximum may be lower and is what decides).
	maxDrainSeconds = 30 * 24 * 3600
	// maxReason bounds a drain reason.
	maxReason = 512
)

// idemRE is an idempotency key a form carries.
var idemRE = regexp.MustCompile(`^[A-Za-z0-9_-]{1,64}$`)

// newIdem is a fresh idempotency key for one rendered form: submitting it
// twice makes one resource.
func newIdem() string {
	b := make([]byte, 16)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

type deviceRow struct {
	*computev1.Device
	// Reservation is the active reservation booking it, "" when free.
	Reservation string
	// Slices are its MIG slices (nodes.get's, by start) with their booking.
	Slices []sliceRow
	// Booked counts its slices a reservation books.
	Booked int
}

// sliceRow is one MIG slice of a GPU on the node page.
type sliceRow struct {
	*computev1.MigSlice
	// Reservation is the reservation booking it (nodes.get's, else one the
	// tenant's live reservations name), "" when free.
	Reservation string
}

// rolloutInfo is the active rollout a node is in, for its page.
type rolloutInfo struct {
	ID string
	// Batch is the node's batch, 1-based; Batches how many the rollout has
	// (0 when rollouts.get was refused).
	Batch, Batches int
	Released       bool
	State          string
	Current        int // the rollout's current batch, 1-based; 0 before the first
}

type nodeData struct {
	Node        *computev1.Node
	Ready       string // True, False or Unknown
	ReadyValue  string // the condition's value: True, Unknown, Lost
	Devices     []deviceRow
	Commands    []*computev1.Command
	Events      []*computev1.Event
	Kinds       []string
	Idem        string
	Notes       []note
	Draining    bool
	BookingNote string
	// MIG says a GPU of the node has a MIG layout or slices.
	MIG     bool
	Rollout *rolloutInfo
}

// note is a secondary call of a page that failed: the page still shows
// what it could, and says what the API refused.
type note struct {
	What  string
	Error client.Envelope
}

func (c *Console) nodePage(_ http.ResponseWriter, r *http.Request, s *session, p *page) (string, error) {
	return "node", c.loadNode(r, s, p)
}

// loadNode fills p with node {id}'s page.
func (c *Console) loadNode(r *http.Request, s *session, p *page) error {
	id := r.PathValue("id")
	p.Title, p.Active = "Node "+id, "fleet"
	d := &nodeData{Kinds: c.kinds, Idem: newIdem(), Ready: "Unknown"}
	p.Data = d
	if len(id) > maxField {
		return fault.New(fault.InvalidInput, "nodeId", "at most %d characters, got %d", maxField, len(id))
	}
	got, err := computev1.NewNodesServiceClient(c.cfg.Conn).Get(s.ctx, &computev1.NodesServiceGetRequest{TenantId: s.Tenant, NodeId: id})
	if err != nil {
		return err
	}
	n := got.GetNode()
	d.Node = n
	d.ReadyValue = readyOf(n)
	d.Ready = readyAttr(d.ReadyValue)
	if d.ReadyValue == "" {
		d.ReadyValue = "Unknown"
	}
	for _, cd := range n.GetConditions() {
		if cd.GetType() == "Draining" && cd.GetStatus() {
			d.Draining = true
		}
	}

	// Bookings: the tenant's live reservations that book this node's GPUs.
	booked := map[string]string{}
	rc := computev1.NewReservationsServiceClient(c.cfg.Conn)
	for _, st := range []string{"placed", "bound"} {
		token := ""
		for range maxScanPages {
			resp, err := rc.List(s.ctx, &computev1.ReservationsServiceListRequest{TenantId: s.Tenant, State: st, PageSize: listPage, PageToken: token})
			if err != nil {
				d.Notes = append(d.Notes, note{"bookings (reservations.list)", envelope(err)})
				break
			}
			for _, res := range resp.GetReservations() {
				for _, b := range res.GetBookings() {
					if b.GetNodeId() == id {
						booked[b.GetDeviceId()] = res.GetId()
					}
				}
			}
			if token = resp.GetNextPageToken(); token == "" {
				break
			}
		}
		if token != "" {
			d.BookingNote = "more live reservations than the page reads: bookings may be missing"
		}
	}
	for _, dev := range n.GetDevices() {
		row := deviceRow{Device: dev, Reservation: booked[dev.GetId()]}
		for _, sl := range dev.GetMigSlices() {
			sr := sliceRow{MigSlice: sl, Reservation: cmp.Or(sl.GetReservationId(), booked[sl.GetId()])}
			if sr.Reservation != "" {
				row.Booked++
			}
			row.Slices = append(row.Slices, sr)
		}
		if len(dev.GetMigLayout()) > 0 || len(row.Slices) > 0 || dev.GetMigEnabled() {
			d.MIG = true
		}
		d.Devices = append(d.Devices, row)
	}
	if id := n.GetRolloutId(); id != "" {
		ri := &rolloutInfo{ID: id, Batch: int(n.GetRolloutBatch()) + 1, Released: n.GetRolloutReleased()}
		ro, err := computev1.NewRolloutsServiceClient(c.cfg.Conn).Get(s.ctx, &computev1.RolloutsServiceGetRequest{TenantId: s.Tenant, RolloutId: id})
		if err != nil {
			d.Notes = append(d.Notes, note{"rollout (rollouts.get)", envelope(err)})
		} else {
			r := ro.GetRollout()
			ri.Batches, ri.State, ri.Current = len(r.GetBatches()), r.GetState(), int(r.GetCurrentBatch())+1
		}
		d.Rollout = ri
	}

	cmds, err := computev1.NewCommandsServiceClient(c.cfg.Conn).List(s.ctx, &computev1.CommandsServiceListRequest{TenantId: s.Tenant, NodeId: id, PageSize: nodeCommands})
	if err != nil {
		d.Notes = append(d.Notes, note{"commands (commands.list)", envelope(err)})
	} else {
		d.Commands = cmds.GetCommands()
	}

	evs, last, _, err := c.scanEvents(s, &computev1.EventsServiceListRequest{TenantId: s.Tenant, Subject: id}, nodeEvents)
	if err != nil {
		d.Notes = append(d.Notes, note{"events (events.list)", envelope(err)})
	}
	reverse(evs)
	d.Events = evs
	// The stream replays this node's events after the last one listed
	// (from the start when none was), so nothing falls between the page
	// and the stream.
	p.Stream = streamURL(s, "", id, cursorOr(last, "0"))
	return nil
}

func cursorOr(c, def string) string {
	if c == "" {
		return def
	}
	return c
}

// runCommand queues an allowlisted command on the node and shows it.
func (c *Console) runCommand(w http.ResponseWriter, r *http.Request, s *session) {
	id := r.PathValue("id")
	fail := func(err error) {
		p := &page{S: s}
		if lerr := c.loadNode(r, s, p); lerr != nil {
			c.render(w, p, "node", lerr)
			return
		}
		c.render(w, p, "node", err)
	}
	kind, err := field(r, "kind", maxField)
	if err != nil {
		fail(err)
		return
	}
	if kind == "" {
		fail(fault.New(fault.InvalidInput, "kind", "choose a command kind"))
		return
	}
	idem, _ := field(r, "idem", maxField)
	if idem != "" && !idemRE.MatchString(idem) {
		fail(fault.New(fault.InvalidInput, "idem", "expected 1 to 64 letters, digits, _ or -"))
		return
	}
	req := &computev1.CommandsServiceRunRequest{TenantId: s.Tenant, NodeId: id, Kind: kind}
	if idem != "" {
		req.IdempotencyKey = "console-" + idem
	}
	resp, err := computev1.NewCommandsServiceClient(c.cfg.Conn).Run(s.ctx, req)
	if err != nil {
		fail(err)
		return
	}
	http.Redirect(w, r, commandURL(s, resp.GetCommand().GetId(), id), http.StatusSeeOther)
}

// commandURL is a command's page; it names the command's node, which
// commands.get needs.
func commandURL(s *session, command, node string) string {
	v := url.Values{"node": {node}}
	if s.Selected() {
		v.Set("tenant", s.Tenant)
	}
	return Prefix + "commands/" + url.PathEscape(command) + "?" + v.Encode()
}

func nodeURL(s *session, node string) string {
	u := Prefix + "nodes/" + url.PathEscape(node)
	if s.Selected() {
		u += "?tenant=" + url.QueryEscape(s.Tenant)
	}
	return u
}

// drain and undrain call nodes.drain and nodes.undrain, then show the node.
func (c *Console) drain(w http.ResponseWriter, r *http.Request, s *session) {
	c.drainOrUndrain(w, r, s, true)
}

func (c *Console) undrain(w http.ResponseWriter, r *http.Request, s *session) {
	c.drainOrUndrain(w, r, s, false)
}

func (c *Console) drainOrUndrain(w http.ResponseWriter, r *http.Request, s *session, drain bool) {
	id := r.PathValue("id")
	err := func() error {
		nc := computev1.NewNodesServiceClient(c.cfg.Conn)
		if !drain {
			_, err := nc.Undrain(s.ctx, &computev1.NodesServiceUndrainRequest{TenantId: s.Tenant, NodeId: id})
			return err
		}
		reason, err := field(r, "reason", maxReason)
		if err != nil {
			return err
		}
		var secs int64
		if v, err := field(r, "deadlineSeconds", 16); err != nil {
			return err
		} else if v != "" {
			if secs, err = strconv.ParseInt(v, 10, 64); err != nil || secs < 0 || secs > maxDrainSeconds {
				return fault.New(fault.InvalidInput, "deadlineSeconds", "expected 0 (the API's default) to %d seconds, got %q", maxDrainSeconds, v)
			}
		}
		_, err = nc.Drain(s.ctx, &computev1.NodesServiceDrainRequest{TenantId: s.Tenant, NodeId: id, Reason: reason, DeadlineSeconds: secs})
		return err
	}()
	if err != nil {
		p := &page{S: s}
		if lerr := c.loadNode(r, s, p); lerr != nil {
			err = lerr
		}
		c.render(w, p, "node", err)
		return
	}
	http.Redirect(w, r, nodeURL(s, id), http.StatusSeeOther)
}

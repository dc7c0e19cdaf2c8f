package commands

import (
	"fmt"
	"net/url"
	"path"
	"regexp"
	"slices"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/bettercompute/bettercompute/proto/agentrelease"
	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
	"github.com/bettercompute/bettercompute/proto/commandkinds"

	"github.com/bettercompute/bettercompute/pkg/fault"
)

// Lane is a daemon's concurrency lane: a command takes one of its lane's
// credits while it runs; with none left the daemon rejects it BUSY.
type Lane string

// The lanes (DESIGN §6), declared with their credits on the Lane enum
// (proto/commandkinds).
const (
	LaneDiag      Lane = "diag"
	LaneDefault   Lane = "default"
	LaneExclusive Lane = "exclusive"
)

// Credits is how many commands of a lane a daemon runs at once, as
// declared on the Lane enum (proto/commandkinds).
var Credits = func() map[Lane]int {
	m := map[Lane]int{}
	for l, n := range commandkinds.Credits() {
		m[Lane(l)] = n
	}
	return m
}()

// Kind is a registered command kind and the rules for delivering it.
type Kind struct {
	// Name, e.g. "inventory.refresh".
	Name string
	// Field is the CommandBody oneof field carrying the kind's payload, e.g.
	// "inventory_refresh".
	Field protoreflect.Name
	// API: commands.run accepts it (the spec's allowlist).
	API bool
	// RetrySafe: running it twice does no harm, so a lost journal sends it
	// again instead of failing it journal-lost.
	RetrySafe bool
	// SelfTerminating: the daemon never reports success; the command
	// succeeds when the node reconnects with a new boot id.
	SelfTerminating bool
	// Destructive: signed with the command-signing key when it is queued
	// (by a [Registry.Signing] registry, in the enqueue transaction); the
	// daemon rejects it BAD_SIGNATURE unless the signature verifies.
	Destructive bool
	// Lane the daemon runs it in.
	Lane Lane
	// Timeout is how long it may run once accepted: an in-flight command
	// past not_after + Timeout fails with reason "timeout".
	Timeout time.Duration
	// Doc is one line for the kinds reference.
	Doc string
	// Check, when set, refuses a payload that decodes but is out of
	// bounds, with a fault naming the field (Encode calls it).
	Check func(*agentv1.CommandBody) error
	// Ramdisk: sent to a node in its ramdisk (bcd ramdisk, a session with a
	// ramdisk certificate), whose sessions get no other kind: the
	// commissioning flow's (see [Registry.ClaimSession]).
	Ramdisk bool
	// RamdiskOnly: sent to a node in its ramdisk and never to another
	// session (implies Ramdisk).
	RamdiskOnly bool
}

// Declared returns what of k the wire contract declares (see
// proto/commandkinds): its name, payload field, lane and flags.
func (k Kind) Declared() commandkinds.Kind {
	return commandkinds.Kind{
		Name: k.Name, Field: k.Field, Lane: string(k.Lane),
		Destructive: k.Destructive, SelfTerminating: k.SelfTerminating, Ramdisk: k.Ramdisk, RamdiskOnly: k.RamdiskOnly,
	}
}

// SendableTo reports whether a session, in its ramdisk or not, is sent
// commands of kind k.
func (k Kind) SendableTo(ramdisk bool) bool {
	if ramdisk {
		return k.Ramdisk || k.RamdiskOnly
	}
	return !k.RamdiskOnly
}

// Message returns the kind's payload message type (a new empty message).
func (k Kind) Message() protoreflect.Message {
	body := (&agentv1.CommandBody{}).ProtoReflect()
	return body.NewField(body.Descriptor().Fields().ByName(k.Field)).Message()
}

// Registry holds the kinds this process knows and, for the processes that
// admit commands, the command-signing key (see [Registry.Signing]).
type Registry struct {
	set *kindSet
	// signer signs destructive commands at Enqueue for trustDomain; nil
	// queues them unsigned (daemons reject them BAD_SIGNATURE).
	signer      *Signer
	trustDomain string
}

// kindSet is the kinds, shared by a registry and its [Registry.Signing]
// views.
type kindSet struct {
	mu    sync.RWMutex
	kinds map[string]Kind
}

// NewRegistry returns an empty registry.
func NewRegistry() *Registry { return &Registry{set: &kindSet{kinds: map[string]Kind{}}} }

// Signing returns a view of r — the same kinds: one registered on either is
// on both — whose [Registry.Enqueue] signs destructive commands with s for
// the installation's trust domain, in the enqueue transaction, storing the
// signature with the row. Give it to whatever admits commands (the api, the
// controllers), never to the gateway: the gateway sends stored signatures
// and holds no key.
func (r *Registry) Signing(s *Signer, trustDomain string) *Registry {
	return &Registry{set: r.set, signer: s, trustDomain: trustDomain}
}

// Signs reports whether r's Enqueue signs destructive commands.
func (r *Registry) Signs() bool { return r.signer != nil }

var kindName = regexp.MustCompile(`^[a-z][a-z0-9-]*(\.[a-z][a-z0-9-]*)+$`)

// Register adds k. The name must be dotted lower case and new, the field a
// message field of CommandBody's oneof, the lane known and the timeout
// positive.
func (r *Registry) Register(k Kind) error {
	if !kindName.MatchString(k.Name) {
		return fmt.Errorf("command kind %q: want dotted lower-case words", k.Name)
	}
	fd := (&agentv1.CommandBody{}).ProtoReflect().Descriptor().Fields().ByName(k.Field)
	if fd == nil || fd.ContainingOneof() == nil || fd.Message() == nil {
		return fmt.Errorf("command kind %s: %q is not a payload field of CommandBody", k.Name, k.Field)
	}
	if _, ok := Credits[k.Lane]; !ok {
		return fmt.Errorf("command kind %s: unknown lane %q", k.Name, k.Lane)
	}
	if k.Timeout <= 0 {
		return fmt.Errorf("command kind %s: timeout must be positive", k.Name)
	}
	r.set.mu.Lock()
	defer r.set.mu.Unlock()
	if _, dup := r.set.kinds[k.Name]; dup {
		return fmt.Errorf("command kind %s registered twice", k.Name)
	}
	r.set.kinds[k.Name] = k
	return nil
}

// MustRegister is Register that panics, for init-time registration.
func (r *Registry) MustRegister(k Kind) {
	if err := r.Register(k); err != nil {
		panic(err)
	}
}

// Lookup returns the kind named name.
func (r *Registry) Lookup(name string) (Kind, bool) {
	r.set.mu.RLock()
	defer r.set.mu.RUnlock()
	k, ok := r.set.kinds[name]
	return k, ok
}

// Kinds returns every kind, by name.
func (r *Registry) Kinds() []Kind {
	r.set.mu.RLock()
	defer r.set.mu.RUnlock()
	ks := make([]Kind, 0, len(r.set.kinds))
	for _, k := range r.set.kinds {
		ks = append(ks, k)
	}
	slices.SortFunc(ks, func(a, b Kind) int { return strings.Compare(a.Name, b.Name) })
	return ks
}

// DefaultTimeout applies to a kind this process does not know (a module's
// kind registered elsewhere) when the sweeper times commands out.
const DefaultTimeout = 15 * time.Minute

// timeout is the kind's timeout, or DefaultTimeout.
func (r *Registry) timeout(name string) time.Duration {
	if k, ok := r.Lookup(name); ok {
		return k.Timeout
	}
	return DefaultTimeout
}

// Builtin returns a registry with the server's kinds (DESIGN §6): every
// kind declared on a payload message of CommandBody (proto/commandkinds),
// which gives its name, field, lane, and whether it is destructive,
// self-terminating or for the ramdisk; the rest is the control plane's.
// disk.wipe, image.deploy and node.kexec are the metal
// workflow's (bcd ramdisk runs them), never commands.run's.
func Builtin() *Registry {
	r := NewRegistry()
	r.MustRegister(declared(KindDiagNVML, Kind{API: true, RetrySafe: true, Timeout: 10 * time.Minute,
		Doc: "Runs NVML health checks and a short check per GPU; level medium, long or full also runs DCGM's diagnostics (dcgmi diag -r 2 or 3) and fails where DCGM is not installed.", Check: checkDiagNvml}))
	r.MustRegister(declared(KindInventoryRefresh, Kind{API: true, RetrySafe: true, Timeout: 2 * time.Minute,
		Doc: "Re-collects inventory sections and reports them on the session."}))
	r.MustRegister(declared(KindLogsCollect, Kind{API: true, RetrySafe: true, Timeout: 10 * time.Minute,
		Doc: "Collects the daemon's logs, bounded in size (1 MiB by default, 4 MiB at most), from at most 16 distinct sources (agent); streams each source's lines as it reads them (commands.getOutput).", Check: checkLogsCollect}))
	r.MustRegister(declared(KindNodeReboot, Kind{API: true, Timeout: 15 * time.Minute,
		Doc: "Reboots the node; succeeds when the node reconnects with a new boot id."}))
	r.MustRegister(declared(KindGPUReset, Kind{Timeout: 5 * time.Minute,
		Doc: "Resets GPUs by UUID (the remediation ladder's first step); the daemon refuses a GPU running compute processes unless force is set.", Check: checkGpuReset}))
	r.MustRegister(declared(KindDiskWipe, Kind{Timeout: 6 * time.Hour,
		Doc: "Wipes disks of a machine in commissioning (bcd ramdisk) by discard, zeros or the drive's secure erase, reading back what it can; issued only by the metal workflow. The result is signed by the ramdisk's key (proto/resultsig).", Check: checkDiskWipe}))
	r.MustRegister(declared(KindImageDeploy, Kind{Timeout: 2 * time.Hour,
		Doc: "Streams a raw disk image over HTTP onto a disk (bcd ramdisk), hashing it as it goes; succeeds only when its SHA-256 matches. The result is signed by the ramdisk's key.", Check: checkImageDeploy}))
	r.MustRegister(declared(KindNodeKexec, Kind{Timeout: 10 * time.Minute,
		Doc: "Fetches a kernel and initrd, checks their SHA-256 and kexecs into them (bcd ramdisk); succeeds when the node reconnects with a new boot id.", Check: checkNodeKexec}))
	r.MustRegister(declared(KindAgentUpgrade, Kind{API: true, Timeout: 15 * time.Minute,
		Doc: "Upgrades the node's bcd now to the build a signed release manifest names (better-compute artifacts publish): the daemon verifies it against its pinned release key, refuses an expired one or an older counter, stages the build A/B and hands over; succeeds once the build is staged, and a build that does not report within 30 s is rolled back and UpgradeFailed latched (docs/agent-upgrades.md).", Check: checkAgentUpgrade}))
	r.MustRegister(declared(KindInstanceReboot, Kind{RetrySafe: true, Timeout: 5 * time.Minute,
		Doc: "Restarts one of a vps-host's running instances (instances.reboot, never commands.run); the host refuses an instance it does not run.", Check: checkInstanceReboot}))
	return r
}

// declared returns k with what the wire contract declares of the kind named
// name (proto/commandkinds) filled in: its name, payload field, lane and
// the destructive, self-terminating and ramdisk flags. It panics on a name
// the contract does not declare.
func declared(name string, k Kind) Kind {
	d, ok := commandkinds.Lookup(name)
	if !ok {
		panic(fmt.Sprintf("command kind %s: no payload message of CommandBody declares it", name))
	}
	k.Name, k.Field, k.Lane = d.Name, d.Field, Lane(d.Lane)
	k.Destructive, k.SelfTerminating, k.Ramdisk, k.RamdiskOnly = d.Destructive, d.SelfTerminating, d.Ramdisk, d.RamdiskOnly
	return k
}

// The built-in kinds' names ([Builtin] registers them), for the code that
// queues them.
const (
	KindDiagNVML         = commandkinds.DiagNVML
	KindInventoryRefresh = commandkinds.InventoryRefresh
	KindLogsCollect      = commandkinds.LogsCollect
	KindNodeReboot       = commandkinds.NodeReboot
	KindGPUReset         = commandkinds.GPUReset
	KindDiskWipe         = commandkinds.DiskWipe
	KindImageDeploy      = commandkinds.ImageDeploy
	KindNodeKexec        = commandkinds.NodeKexec
	// KindInstanceReboot is the kind instances.reboot queues on the
	// instance's host.
	KindInstanceReboot = commandkinds.InstanceReboot
	// KindAgentUpgrade upgrades one node's bcd now.
	KindAgentUpgrade = commandkinds.AgentUpgrade
)

// MaxInstanceID bounds instance.reboot's instance id.
const MaxInstanceID = 64

// checkInstanceReboot wants an instance id ("inst_…") of at most
// MaxInstanceID characters: INVALID_INPUT "payload.instanceId".
func checkInstanceReboot(body *agentv1.CommandBody) error {
	id := body.GetInstanceReboot().GetInstanceId()
	if !strings.HasPrefix(id, "inst_") || len(id) > MaxInstanceID || strings.ContainsAny(id, "/\\\x00\n ") {
		return fault.New(fault.InvalidInput, "payload.instanceId", "want an instance id (inst_…) of at most %d characters, got %q", MaxInstanceID, id)
	}
	return nil
}

// Bounds of the commissioning kinds' payloads (disk.wipe, image.deploy,
// node.kexec); those the daemon checks too are declared in proto/commandkinds.
const (
	// MaxWipeDisks bounds disk.wipe's disks.
	MaxWipeDisks = commandkinds.MaxWipeDisks
	// MaxDiskPath bounds one device path, in characters.
	MaxDiskPath = commandkinds.MaxDiskPath
	// MaxURL bounds an image or kernel URL, in characters.
	MaxURL = commandkinds.MaxURL
	// MaxKexecCmdline bounds node.kexec's cmdline, in characters.
	MaxKexecCmdline = commandkinds.MaxKexecCmdline
	// MaxImageBytes bounds image.deploy's size_bytes (1 PiB).
	MaxImageBytes = 1 << 50
	// MaxWipeReason bounds disk.wipe's reason, in characters.
	MaxWipeReason = 1024
)

// checkDiskWipe wants 1 to MaxWipeDisks distinct absolute device paths of
// at most MaxDiskPath characters, a method and a short reason.
func checkDiskWipe(body *agentv1.CommandBody) error {
	p := body.GetDiskWipe()
	disks := p.GetDisks()
	if len(disks) == 0 || len(disks) > MaxWipeDisks {
		return fault.New(fault.InvalidInput, "payload.disks", "want 1 to %d disks, got %d", MaxWipeDisks, len(disks))
	}
	for i, d := range disks {
		if err := checkDiskPath("payload.disks", d); err != nil {
			return err
		}
		if slices.Contains(disks[:i], d) {
			return fault.New(fault.InvalidInput, "payload.disks", "disk %s named twice", d)
		}
	}
	if _, ok := agentv1.WipeMethod_name[int32(p.GetMethod())]; !ok || p.GetMethod() == agentv1.WipeMethod_WIPE_METHOD_UNSPECIFIED {
		return fault.New(fault.InvalidInput, "payload.method", "required: WIPE_METHOD_DISCARD, WIPE_METHOD_ZERO or WIPE_METHOD_SECURE_ERASE")
	}
	if n := len([]rune(p.GetReason())); n > MaxWipeReason {
		return fault.New(fault.InvalidInput, "payload.reason", "at most %d characters, got %d", MaxWipeReason, n)
	}
	return nil
}

// checkImageDeploy wants an http(s) URL, a hex SHA-256, a device path, a
// size within MaxImageBytes and the raw format.
func checkImageDeploy(body *agentv1.CommandBody) error {
	p := body.GetImageDeploy()
	if err := checkURL("payload.url", p.GetUrl(), true); err != nil {
		return err
	}
	if err := checkSHA256("payload.sha256", p.GetSha256()); err != nil {
		return err
	}
	if err := checkDiskPath("payload.disk", p.GetDisk()); err != nil {
		return err
	}
	if p.GetSizeBytes() > MaxImageBytes {
		return fault.New(fault.InvalidInput, "payload.sizeBytes", "at most %d bytes, got %d", uint64(MaxImageBytes), p.GetSizeBytes())
	}
	switch p.GetFormat() {
	case agentv1.ImageFormat_IMAGE_FORMAT_UNSPECIFIED, agentv1.ImageFormat_IMAGE_FORMAT_RAW:
	default:
		return fault.New(fault.InvalidInput, "payload.format", "only IMAGE_FORMAT_RAW is supported")
	}
	return nil
}

// checkNodeKexec wants a kernel URL and SHA-256, an initrd SHA-256 with an
// initrd URL, and a command line of at most MaxKexecCmdline characters.
func checkNodeKexec(body *agentv1.CommandBody) error {
	p := body.GetNodeKexec()
	if err := checkURL("payload.kernelUrl", p.GetKernelUrl(), true); err != nil {
		return err
	}
	if err := checkSHA256("payload.kernelSha256", p.GetKernelSha256()); err != nil {
		return err
	}
	if err := checkURL("payload.initrdUrl", p.GetInitrdUrl(), false); err != nil {
		return err
	}
	if p.GetInitrdUrl() != "" {
		if err := checkSHA256("payload.initrdSha256", p.GetInitrdSha256()); err != nil {
			return err
		}
	} else if p.GetInitrdSha256() != "" {
		return fault.New(fault.InvalidInput, "payload.initrdSha256", "set without initrdUrl")
	}
	if n := len([]rune(p.GetCmdline())); n > MaxKexecCmdline {
		return fault.New(fault.InvalidInput, "payload.cmdline", "at most %d characters, got %d", MaxKexecCmdline, n)
	}
	return nil
}

func checkDiskPath(field, d string) error {
	switch {
	case d == "":
		return fault.New(fault.InvalidInput, field, "required: a device path")
	case len(d) > MaxDiskPath:
		return fault.New(fault.InvalidInput, field, "a device path of at most %d characters, got %d", MaxDiskPath, len(d))
	case !strings.HasPrefix(d, "/") || path.Clean(d) != d || strings.ContainsAny(d, "\x00\n"):
		return fault.New(fault.InvalidInput, field, "%q is not a clean absolute device path", d)
	}
	return nil
}

func checkURL(field, raw string, required bool) error {
	if raw == "" {
		if required {
			return fault.New(fault.InvalidInput, field, "required: an http:// or https:// URL")
		}
		return nil
	}
	if len(raw) > MaxURL {
		return fault.New(fault.InvalidInput, field, "at most %d characters, got %d", MaxURL, len(raw))
	}
	u, err := url.Parse(raw)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return fault.New(fault.InvalidInput, field, "want an http:// or https:// URL")
	}
	return nil
}

var sha256Hex = regexp.MustCompile(`^[0-9a-f]{64}$`)

func checkSHA256(field, s string) error {
	if !sha256Hex.MatchString(s) {
		return fault.New(fault.InvalidInput, field, "want a SHA-256: 64 lower-case hex characters")
	}
	return nil
}

// Bounds of gpu.reset's payload (the first two declared in
// proto/commandkinds: the daemon checks them too).
const (
	// MaxResetGPUs bounds gpu_uuids.
	MaxResetGPUs = commandkinds.MaxResetGPUs
	// MaxResetReason bounds reason, in characters.
	MaxResetReason = commandkinds.MaxResetReason
	// maxGPUUUID bounds one GPU UUID ("GPU-" and 36 characters).
	maxGPUUUID = 64
)

// checkGpuReset wants 1 to MaxResetGPUs distinct GPU UUIDs and a reason of
// at most MaxResetReason characters: INVALID_INPUT on the field.
func checkGpuReset(body *agentv1.CommandBody) error {
	p := body.GetGpuReset()
	uuids := p.GetGpuUuids()
	if len(uuids) == 0 || len(uuids) > MaxResetGPUs {
		return fault.New(fault.InvalidInput, "payload.gpuUuids", "want 1 to %d GPU UUIDs, got %d", MaxResetGPUs, len(uuids))
	}
	for i, u := range uuids {
		if !strings.HasPrefix(u, "GPU-") || len(u) > maxGPUUUID {
			return fault.New(fault.InvalidInput, "payload.gpuUuids", "%q is not a GPU UUID (GPU-…)", u)
		}
		if slices.Contains(uuids[:i], u) {
			return fault.New(fault.InvalidInput, "payload.gpuUuids", "GPU %s named twice", u)
		}
	}
	if n := len([]rune(p.GetReason())); n > MaxResetReason {
		return fault.New(fault.InvalidInput, "payload.reason", "at most %d characters, got %d", MaxResetReason, n)
	}
	return nil
}

// maxDiagLabel bounds diag.nvml's label.
const maxDiagLabel = 128

// checkDiagNvml refuses a level diag.nvml does not know: INVALID_INPUT
// "payload.level", naming the levels; and a label over maxDiagLabel
// characters (INVALID_INPUT "payload.label").
func checkDiagNvml(body *agentv1.CommandBody) error {
	l := body.GetDiagNvml().GetLevel()
	if _, ok := commandkinds.DiagRunLevel(l); !ok {
		return fault.New(fault.InvalidInput, "payload.level", "unknown diag level %q (known: %s)", clipRunes(l, 64), strings.Join(commandkinds.DiagLevels, ", "))
	}
	if n := utf8.RuneCountInString(body.GetDiagNvml().GetLabel()); n > maxDiagLabel {
		return fault.New(fault.InvalidInput, "payload.label", "at most %d characters, got %d", maxDiagLabel, n)
	}
	return nil
}

// clipRunes cuts s to at most n characters, for echoing input in an error.
func clipRunes(s string, n int) string {
	if r := []rune(s); len(r) > n {
		return string(r[:n]) + "…"
	}
	return s
}

// LogSources are the sources logs.collect knows ("agent" is another name
// for "bcd"), MaxLogSources how many one command may name (the daemon reads
// each once, within one byte budget).
var LogSources = commandkinds.LogSources

// MaxLogSources bounds logs.collect's sources (proto/commandkinds).
const MaxLogSources = commandkinds.MaxLogSources

// checkLogsCollect refuses more than MaxLogSources sources, a source named
// twice (under either of its names) and one not in LogSources:
// INVALID_INPUT "payload.sources", naming it; and more than
// commandkinds.MaxLogUnits units, a unit name journalctl would not take,
// or units without the journal source: INVALID_INPUT "payload.units".
func checkLogsCollect(body *agentv1.CommandBody) error {
	p := body.GetLogsCollect()
	src := p.GetSources()
	if len(src) > MaxLogSources {
		return fault.New(fault.InvalidInput, "payload.sources", "at most %d sources, got %d", MaxLogSources, len(src))
	}
	seen := make([]string, 0, len(src))
	for _, s := range src {
		name, ok := commandkinds.LogSource(s)
		if !ok {
			return fault.New(fault.InvalidInput, "payload.sources", "unknown log source %q (known: %s)", s, strings.Join(LogSources, ", "))
		}
		if slices.Contains(seen, name) {
			return fault.New(fault.InvalidInput, "payload.sources", "log source %q named twice", s)
		}
		seen = append(seen, name)
	}
	units := p.GetUnits()
	if len(units) > commandkinds.MaxLogUnits {
		return fault.New(fault.InvalidInput, "payload.units", "at most %d units, got %d", commandkinds.MaxLogUnits, len(units))
	}
	for _, u := range units {
		if !commandkinds.ValidUnit(u) {
			return fault.New(fault.InvalidInput, "payload.units", "%q is not a systemd unit name (1 to %d of A-Z a-z 0-9 : - _ . \\ @, not starting with -)",
				u, commandkinds.MaxLogUnit)
		}
	}
	if len(units) > 0 && !slices.Contains(seen, commandkinds.LogSourceJournal) {
		return fault.New(fault.InvalidInput, "payload.units", "units filter the journal source, which is not asked for")
	}
	return nil
}

// checkAgentUpgrade wants a reason of at most MaxResetReason characters
// ("payload.reason") and a release manifest that parses, is well formed
// and signed (INVALID_INPUT "payload.releaseManifest", naming what is
// wrong; its signature and counter are the node's to check, against the key
// it pins) — or none with clearUpgradeFailed (nodes.clearUpgrade).
func checkAgentUpgrade(body *agentv1.CommandBody) error {
	p := body.GetAgentUpgrade()
	if n := len([]rune(p.GetReason())); n > MaxResetReason {
		return fault.New(fault.InvalidInput, "payload.reason", "at most %d characters, got %d", MaxResetReason, n)
	}
	if p.GetClearUpgradeFailed() && len(p.GetReleaseManifest()) == 0 {
		return nil // nodes.clearUpgrade: only the latch
	}
	m, err := agentrelease.Parse(p.GetReleaseManifest())
	if err == nil {
		err = agentrelease.Check(m)
	}
	if err != nil {
		return fault.Wrap(err, fault.InvalidInput, "payload.releaseManifest", "%v", err)
	}
	if len(m.Signature) == 0 {
		return fault.New(fault.InvalidInput, "payload.releaseManifest", "the manifest is not signed (better-compute artifacts publish)")
	}
	return nil
}

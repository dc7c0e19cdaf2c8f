package libvirt

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	golibvirt "github.com/digitalocean/go-libvirt"
	"github.com/digitalocean/go-libvirt/socket/dialers"
	"libvirt.org/go/libvirtxml"

	"github.com/bettercompute/bettercompute/agent/vps"
	"github.com/bettercompute/bettercompute/agent/vps/seed"
)

// DefaultSocket is libvirtd's read-write unix socket.
const DefaultSocket = "/var/run/libvirt/libvirt-sock"

// Config sets up a Runtime.
type Config struct {
	// Socket is libvirtd's unix socket; empty means DefaultSocket.
	Socket string
	// Pool is the storage pool the root disks go in; empty means
	// "default".
	Pool string
	// ImageDir holds the images; Spec.Image is a file name in it (".qcow2"
	// images are qcow2, anything else raw). Required.
	ImageDir string
	// SeedDir is where the seed ISOs are written (readable by QEMU).
	// Required.
	SeedDir string
	// Domain are the host-wide parts of every domain (type, machine, NIC).
	Domain DomainOptions
	// StopTimeout is how long a stop waits for the guest to shut down
	// before the domain is destroyed; zero means 60 s.
	StopTimeout time.Duration
	// Logger logs domain changes; nil means slog.Default().
	Logger *slog.Logger
}

// Runtime runs instances as libvirt domains. It implements vps.Runtime.
type Runtime struct {
	cfg Config
	l   *golibvirt.Libvirt
	mu  sync.Mutex
}

var _ vps.Runtime = (*Runtime)(nil)

// Connect dials libvirtd over its unix socket.
func Connect(cfg Config) (*Runtime, error) {
	if cfg.ImageDir == "" || cfg.SeedDir == "" {
		return nil, errors.New("vps/libvirt: an image and a seed directory are required")
	}
	cfg.Socket = cmp.Or(cfg.Socket, DefaultSocket)
	cfg.Pool = cmp.Or(cfg.Pool, "default")
	cfg.StopTimeout = cmp.Or(cfg.StopTimeout, 60*time.Second)
	cfg.Logger = cmp.Or(cfg.Logger, slog.Default())
	if _, err := os.Stat(cfg.Socket); err != nil {
		return nil, fmt.Errorf("vps/libvirt: no libvirtd socket: %w", err)
	}
	l := golibvirt.NewWithDialer(dialers.NewLocal(dialers.WithSocket(cfg.Socket), dialers.WithLocalTimeout(10*time.Second)))
	if err := l.ConnectToURI(golibvirt.QEMUSystem); err != nil {
		return nil, fmt.Errorf("vps/libvirt: connecting to %s: %w", cfg.Socket, err)
	}
	if err := os.MkdirAll(cfg.SeedDir, 0o755); err != nil {
		_ = l.Disconnect()
		return nil, fmt.Errorf("vps/libvirt: %w", err)
	}
	return &Runtime{cfg: cfg, l: l}, nil
}

// Close disconnects from libvirtd; the domains keep running.
func (r *Runtime) Close() error { return r.l.Disconnect() }

func isNoDomain(err error) bool { return golibvirt.IsNotFound(err) }

// lookup returns the domain of id, or ok false when there is none.
func (r *Runtime) lookup(id string) (golibvirt.Domain, bool, error) {
	d, err := r.l.DomainLookupByName(DomainName(id))
	if err != nil {
		if isNoDomain(err) {
			return golibvirt.Domain{}, false, nil
		}
		return golibvirt.Domain{}, false, err
	}
	return d, true, nil
}

// observe reads a domain's state and definition.
func (r *Runtime) observe(d golibvirt.Domain) (vps.Observed, *Metadata, error) {
	x, err := r.l.DomainGetXMLDesc(d, golibvirt.DomainXMLInactive)
	if err != nil {
		return vps.Observed{}, nil, err
	}
	desc, err := Describe(x)
	if err != nil {
		return vps.Observed{}, nil, err
	}
	if desc.Metadata == nil {
		return vps.Observed{}, nil, nil
	}
	st, reason, err := r.l.DomainGetState(d, 0)
	if err != nil {
		return vps.Observed{}, nil, err
	}
	m := desc.Metadata
	o := vps.Observed{ID: m.ID, Generation: m.Generation, Image: m.Image, Size: desc.Size, GPUs: desc.GPUs}
	switch golibvirt.DomainState(st) {
	case golibvirt.DomainRunning, golibvirt.DomainBlocked, golibvirt.DomainShutdown:
		o.State = vps.Running
	case golibvirt.DomainPaused:
		o.State, o.Reason = vps.Failed, fmt.Sprintf("the domain is paused (reason %d)", reason)
	case golibvirt.DomainCrashed:
		o.State, o.Reason = vps.Failed, fmt.Sprintf("the domain crashed (reason %d)", reason)
	default:
		o.State = vps.Stopped
		if m.Power == vps.Running {
			o.State, o.Reason = vps.Failed, fmt.Sprintf("the domain shut off (reason %d)", reason)
		}
	}
	return o, m, nil
}

func imageFormat(name string) string {
	if strings.HasSuffix(name, ".qcow2") {
		return "qcow2"
	}
	return "raw"
}

// ensureDisk creates the root disk (an overlay of the image) or grows it.
func (r *Runtime) ensureDisk(spec vps.Spec) (string, error) {
	pool, err := r.l.StoragePoolLookupByName(r.cfg.Pool)
	if err != nil {
		return "", fmt.Errorf("storage pool %s: %w", r.cfg.Pool, err)
	}
	name := DomainName(spec.ID) + ".qcow2"
	capacity := uint64(spec.Size.DiskGiB) << 30
	vol, err := r.l.StorageVolLookupByName(pool, name)
	if err != nil {
		if !golibvirt.IsNotFound(err) {
			return "", err
		}
		image := filepath.Join(r.cfg.ImageDir, spec.Image)
		if _, err := os.Stat(image); err != nil {
			return "", fmt.Errorf("image %s: %w", spec.Image, err)
		}
		v := libvirtxml.StorageVolume{
			Name:         name,
			Capacity:     &libvirtxml.StorageVolumeSize{Unit: "bytes", Value: capacity},
			Target:       &libvirtxml.StorageVolumeTarget{Format: &libvirtxml.StorageVolumeTargetFormat{Type: "qcow2"}},
			BackingStore: &libvirtxml.StorageVolumeBackingStore{Path: image, Format: &libvirtxml.StorageVolumeTargetFormat{Type: imageFormat(spec.Image)}},
		}
		x, err := v.Marshal()
		if err != nil {
			return "", err
		}
		if vol, err = r.l.StorageVolCreateXML(pool, x, 0); err != nil {
			return "", fmt.Errorf("creating the disk: %w", err)
		}
	} else {
		_, have, _, err := r.l.StorageVolGetInfo(vol)
		if err != nil {
			return "", err
		}
		switch {
		case capacity < have:
			return "", fmt.Errorf("the disk cannot shrink from %d GiB to %d GiB", have>>30, spec.Size.DiskGiB)
		case capacity > have:
			if err := r.l.StorageVolResize(vol, capacity, 0); err != nil {
				return "", fmt.Errorf("growing the disk: %w", err)
			}
		}
	}
	return r.l.StorageVolGetPath(vol)
}

// Ensure implements vps.Runtime.
func (r *Runtime) Ensure(ctx context.Context, spec vps.Spec) (vps.Observed, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if err := vps.Validate([]vps.Spec{spec}); err != nil {
		return vps.Observed{}, err
	}
	d, exists, err := r.lookup(spec.ID)
	if err != nil {
		return vps.Observed{}, err
	}
	running := false
	var cur vps.Observed
	if exists {
		o, m, err := r.observe(d)
		if err != nil {
			return vps.Observed{}, err
		}
		if m == nil {
			return vps.Observed{}, fmt.Errorf("domain %s exists and is not ours", DomainName(spec.ID))
		}
		if m.Image != spec.Image {
			return vps.Observed{}, fmt.Errorf("the image is fixed at create: %s, not %s (delete and create again)", m.Image, spec.Image)
		}
		cur, running = o, o.State == vps.Running
	}
	disk, err := r.ensureDisk(spec)
	if err != nil {
		return vps.Observed{}, err
	}
	iso, err := seed.Build(spec)
	if err != nil {
		return vps.Observed{}, err
	}
	seedPath := filepath.Join(r.cfg.SeedDir, DomainName(spec.ID)+"-seed.iso")
	if have, _ := os.ReadFile(seedPath); string(have) != string(iso) {
		if err := os.WriteFile(seedPath, iso, 0o644); err != nil {
			return vps.Observed{}, err
		}
	}
	changed := !exists || cur.Size != spec.Size || !slices.Equal(cur.GPUs, spec.GPUs)
	if running && (changed || spec.Power == vps.Stopped) {
		if err := r.stop(ctx, d); err != nil {
			return vps.Observed{}, err
		}
		running = false
	}
	x, err := DomainXML(spec, Paths{Disk: disk, Seed: seedPath}, r.cfg.Domain)
	if err != nil {
		return vps.Observed{}, err
	}
	// Defining again updates the persistent definition (and the metadata's
	// generation and power) without touching a running guest.
	if d, err = r.l.DomainDefineXML(x); err != nil {
		return vps.Observed{}, fmt.Errorf("defining the domain: %w", err)
	}
	if spec.Power == vps.Running && !running {
		if err := r.l.DomainCreate(d); err != nil {
			return vps.Observed{}, fmt.Errorf("starting the domain: %w", err)
		}
		r.cfg.Logger.InfoContext(ctx, "started instance", "instance", spec.ID, "size", spec.Size.String(), "gpus", spec.GPUs)
	}
	o, _, err := r.observe(d)
	return o, err
}

// stop shuts the guest down, destroying the domain after StopTimeout.
func (r *Runtime) stop(ctx context.Context, d golibvirt.Domain) error {
	if err := r.l.DomainShutdown(d); err != nil {
		r.cfg.Logger.WarnContext(ctx, "guest shutdown refused; destroying", "domain", d.Name, "err", err)
	} else {
		deadline := time.Now().Add(r.cfg.StopTimeout)
		for time.Now().Before(deadline) && ctx.Err() == nil {
			st, _, err := r.l.DomainGetState(d, 0)
			if err != nil {
				return err
			}
			if golibvirt.DomainState(st) == golibvirt.DomainShutoff {
				return nil
			}
			time.Sleep(200 * time.Millisecond)
		}
	}
	if err := r.l.DomainDestroy(d); err != nil {
		st, _, serr := r.l.DomainGetState(d, 0)
		if serr == nil && golibvirt.DomainState(st) == golibvirt.DomainShutoff {
			return nil
		}
		return fmt.Errorf("destroying the domain: %w", err)
	}
	return nil
}

// Stop implements vps.Runtime.
func (r *Runtime) Stop(ctx context.Context, id string) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	d, ok, err := r.lookup(id)
	if err != nil {
		return err
	}
	if !ok {
		return fmt.Errorf("%s: %w", id, vps.ErrNotFound)
	}
	o, _, err := r.observe(d)
	if err != nil || o.State != vps.Running {
		return err
	}
	return r.stop(ctx, d)
}

// Delete implements vps.Runtime.
func (r *Runtime) Delete(ctx context.Context, id string) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	d, ok, err := r.lookup(id)
	if err != nil {
		return err
	}
	if ok {
		o, m, err := r.observe(d)
		if err != nil {
			return err
		}
		if m == nil {
			return fmt.Errorf("domain %s is not ours", DomainName(id))
		}
		if o.State == vps.Running {
			if err := r.l.DomainDestroy(d); err != nil {
				return fmt.Errorf("destroying the domain: %w", err)
			}
		}
		if err := r.l.DomainUndefineFlags(d, golibvirt.DomainUndefineNvram); err != nil && !isNoDomain(err) {
			return fmt.Errorf("undefining the domain: %w", err)
		}
	}
	if pool, err := r.l.StoragePoolLookupByName(r.cfg.Pool); err == nil {
		if vol, err := r.l.StorageVolLookupByName(pool, DomainName(id)+".qcow2"); err == nil {
			if err := r.l.StorageVolDelete(vol, 0); err != nil {
				return fmt.Errorf("deleting the disk: %w", err)
			}
		}
	}
	if err := os.Remove(filepath.Join(r.cfg.SeedDir, DomainName(id)+"-seed.iso")); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	r.cfg.Logger.InfoContext(ctx, "deleted instance", "instance", id)
	return nil
}

// Reboot implements vps.Runtime.
func (r *Runtime) Reboot(_ context.Context, id string) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	d, ok, err := r.lookup(id)
	if err != nil {
		return err
	}
	if !ok {
		return fmt.Errorf("%s: %w", id, vps.ErrNotFound)
	}
	o, _, err := r.observe(d)
	if err != nil {
		return err
	}
	if o.State != vps.Running {
		return fmt.Errorf("%s: %w", id, vps.ErrNotRunning)
	}
	return r.l.DomainReboot(d, golibvirt.DomainRebootDefault)
}

// List implements vps.Runtime: the domains named DomainPrefix+"inst_…" that
// carry our metadata.
func (r *Runtime) List(context.Context) ([]vps.Observed, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	doms, _, err := r.l.ConnectListAllDomains(1, golibvirt.ConnectListDomainsActive|golibvirt.ConnectListDomainsInactive)
	if err != nil {
		return nil, err
	}
	var out []vps.Observed
	for _, d := range doms {
		if !strings.HasPrefix(d.Name, DomainPrefix+"inst_") {
			continue
		}
		o, m, err := r.observe(d)
		if err != nil {
			if isNoDomain(err) {
				continue
			}
			return nil, err
		}
		if m == nil || DomainName(m.ID) != d.Name {
			continue
		}
		out = append(out, o)
	}
	slices.SortFunc(out, func(a, b vps.Observed) int { return cmp.Compare(a.ID, b.ID) })
	return out, nil
}

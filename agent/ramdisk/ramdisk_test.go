package ramdisk_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/bettercompute/bettercompute/agent/command"
	"github.com/bettercompute/bettercompute/agent/ramdisk"
	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
)

// The executor's interface is what *Ramdisk implements.
var _ command.Ramdisk = (*ramdisk.Ramdisk)(nil)

// diskSize is odd on purpose: the last chunk is a partial one.
const diskSize = 3<<20 + 12345

type fixture struct {
	dir   string
	disks []string // in the inventory, filled with random bytes
	stray string   // a disk file outside the inventory
	kexec *recorder
	r     *ramdisk.Ramdisk
}

// setup makes two random-filled disk files in the inventory and one
// outside it, and a Ramdisk over them with a recording kexec hook.
func setup(t *testing.T) *fixture {
	t.Helper()
	f := &fixture{dir: t.TempDir(), kexec: &recorder{}}
	for _, name := range []string{"nvme0n1", "nvme1n1", "stray"} {
		p := filepath.Join(f.dir, name)
		b := make([]byte, diskSize)
		_, _ = rand.Read(b)
		if err := os.WriteFile(p, b, 0o600); err != nil {
			t.Fatal(err)
		}
		if name == "stray" {
			f.stray = p
		} else {
			f.disks = append(f.disks, p)
		}
	}
	work := filepath.Join(f.dir, "work")
	if err := os.Mkdir(work, 0o700); err != nil {
		t.Fatal(err)
	}
	r, err := ramdisk.New(ramdisk.Config{Disks: f.disks, Kexec: f.kexec, WorkDir: work, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	f.r = r
	return f
}

func read(t *testing.T, p string) []byte {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func allZero(b []byte) bool {
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}

func wantField(t *testing.T, err error, field string) {
	t.Helper()
	var fe *ramdisk.FieldError
	if !errors.As(err, &fe) || fe.Field != field {
		t.Fatalf("got %v, want a FieldError on %q", err, field)
	}
}

func TestWipe(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		method agentv1.WipeMethod
		want   []agentv1.WipeMethod // what the result may say
	}{
		{agentv1.WipeMethod_WIPE_METHOD_ZERO, []agentv1.WipeMethod{agentv1.WipeMethod_WIPE_METHOD_ZERO}},
		// A file system without hole punching falls back to zeros.
		{agentv1.WipeMethod_WIPE_METHOD_DISCARD, []agentv1.WipeMethod{agentv1.WipeMethod_WIPE_METHOD_DISCARD, agentv1.WipeMethod_WIPE_METHOD_ZERO}},
		// A file-backed disk has no drive to erase: zeros, and says so.
		{agentv1.WipeMethod_WIPE_METHOD_SECURE_ERASE, []agentv1.WipeMethod{agentv1.WipeMethod_WIPE_METHOD_ZERO}},
	} {
		t.Run(tc.method.String(), func(t *testing.T) {
			t.Parallel()
			f := setup(t)
			before := read(t, f.stray)
			res, err := f.r.WipeDisks(t.Context(), &agentv1.DiskWipe{Disks: f.disks, Method: tc.method})
			if err != nil {
				t.Fatal(err)
			}
			if len(res.GetDisks()) != 2 {
				t.Fatalf("result %v", res)
			}
			for i, d := range res.GetDisks() {
				if d.GetPath() != f.disks[i] || d.GetBytes() != diskSize || !d.GetVerified() || !containsMethod(tc.want, d.GetMethod()) {
					t.Errorf("disk %d: %v", i, d)
				}
				b := read(t, f.disks[i])
				if len(b) != diskSize || !allZero(b) {
					t.Errorf("%s: %d bytes, all zero %v", f.disks[i], len(b), allZero(b))
				}
			}
			if !bytes.Equal(read(t, f.stray), before) {
				t.Error("a disk outside the wipe changed")
			}
		})
	}
}

func containsMethod(ms []agentv1.WipeMethod, m agentv1.WipeMethod) bool {
	for _, x := range ms {
		if x == m {
			return true
		}
	}
	return false
}

// TestWipeRefusesDisksOutsideTheInventory: a path not in the inventory (by
// name, by .., or named twice through a link) is refused on the field
// before any disk is touched.
func TestWipeRefusesDisksOutsideTheInventory(t *testing.T) {
	t.Parallel()
	f := setup(t)
	link := filepath.Join(f.dir, "by-id-nvme0")
	if err := os.Symlink(f.disks[0], link); err != nil {
		t.Fatal(err)
	}
	before := read(t, f.disks[0])
	for name, tc := range map[string]struct {
		disks []string
		field string
		says  string
	}{
		"outside":              {[]string{f.disks[0], f.stray}, "payload.disks", "is not a disk of this machine's inventory"},
		"through ..":           {[]string{filepath.Join(f.dir, "work", "..", "stray")}, "payload.disks", "inventory"},
		"relative":             {[]string{"nvme0n1"}, "payload.disks", "absolute"},
		"twice through a link": {[]string{f.disks[0], link}, "payload.disks", "named twice"},
		"none":                 {nil, "payload.disks", "want 1 to 64"},
	} {
		_, err := f.r.WipeDisks(t.Context(), &agentv1.DiskWipe{Disks: tc.disks, Method: agentv1.WipeMethod_WIPE_METHOD_ZERO})
		wantField(t, err, tc.field)
		if !strings.Contains(err.Error(), tc.says) {
			t.Errorf("%s: %v, want it to say %q", name, err, tc.says)
		}
	}
	_, err := f.r.WipeDisks(t.Context(), &agentv1.DiskWipe{Disks: f.disks})
	wantField(t, err, "payload.method")
	if !bytes.Equal(read(t, f.disks[0]), before) {
		t.Fatal("a refused wipe touched a disk")
	}
	// A link into the inventory names the disk it points to.
	res, err := f.r.WipeDisks(t.Context(), &agentv1.DiskWipe{Disks: []string{link}, Method: agentv1.WipeMethod_WIPE_METHOD_ZERO})
	if err != nil || res.GetDisks()[0].GetPath() != link || !allZero(read(t, f.disks[0])) {
		t.Fatalf("wipe through a link: %v %v", res, err)
	}
}

func TestWipeStopsWithTheContext(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	res, err := f.r.WipeDisks(ctx, &agentv1.DiskWipe{Disks: f.disks, Method: agentv1.WipeMethod_WIPE_METHOD_ZERO})
	if !errors.Is(err, context.Canceled) || len(res.GetDisks()) != 0 {
		t.Fatalf("cancelled wipe: %v %v", res, err)
	}
}

// image serves a deterministic image of n bytes; cut, when > 0, aborts the
// connection after that many bytes (Content-Length still says n).
type image struct {
	n, cut int64
	sum    string
}

func newImage(n int64) *image {
	h := sha256.New()
	_, _ = io.Copy(h, imageReader(n))
	return &image{n: n, sum: hex.EncodeToString(h.Sum(nil))}
}

// imageReader yields n pseudo-random bytes without holding them.
func imageReader(n int64) io.Reader {
	return io.LimitReader(&pattern{}, n)
}

type pattern struct{ x uint64 }

func (p *pattern) Read(b []byte) (int, error) {
	for i := range b {
		p.x = p.x*6364136223846793005 + 1442695040888963407
		b[i] = byte(p.x >> 56)
	}
	return len(b), nil
}

func (im *image) ServeHTTP(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Content-Length", strconv.FormatInt(im.n, 10))
	if im.cut > 0 {
		_, _ = io.Copy(w, imageReader(im.cut))
		w.(http.Flusher).Flush()
		panic(http.ErrAbortHandler)
	}
	_, _ = io.Copy(w, imageReader(im.n))
}

func serve(t *testing.T, h http.Handler) string {
	t.Helper()
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return srv.URL + "/image.raw"
}

func TestDeploy(t *testing.T) {
	t.Parallel()

	t.Run("good image: written and hashed", func(t *testing.T) {
		t.Parallel()
		f := setup(t)
		im := newImage(2<<20 + 777)
		res, err := f.r.DeployImage(t.Context(), &agentv1.ImageDeploy{Url: serve(t, im), Sha256: im.sum, Disk: f.disks[1], SizeBytes: uint64(im.n)})
		if err != nil {
			t.Fatal(err)
		}
		if res.GetDisk() != f.disks[1] || res.GetSha256() != im.sum || res.GetBytes() != uint64(im.n) {
			t.Fatalf("result %v", res)
		}
		want, _ := io.ReadAll(imageReader(im.n))
		if got := read(t, f.disks[1]); len(got) != diskSize || !bytes.Equal(got[:im.n], want) {
			t.Fatal("the disk does not hold the image")
		}
	})

	t.Run("bad hash fails, says so and clears the image", func(t *testing.T) {
		t.Parallel()
		f := setup(t)
		im := newImage(2 << 20)
		wrong := strings.Repeat("ab", 32)
		res, err := f.r.DeployImage(t.Context(), &agentv1.ImageDeploy{Url: serve(t, im), Sha256: wrong, Disk: f.disks[0]})
		if err == nil || !strings.Contains(err.Error(), "sha256 mismatch") || !strings.Contains(err.Error(), im.sum) || !strings.Contains(err.Error(), wrong) {
			t.Fatalf("bad hash: %v", err)
		}
		if res.GetSha256() != im.sum || res.GetBytes() != uint64(im.n) {
			t.Fatalf("result with the mismatch %v", res)
		}
		if !allZero(read(t, f.disks[0])[:1<<20]) {
			t.Fatal("the unverified image's first MiB is still on the disk")
		}
	})

	t.Run("server cut mid-stream fails", func(t *testing.T) {
		t.Parallel()
		f := setup(t)
		im := newImage(3 << 20)
		good := im.sum
		im.cut = 1<<20 + 5000
		_, err := f.r.DeployImage(t.Context(), &agentv1.ImageDeploy{Url: serve(t, im), Sha256: good, Disk: f.disks[0]})
		if err == nil || !strings.Contains(err.Error(), "cut after") {
			t.Fatalf("cut download: %v", err)
		}
		if !allZero(read(t, f.disks[0])[:1<<20]) {
			t.Fatal("the partial image's first MiB is still on the disk")
		}
	})

	t.Run("refused before fetching", func(t *testing.T) {
		t.Parallel()
		f := setup(t)
		var hits sync.Map
		h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { hits.Store(r.URL.Path, true) })
		url := serve(t, h)
		im := newImage(1 << 10)
		for field, p := range map[string]*agentv1.ImageDeploy{
			"payload.disk":      {Url: url, Sha256: im.sum, Disk: f.stray},
			"payload.sha256":    {Url: url, Sha256: "nope", Disk: f.disks[0]},
			"payload.url":       {Url: "file:///etc/passwd", Sha256: im.sum, Disk: f.disks[0]},
			"payload.sizeBytes": {Url: url, Sha256: im.sum, Disk: f.disks[0], SizeBytes: diskSize + 1},
			"payload.format":    {Url: url, Sha256: im.sum, Disk: f.disks[0], Format: 9},
		} {
			_, err := f.r.DeployImage(t.Context(), p)
			wantField(t, err, field)
		}
		hits.Range(func(k, _ any) bool { t.Errorf("fetched %v for a refused deploy", k); return true })
	})

	t.Run("larger than the disk fails", func(t *testing.T) {
		t.Parallel()
		f := setup(t)
		im := newImage(diskSize + 1)
		// Without a Content-Length the copy finds out.
		h := http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			w.(http.Flusher).Flush()
			_, _ = io.Copy(w, imageReader(im.n))
		})
		_, err := f.r.DeployImage(t.Context(), &agentv1.ImageDeploy{Url: serve(t, h), Sha256: im.sum, Disk: f.disks[0]})
		if err == nil || !strings.Contains(err.Error(), "larger than disk") {
			t.Fatalf("oversized image: %v", err)
		}
		if got := read(t, f.disks[0]); len(got) != diskSize {
			t.Fatalf("the disk file grew to %d bytes", len(got))
		}
	})
}

// TestDeployStreams deploys a 64 MiB image and checks the process
// allocated far less than the image: it is streamed, not buffered.
func TestDeployStreams(t *testing.T) {
	f := setup(t)
	const n = 64 << 20
	big := filepath.Join(f.dir, "big")
	if err := os.WriteFile(big, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(big, n); err != nil {
		t.Fatal(err)
	}
	r, err := ramdisk.New(ramdisk.Config{Disks: []string{big}, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	im := newImage(n)
	url := serve(t, im)
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	if _, err := r.DeployImage(t.Context(), &agentv1.ImageDeploy{Url: url, Sha256: im.sum, Disk: big}); err != nil {
		t.Fatal(err)
	}
	runtime.ReadMemStats(&after)
	if alloc := after.TotalAlloc - before.TotalAlloc; alloc > n/4 {
		t.Fatalf("deploying %d bytes allocated %d", n, alloc)
	}
}

// recorder is a Kexecer that records what it was asked.
type recorder struct {
	mu                      sync.Mutex
	kernel, initrd, cmdline []byte
	loads, execs            int
}

func (k *recorder) Load(_ context.Context, kernel, initrd, cmdline string) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.loads++
	k.kernel, _ = os.ReadFile(kernel)
	if initrd != "" {
		k.initrd, _ = os.ReadFile(initrd)
	}
	k.cmdline = []byte(cmdline)
	return nil
}

func (k *recorder) Exec(context.Context) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.execs++
	return nil
}

func TestKexec(t *testing.T) {
	t.Parallel()
	kernel, initrd := []byte("a kernel"), []byte("an initrd")
	sum := func(b []byte) string { s := sha256.Sum256(b); return hex.EncodeToString(s[:]) }
	mux := http.NewServeMux()
	mux.HandleFunc("/vmlinuz", func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write(kernel) })
	mux.HandleFunc("/initrd", func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write(initrd) })
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)

	t.Run("loads the checked files, then execs", func(t *testing.T) {
		t.Parallel()
		f := setup(t)
		if err := f.r.ExecKexec(t.Context()); err == nil {
			t.Fatal("exec with nothing loaded")
		}
		p := &agentv1.NodeKexec{KernelUrl: srv.URL + "/vmlinuz", KernelSha256: sum(kernel), InitrdUrl: srv.URL + "/initrd", InitrdSha256: sum(initrd), Cmdline: "console=ttyS0 bc.join=1"}
		if err := f.r.LoadKexec(t.Context(), p); err != nil {
			t.Fatal(err)
		}
		if err := f.r.ExecKexec(t.Context()); err != nil {
			t.Fatal(err)
		}
		k := f.kexec
		if k.loads != 1 || k.execs != 1 || !bytes.Equal(k.kernel, kernel) || !bytes.Equal(k.initrd, initrd) || string(k.cmdline) != p.GetCmdline() {
			t.Fatalf("recorded %d loads %d execs kernel %q initrd %q cmdline %q", k.loads, k.execs, k.kernel, k.initrd, k.cmdline)
		}
	})

	t.Run("a bad hash loads nothing", func(t *testing.T) {
		t.Parallel()
		f := setup(t)
		err := f.r.LoadKexec(t.Context(), &agentv1.NodeKexec{KernelUrl: srv.URL + "/vmlinuz", KernelSha256: sum(kernel), InitrdUrl: srv.URL + "/initrd", InitrdSha256: sum(kernel)})
		if err == nil || !strings.Contains(err.Error(), "payload.initrdSha256: sha256 mismatch") {
			t.Fatalf("bad initrd hash: %v", err)
		}
		if f.kexec.loads != 0 {
			t.Fatal("loaded a kernel with a bad initrd")
		}
		if _, err := os.Stat(filepath.Join(f.dir, "work", "kexec-initrd")); !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("the bad initrd was kept: %v", err)
		}
		wantField(t, f.r.LoadKexec(t.Context(), &agentv1.NodeKexec{KernelUrl: srv.URL + "/vmlinuz"}), "payload.kernelSha256")
	})
}

func TestCheckDisks(t *testing.T) {
	t.Parallel()
	f := setup(t)
	gone := filepath.Join(f.dir, "gone")
	r, err := ramdisk.New(ramdisk.Config{Disks: append(f.disks, gone), Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	checks, err := r.CheckDisks(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if len(checks) != 3 {
		t.Fatalf("checks %v", checks)
	}
	for _, c := range checks[:2] {
		if !c.GetHealthy() || c.GetSizeBytes() != diskSize || c.GetSampledBytes() != diskSize {
			t.Errorf("check %v", c)
		}
	}
	if c := checks[2]; c.GetHealthy() || c.GetPath() != gone || !strings.Contains(c.GetReason(), "no such file") {
		t.Errorf("a missing disk: %v", c)
	}
}

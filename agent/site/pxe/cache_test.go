package pxe

import (
	"context"
	"errors"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
)

func newTestCache(t *testing.T, maxBytes int64) (*Cache, string) {
	t.Helper()
	dir := t.TempDir()
	c, err := NewCache(CacheConfig{Dir: dir, MaxBytes: maxBytes, Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	return c, dir
}

func dirEntries(t *testing.T, dir string) []string {
	t.Helper()
	var names []string
	for _, sub := range []string{"sha256", "tmp"} {
		des, err := os.ReadDir(filepath.Join(dir, sub))
		if err != nil {
			t.Fatal(err)
		}
		for _, de := range des {
			names = append(names, sub+"/"+de.Name())
		}
	}
	return names
}

func TestImageCache(t *testing.T) {
	t.Parallel()

	t.Run("mismatch is rejected and nothing is kept", func(t *testing.T) {
		t.Parallel()
		h := setup(t)
		bad := h.up.add("/tampered", []byte("evil bytes"), []byte("the real image"))
		if err := h.srv.cache.Register(bad); err != nil {
			t.Fatal(err)
		}
		code, body, _ := get(t, h.base+"/images/sha256/"+bad.SHA256)
		if code != http.StatusBadGateway || strings.Contains(body, "evil") {
			t.Fatalf("status %d body %q, want 502 without the bytes", code, body)
		}
		if got := dirEntries(t, h.cacheDir); len(got) != 0 {
			t.Errorf("cache keeps %v after a mismatch", got)
		}
		err := h.srv.Prefetch(context.Background(), bad)
		if !errors.Is(err, ErrDigestMismatch) {
			t.Errorf("Prefetch = %v, want ErrDigestMismatch", err)
		}
		if h.srv.cache.Has(bad.SHA256) || h.srv.cache.Size() != 0 {
			t.Error("mismatched image is in the index")
		}
	})
	t.Run("verified image is served, with Range", func(t *testing.T) {
		t.Parallel()
		h := setup(t)
		if err := h.srv.Prefetch(context.Background(), h.kernel); err != nil {
			t.Fatal(err)
		}
		url := h.base + "/images/sha256/" + h.kernel.SHA256
		code, body, hdr := get(t, url, "Range", "bytes=7-11")
		if code != http.StatusPartialContent || body != string(h.kernelB[7:12]) {
			t.Fatalf("range: %d %q, want 206 %q", code, body, h.kernelB[7:12])
		}
		if want := "bytes 7-11/" + strconv.Itoa(len(h.kernelB)); hdr.Get("Content-Range") != want {
			t.Errorf("Content-Range = %q, want %q", hdr.Get("Content-Range"), want)
		}
		code, _, _ = get(t, url, "If-None-Match", `"sha256:`+h.kernel.SHA256+`"`)
		if code != http.StatusNotModified {
			t.Errorf("If-None-Match: %d, want 304", code)
		}
		if n := h.up.count("/vmlinuz"); n != 1 {
			t.Errorf("upstream fetched %d times, want 1", n)
		}
		got, err := os.ReadFile(filepath.Join(h.cacheDir, "sha256", h.kernel.SHA256))
		if err != nil || string(got) != string(h.kernelB) {
			t.Errorf("stored file: %v", err)
		}
	})
	t.Run("concurrent first requests fetch once", func(t *testing.T) {
		t.Parallel()
		h := setup(t)
		gate := make(chan struct{})
		h.up.mu.Lock()
		h.up.gate = gate
		h.up.mu.Unlock()
		if err := h.srv.cache.Register(h.kernel); err != nil {
			t.Fatal(err)
		}
		const n = 16
		var wg sync.WaitGroup
		var started sync.WaitGroup
		started.Add(n)
		codes := make([]int, n)
		bodies := make([]string, n)
		for i := range n {
			wg.Add(1)
			go func() {
				defer wg.Done()
				started.Done()
				resp, err := http.Get(h.base + "/images/sha256/" + h.kernel.SHA256)
				if err != nil {
					t.Error(err)
					return
				}
				defer resp.Body.Close()
				b := new(strings.Builder)
				_, _ = io.Copy(b, resp.Body)
				codes[i], bodies[i] = resp.StatusCode, b.String()
			}()
		}
		started.Wait()
		close(gate)
		wg.Wait()
		for i := range n {
			if codes[i] != http.StatusOK || bodies[i] != string(h.kernelB) {
				t.Errorf("request %d: %d, %d bytes", i, codes[i], len(bodies[i]))
			}
		}
		if got := h.up.count("/vmlinuz"); got != 1 {
			t.Errorf("upstream fetched %d times, want 1", got)
		}
	})
	t.Run("unknown and malformed digests", func(t *testing.T) {
		t.Parallel()
		h := setup(t)
		if code, _, _ := get(t, h.base+"/images/sha256/"+strings.Repeat("0", 64)); code != http.StatusNotFound {
			t.Errorf("unknown: %d, want 404", code)
		}
		for _, d := range []string{"abc", strings.Repeat("G", 64), strings.Repeat("A", 64), "..%2f..%2fetc%2fpasswd"} {
			if code, _, _ := get(t, h.base+"/images/sha256/"+d); code != http.StatusBadRequest && code != http.StatusNotFound {
				t.Errorf("%s: %d, want 400", d, code)
			}
		}
	})
	t.Run("LRU eviction keeps the total bounded", func(t *testing.T) {
		t.Parallel()
		up := newUpstream(t)
		c, dir := newTestCache(t, 10)
		a := up.add("/a", []byte("aaaa"), []byte("aaaa"))
		b := up.add("/b", []byte("bbbb"), []byte("bbbb"))
		cc := up.add("/c", []byte("cccc"), []byte("cccc"))
		ctx := context.Background()
		for _, img := range []Image{a, b} {
			if err := c.Prefetch(ctx, img); err != nil {
				t.Fatal(err)
			}
		}
		f, _, err := c.Open(ctx, a.SHA256) // a is now the most recent
		if err != nil {
			t.Fatal(err)
		}
		f.Close()
		if err := c.Prefetch(ctx, cc); err != nil {
			t.Fatal(err)
		}
		if !c.Has(a.SHA256) || c.Has(b.SHA256) || !c.Has(cc.SHA256) {
			t.Errorf("has a=%v b=%v c=%v, want b evicted", c.Has(a.SHA256), c.Has(b.SHA256), c.Has(cc.SHA256))
		}
		if c.Size() != 8 || len(dirEntries(t, dir)) != 2 {
			t.Errorf("size %d, files %v", c.Size(), dirEntries(t, dir))
		}
		big := up.add("/big", []byte("0123456789abc"), []byte("0123456789abc"))
		if err := c.Prefetch(ctx, big); !errors.Is(err, ErrImageTooLarge) {
			t.Errorf("oversized image: %v, want ErrImageTooLarge", err)
		}
		// Evicted images come back from upstream on the next request.
		if err := c.Prefetch(ctx, b); err != nil || up.count("/b") != 2 {
			t.Errorf("refetch b: %v, %d fetches", err, up.count("/b"))
		}
	})
	t.Run("a reopened cache keeps its images", func(t *testing.T) {
		t.Parallel()
		up := newUpstream(t)
		dir := t.TempDir()
		c, err := NewCache(CacheConfig{Dir: dir, Logger: quietLogger()})
		if err != nil {
			t.Fatal(err)
		}
		img := up.add("/k", []byte("kernel"), []byte("kernel"))
		if err := c.Prefetch(context.Background(), img); err != nil {
			t.Fatal(err)
		}
		c.Close()
		// A partial download left behind is cleared.
		if err := os.WriteFile(filepath.Join(dir, "tmp", "partial"), []byte("x"), 0o644); err != nil {
			t.Fatal(err)
		}
		c2, err := NewCache(CacheConfig{Dir: dir, Logger: quietLogger()})
		if err != nil {
			t.Fatal(err)
		}
		defer c2.Close()
		f, _, err := c2.Open(context.Background(), img.SHA256) // no source registered: must come from disk
		if err != nil {
			t.Fatal(err)
		}
		f.Close()
		if got := dirEntries(t, dir); len(got) != 1 {
			t.Errorf("files %v", got)
		}
	})
}

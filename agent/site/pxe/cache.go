package pxe

import (
	"cmp"
	"container/list"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"sync"
	"time"
)

// Cache errors.
var (
	// ErrUnknownImage: no upstream URL was registered for the digest.
	ErrUnknownImage = errors.New("unknown image")
	// ErrDigestMismatch: the upstream sent bytes whose SHA-256 is not the
	// one asked for; nothing was kept.
	ErrDigestMismatch = errors.New("sha256 mismatch")
	// ErrImageTooLarge: the image alone exceeds the cache's size.
	ErrImageTooLarge = errors.New("image larger than the cache")
)

// MaxSources bounds the digests whose upstream URL the cache remembers.
const MaxSources = 10_000

// CacheConfig configures a Cache.
type CacheConfig struct {
	// Dir holds the cache: Dir/sha256/<hex> and Dir/tmp. Required.
	Dir string
	// MaxBytes bounds the stored images; least recently used ones are
	// evicted to make room. Zero: 32 GiB.
	MaxBytes int64
	// Client fetches from upstream. Nil: a client with a 30 s response
	// header timeout.
	Client *http.Client
	// FetchTimeout bounds one upstream fetch. Zero: 30 minutes.
	FetchTimeout time.Duration
	// Logger; nil: slog.Default().
	Logger *slog.Logger
}

// Cache is a content-addressed image cache on local disk. A digest is
// fetched from its registered upstream URL on first use (concurrent first
// uses share one fetch), verified before anything is served or kept, and
// evicted least-recently-used when the cache is full.
type Cache struct {
	dir, tmp     string
	max          int64
	client       *http.Client
	fetchTimeout time.Duration
	log          *slog.Logger

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu      sync.Mutex
	sources map[string]string // digest → upstream URL
	entries map[string]*list.Element
	lru     *list.List // of *cacheEntry, front = most recent
	total   int64
	flights map[string]*flight
	closed  bool
}

type cacheEntry struct {
	digest string
	size   int64
}

type flight struct {
	done chan struct{}
	err  error
}

// NewCache opens (or creates) the cache under cfg.Dir, keeping the images
// already there (they were verified before they were stored) and removing
// partial downloads.
func NewCache(cfg CacheConfig) (*Cache, error) {
	if cfg.Dir == "" {
		return nil, errors.New("cache dir: required")
	}
	c := &Cache{
		dir:          filepath.Join(cfg.Dir, "sha256"),
		tmp:          filepath.Join(cfg.Dir, "tmp"),
		max:          cmp.Or(cfg.MaxBytes, 32<<30),
		client:       cfg.Client,
		fetchTimeout: cmp.Or(cfg.FetchTimeout, 30*time.Minute),
		log:          cmp.Or(cfg.Logger, slog.Default()),
		sources:      make(map[string]string),
		entries:      make(map[string]*list.Element),
		lru:          list.New(),
		flights:      make(map[string]*flight),
	}
	if c.max < 0 {
		return nil, fmt.Errorf("cache max bytes: %d is negative", c.max)
	}
	if c.client == nil {
		c.client = &http.Client{Transport: &http.Transport{
			Proxy:                 http.ProxyFromEnvironment,
			ResponseHeaderTimeout: 30 * time.Second,
			TLSHandshakeTimeout:   10 * time.Second,
			IdleConnTimeout:       90 * time.Second,
		}}
	}
	if err := os.RemoveAll(c.tmp); err != nil {
		return nil, fmt.Errorf("clear cache tmp: %w", err)
	}
	for _, d := range []string{c.dir, c.tmp} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return nil, fmt.Errorf("cache dir: %w", err)
		}
	}
	des, err := os.ReadDir(c.dir)
	if err != nil {
		return nil, fmt.Errorf("read cache: %w", err)
	}
	type found struct {
		e   cacheEntry
		mod time.Time
	}
	var have []found
	for _, de := range des {
		fi, err := de.Info()
		if err != nil || !fi.Mode().IsRegular() || !validDigest(de.Name()) {
			continue
		}
		have = append(have, found{cacheEntry{de.Name(), fi.Size()}, fi.ModTime()})
	}
	sort.Slice(have, func(i, j int) bool { return have[i].mod.After(have[j].mod) })
	for _, f := range have {
		e := f.e
		c.entries[e.digest] = c.lru.PushBack(&e)
		c.total += e.size
	}
	c.evictLocked(0)
	c.ctx, c.cancel = context.WithCancel(context.Background())
	return c, nil
}

// Register remembers img's upstream URL so a later request for its digest
// can be fetched.
func (c *Cache) Register(img Image) error {
	if err := img.Validate(); err != nil {
		return err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if _, ok := c.sources[img.SHA256]; !ok && len(c.sources) >= MaxSources {
		// Forget an arbitrary source of an image already cached or not.
		for d := range c.sources {
			delete(c.sources, d)
			break
		}
	}
	c.sources[img.SHA256] = img.URL
	return nil
}

// Prefetch registers img and waits until it is cached (fetching it now if
// it is not).
func (c *Cache) Prefetch(ctx context.Context, img Image) error {
	if err := c.Register(img); err != nil {
		return err
	}
	f, _, err := c.Open(ctx, img.SHA256)
	if err != nil {
		return err
	}
	return f.Close()
}

// Has reports whether digest is stored.
func (c *Cache) Has(digest string) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	_, ok := c.entries[digest]
	return ok
}

// Size is the bytes stored.
func (c *Cache) Size() int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.total
}

// Open returns the verified image with digest, fetching it first if it is
// not stored. ctx bounds only this caller's wait: the fetch itself runs on
// for other waiters until the cache's fetch timeout or Close.
func (c *Cache) Open(ctx context.Context, digest string) (*os.File, os.FileInfo, error) {
	if !validDigest(digest) {
		return nil, nil, fmt.Errorf("sha256: %q is not 64 lowercase hex digits", digest)
	}
	for range 3 {
		c.mu.Lock()
		if el, ok := c.entries[digest]; ok {
			c.lru.MoveToFront(el)
			// Opened under the lock so eviction cannot unlink it first; an
			// open file stays readable after a later eviction.
			f, err := os.Open(filepath.Join(c.dir, digest))
			c.mu.Unlock()
			if err != nil {
				return nil, nil, fmt.Errorf("open cached %s: %w", digest, err)
			}
			fi, err := f.Stat()
			if err != nil {
				f.Close()
				return nil, nil, err
			}
			return f, fi, nil
		}
		fl, err := c.startLocked(digest)
		if err != nil {
			c.mu.Unlock()
			return nil, nil, err
		}
		c.mu.Unlock()
		select {
		case <-fl.done:
			if fl.err != nil {
				return nil, nil, fl.err
			}
		case <-ctx.Done():
			return nil, nil, ctx.Err()
		}
	}
	return nil, nil, fmt.Errorf("%s: evicted as soon as fetched", digest)
}

// startLocked returns digest's fetch in flight, starting one if needed.
func (c *Cache) startLocked(digest string) (*flight, error) {
	if fl, ok := c.flights[digest]; ok {
		return fl, nil
	}
	src, ok := c.sources[digest]
	if !ok {
		return nil, fmt.Errorf("%s: %w", digest, ErrUnknownImage)
	}
	if c.closed {
		return nil, errors.New("image cache closed")
	}
	fl := &flight{done: make(chan struct{})}
	c.flights[digest] = fl
	c.wg.Add(1)
	go c.fetch(digest, src, fl)
	return fl, nil
}

// Warm registers img and starts fetching it in the background unless it
// is stored or already being fetched.
func (c *Cache) Warm(img Image) error {
	if err := c.Register(img); err != nil {
		return err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if _, ok := c.entries[img.SHA256]; ok {
		return nil
	}
	_, err := c.startLocked(img.SHA256)
	return err
}

// fetch downloads digest from src into a temporary file, hashing as it
// goes, and moves it into the cache only if the digest matches.
func (c *Cache) fetch(digest, src string, fl *flight) {
	defer c.wg.Done()
	start := time.Now()
	size, err := c.download(digest, src)
	c.mu.Lock()
	delete(c.flights, digest)
	c.mu.Unlock()
	fl.err = err
	close(fl.done)
	if err != nil {
		c.log.Warn("image cache: fetch failed", "sha256", digest, "url", src, "error", err)
		return
	}
	c.log.Info("image cache: fetched", "sha256", digest, "bytes", size, "took", time.Since(start))
}

func (c *Cache) download(digest, src string) (int64, error) {
	ctx, cancel := context.WithTimeout(c.ctx, c.fetchTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, src, nil)
	if err != nil {
		return 0, fmt.Errorf("fetch %s: %w", digest, err)
	}
	resp, err := c.client.Do(req)
	if err != nil {
		return 0, fmt.Errorf("fetch %s: %w", digest, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return 0, fmt.Errorf("fetch %s: upstream status %s", digest, resp.Status)
	}
	if resp.ContentLength > c.max {
		return 0, fmt.Errorf("fetch %s: %d bytes: %w", digest, resp.ContentLength, ErrImageTooLarge)
	}
	tmp, err := os.CreateTemp(c.tmp, digest+".*")
	if err != nil {
		return 0, fmt.Errorf("fetch %s: %w", digest, err)
	}
	keep := false
	defer func() {
		if !keep {
			tmp.Close()
			os.Remove(tmp.Name())
		}
	}()
	h := sha256.New()
	n, err := io.Copy(io.MultiWriter(tmp, h), io.LimitReader(resp.Body, c.max+1))
	if err != nil {
		return 0, fmt.Errorf("fetch %s: %w", digest, err)
	}
	if n > c.max {
		return 0, fmt.Errorf("fetch %s: %w", digest, ErrImageTooLarge)
	}
	if got := hex.EncodeToString(h.Sum(nil)); got != digest {
		return 0, fmt.Errorf("fetch %s: got %s: %w", digest, got, ErrDigestMismatch)
	}
	if err := tmp.Sync(); err != nil {
		return 0, fmt.Errorf("fetch %s: %w", digest, err)
	}
	if err := tmp.Close(); err != nil {
		return 0, fmt.Errorf("fetch %s: %w", digest, err)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.evictLocked(n)
	if err := os.Rename(tmp.Name(), filepath.Join(c.dir, digest)); err != nil {
		return 0, fmt.Errorf("fetch %s: %w", digest, err)
	}
	keep = true
	e := &cacheEntry{digest, n}
	c.entries[digest] = c.lru.PushFront(e)
	c.total += n
	return n, nil
}

// evictLocked removes least recently used images until n more bytes fit.
func (c *Cache) evictLocked(n int64) {
	for c.total+n > c.max && c.lru.Len() > 0 {
		el := c.lru.Back()
		e := el.Value.(*cacheEntry)
		c.lru.Remove(el)
		delete(c.entries, e.digest)
		c.total -= e.size
		if err := os.Remove(filepath.Join(c.dir, e.digest)); err != nil && !errors.Is(err, os.ErrNotExist) {
			c.log.Warn("image cache: evict", "sha256", e.digest, "error", err)
		}
		c.log.Info("image cache: evicted", "sha256", e.digest, "bytes", e.size)
	}
}

// Close cancels fetches in flight and waits for them.
func (c *Cache) Close() {
	c.mu.Lock()
	c.closed = true
	c.mu.Unlock()
	c.cancel()
	c.wg.Wait()
}

// ServeHTTP serves GET /images/sha256/{hex} with Range support.
func (c *Cache) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	digest := r.PathValue("hex")
	if !validDigest(digest) {
		http.Error(w, "want /images/sha256/<64 lowercase hex digits>", http.StatusBadRequest)
		return
	}
	f, fi, err := c.Open(r.Context(), digest)
	switch {
	case errors.Is(err, ErrUnknownImage):
		http.Error(w, "unknown image", http.StatusNotFound)
		return
	case err != nil:
		c.log.WarnContext(r.Context(), "image cache: serve", "sha256", digest, "error", err)
		http.Error(w, "image unavailable", http.StatusBadGateway)
		return
	}
	defer f.Close()
	w.Header().Set("Content-Type", "application/octet-stream")
	w.Header().Set("ETag", `"sha256:`+digest+`"`)
	w.Header().Set("Cache-Control", "public, max-age=31536000, immutable")
	http.ServeContent(w, r, "", fi.ModTime(), f)
}

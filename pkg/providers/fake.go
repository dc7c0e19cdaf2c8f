package providers

import (
	"crypto/sha256"
	"crypto/subtle"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"
)

// FakeConfig configures a [Fake].
type FakeConfig struct {
	// Token is the bearer token the fake accepts. Required.
	Token string
	// ProvisionDelay is how long a created machine stays pending, and a
	// started or stopped one starting or stopping, before it is running or
	// stopped; 0 is at once.
	ProvisionDelay time.Duration
	// Now is the clock; nil is time.Now.
	Now func() time.Time
}

// Fake is the provider JSON API of [Client], in memory: an http.Handler to
// serve with httptest.NewServer (tests) or any listener (`make run`).
// Machines are kept until deleted; a create's Idempotency-Key (required)
// answers the same machine for the same key — 409 for the same key with a
// different body — and is kept after the machine is deleted, as a
// provider's idempotency records are.
type Fake struct {
	cfg FakeConfig

	mu       sync.Mutex
	machines map[string]*FakeMachine
	keys     map[string]fakeKey
	next     int
	calls    []Call
	failNext []fakeFault
	drops    int
}

// FakeMachine is a machine at the fake.
type FakeMachine struct {
	ID             string
	IdempotencyKey string
	Request        CreateRequest
	// State is the state reached or being reached: pending, starting and
	// stopping become running or stopped at Until.
	State   string
	Until   time.Time
	Deleted bool
}

type fakeKey struct {
	id   string
	hash [32]byte
}

type fakeFault struct {
	status     int
	retryAfter int
}

// Call is one request the fake received.
type Call struct {
	Method, Path, IdempotencyKey string
	// Status is what was answered; 0 when the connection was dropped.
	Status int
	// Authorized says the bearer token matched.
	Authorized bool
}

// NewFake returns a fake provider.
func NewFake(cfg FakeConfig) *Fake {
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	return &Fake{cfg: cfg, machines: map[string]*FakeMachine{}, keys: map[string]fakeKey{}}
}

// FailNext makes the next n requests answer status (429 and 503 carry
// Retry-After: retryAfter seconds when it is above 0) without doing
// anything.
func (f *Fake) FailNext(n, status, retryAfter int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for range n {
		f.failNext = append(f.failNext, fakeFault{status: status, retryAfter: retryAfter})
	}
}

// DropAfterCreate makes the next n creates make (or find) their machine
// and then close the connection without an answer: the caller cannot know
// the machine exists — the crash between the provider call and our write.
func (f *Fake) DropAfterCreate(n int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.drops += n
}

// Calls returns every request so far, in order.
func (f *Fake) Calls() []Call {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]Call(nil), f.calls...)
}

// Machines returns every machine ever made (deleted ones too), by id.
func (f *Fake) Machines() []FakeMachine {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := make([]FakeMachine, 0, len(f.machines))
	for _, m := range f.machines {
		f.settle(m)
		out = append(out, *m)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out
}

// MachinesFor returns the machines made under idempotency key key (at most
// one, by design).
func (f *Fake) MachinesFor(key string) []FakeMachine {
	var out []FakeMachine
	for _, m := range f.Machines() {
		if m.IdempotencyKey == key {
			out = append(out, m)
		}
	}
	return out
}

// Remove deletes machine id behind the caller's back (a machine deleted in
// the provider's console).
func (f *Fake) Remove(id string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if m, ok := f.machines[id]; ok {
		m.Deleted, m.State = true, StateDeleted
	}
}

// settle moves a machine whose transition is due to its end state.
func (f *Fake) settle(m *FakeMachine) {
	if m.Deleted || f.cfg.Now().Before(m.Until) {
		return
	}
	switch m.State {
	case StatePending, StateStarting:
		m.State = StateRunning
	case StateStopping:
		m.State = StateStopped
	}
}

func (f *Fake) transition(m *FakeMachine, moving, end string) {
	if f.cfg.ProvisionDelay <= 0 {
		m.State = end
		return
	}
	m.State, m.Until = moving, f.cfg.Now().Add(f.cfg.ProvisionDelay)
}

// ServeHTTP serves the provider API.
func (f *Fake) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	f.mu.Lock()
	defer f.mu.Unlock()
	call := Call{Method: r.Method, Path: r.URL.Path, IdempotencyKey: r.Header.Get("Idempotency-Key")}
	tok, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	call.Authorized = ok && f.cfg.Token != "" && subtle.ConstantTimeCompare([]byte(tok), []byte(f.cfg.Token)) == 1
	answer := func(status int, v any) {
		call.Status = status
		f.calls = append(f.calls, call)
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(status)
		if v != nil {
			_ = json.NewEncoder(w).Encode(v)
		}
	}
	fail := func(status int, format string, args ...any) {
		answer(status, map[string]string{"message": fmt.Sprintf(format, args...)})
	}
	if !call.Authorized {
		fail(http.StatusUnauthorized, "bad or missing bearer token")
		return
	}
	if len(f.failNext) > 0 {
		ft := f.failNext[0]
		f.failNext = f.failNext[1:]
		if ft.retryAfter > 0 {
			w.Header().Set("Retry-After", strconv.Itoa(ft.retryAfter))
		}
		fail(ft.status, "injected failure")
		return
	}
	rest, ok := strings.CutPrefix(r.URL.Path, "/v1/machines")
	if !ok {
		fail(http.StatusNotFound, "no such route")
		return
	}
	if rest == "" || rest == "/" {
		if r.Method != http.MethodPost {
			fail(http.StatusMethodNotAllowed, "POST to create")
			return
		}
		f.create(w, r, &call, answer, fail)
		return
	}
	id, action, _ := strings.Cut(strings.TrimPrefix(rest, "/"), "/")
	m, ok := f.machines[id]
	if !ok || m.Deleted {
		fail(http.StatusNotFound, "no machine %q", id)
		return
	}
	f.settle(m)
	switch {
	case r.Method == http.MethodGet && action == "":
		answer(http.StatusOK, Machine{ID: m.ID, State: m.State})
	case r.Method == http.MethodDelete && action == "":
		m.Deleted, m.State = true, StateDeleted
		answer(http.StatusNoContent, nil)
	case r.Method == http.MethodPost && action == "start":
		switch m.State {
		case StateStopped:
			f.transition(m, StateStarting, StateRunning)
		case StateStopping:
			fail(http.StatusConflict, "machine %s is stopping", m.ID)
			return
		}
		answer(http.StatusAccepted, Machine{ID: m.ID, State: m.State})
	case r.Method == http.MethodPost && action == "stop":
		switch m.State {
		case StateRunning:
			f.transition(m, StateStopping, StateStopped)
		case StatePending, StateStarting:
			fail(http.StatusConflict, "machine %s is %s", m.ID, m.State)
			return
		}
		answer(http.StatusAccepted, Machine{ID: m.ID, State: m.State})
	default:
		fail(http.StatusNotFound, "no such route")
	}
}

func (f *Fake) create(w http.ResponseWriter, r *http.Request, call *Call, answer func(int, any), fail func(int, string, ...any)) {
	key := call.IdempotencyKey
	if key == "" || len(key) > 255 {
		fail(http.StatusBadRequest, "Idempotency-Key of 1 to 255 bytes required")
		return
	}
	raw, err := io.ReadAll(io.LimitReader(r.Body, 1<<20))
	var req CreateRequest
	if err != nil || json.Unmarshal(raw, &req) != nil {
		fail(http.StatusBadRequest, "body: not a machine request")
		return
	}
	if req.Image == "" || req.Size.VCPUs < 1 {
		fail(http.StatusUnprocessableEntity, "image and size.vcpus are required")
		return
	}
	hash := sha256.Sum256(raw)
	status := http.StatusCreated
	var m *FakeMachine
	if k, ok := f.keys[key]; ok {
		if k.hash != hash {
			fail(http.StatusConflict, "idempotency key %q was used for a different request", key)
			return
		}
		m, status = f.machines[k.id], http.StatusOK
		f.settle(m)
	} else {
		f.next++
		req.IdempotencyKey = key
		m = &FakeMachine{ID: fmt.Sprintf("m-%04d", f.next), IdempotencyKey: key, Request: req}
		f.transition(m, StatePending, StateRunning)
		f.machines[m.ID] = m
		f.keys[key] = fakeKey{id: m.ID, hash: hash}
	}
	if f.drops > 0 {
		f.drops--
		call.Status = 0
		f.calls = append(f.calls, *call)
		if hj, ok := w.(http.Hijacker); ok {
			if conn, _, err := hj.Hijack(); err == nil {
				_ = conn.Close()
				return
			}
		}
		panic(http.ErrAbortHandler)
	}
	answer(status, Machine{ID: m.ID, State: m.State})
}

// Package engines wires a node's container engines to CDI, as the
// NodeSpec's runtime section asks: each engine named is configured to read
// CDI specs from the section's directories, each engine not named has what
// bcd added removed again. Every path is under a configurable system root
// ("/" on a real node, a temp dir in tests, a simulated node's state
// directory):
//
//	etc/containerd/conf.d/50-bettercompute.toml     containerd: enable_cdi and
//	                                                cdi_spec_dirs in the CRI plugin
//	                                                (read only when config.toml
//	                                                imports it, see below)
//	etc/crio/crio.conf.d/50-bettercompute.conf      CRI-O: [crio.runtime] cdi_spec_dirs
//	etc/docker/daemon.json                          Docker: features.cdi and
//	                                                cdi-spec-dirs merged into the
//	                                                operator's file
//	etc/containers/containers.conf.d/50-bettercompute.conf
//	                                                Podman: [engine] cdi_spec_dirs
//
// The drop-ins are bcd's own files: wanted with exact content, or absent.
// daemon.json is the operator's: bcd merges its two keys in (keeping every
// other key), remembers in a Record what the keys held before, and on
// revert puts that back (removing the file only when bcd created it).
// containerd 1.7 reads a drop-in only when its config.toml names it in a
// top-level imports list; bcd never edits config.toml, it reports
// "not imported" with the line to add instead.
//
// bcd never restarts an engine. Where the engine's command-line tool is
// installed, Check asks the running engine whether it reads the
// directories (docker info, crictl info, crio status config, podman
// version: podman reads cdi_spec_dirs from 5.5 on, older ones only /etc/cdi
// and /var/run/cdi) and the status says loaded, not loaded (restart needed)
// or not checked. Commands run through a Runner, so tests use fake binaries.
package engines

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"time"

	"github.com/bettercompute/bettercompute/proto/runtimespec"
)

// Paths under the root.
const (
	// ContainerdDropIn is containerd's drop-in.
	ContainerdDropIn = "etc/containerd/conf.d/50-bettercompute.toml"
	// ContainerdConf is containerd's main file, whose imports must name
	// the drop-in.
	ContainerdConf = "etc/containerd/config.toml"
	// CRIODropIn is CRI-O's drop-in (crio.conf.d is always read).
	CRIODropIn = "etc/crio/crio.conf.d/50-bettercompute.conf"
	// DockerConf is Docker's daemon.json.
	DockerConf = "etc/docker/daemon.json"
	// PodmanDropIn is Podman's containers.conf drop-in (read by every
	// podman run).
	PodmanDropIn = "etc/containers/containers.conf.d/50-bettercompute.conf"
)

// header starts every drop-in this package writes.
const header = "# Written by bcd from this node's runtime settings; edits are overwritten.\n"

// CheckTimeout bounds one engine command.
const CheckTimeout = 5 * time.Second

// Runner finds and runs the engines' command-line tools.
type Runner interface {
	// LookPath finds a tool by name.
	LookPath(name string) (string, error)
	// Run runs path with args and returns its standard output.
	Run(ctx context.Context, path string, args ...string) ([]byte, error)
}

// Exec runs real binaries: those in Dirs, or on PATH when Dirs is empty.
type Exec struct {
	Dirs []string
}

// LookPath finds name in e.Dirs or on PATH.
func (e Exec) LookPath(name string) (string, error) {
	if len(e.Dirs) == 0 {
		return exec.LookPath(name)
	}
	for _, d := range e.Dirs {
		p := filepath.Join(d, name)
		if fi, err := os.Stat(p); err == nil && !fi.IsDir() && fi.Mode()&0o111 != 0 {
			return p, nil
		}
	}
	return "", fmt.Errorf("%s: %w", name, exec.ErrNotFound)
}

// Run runs path, with CheckTimeout.
func (Exec) Run(ctx context.Context, path string, args ...string) ([]byte, error) {
	ctx, cancel := context.WithTimeout(ctx, CheckTimeout)
	defer cancel()
	var stderr bytes.Buffer
	cmd := exec.CommandContext(ctx, path, args...)
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		if msg := firstLine(stderr.String()); msg != "" {
			return out, fmt.Errorf("%w: %s", err, msg)
		}
		return out, err
	}
	return out, nil
}

// NoCLI finds no tool: every engine is "not checked" (a simulated node).
var NoCLI Runner = noCLI{}

type noCLI struct{}

func (noCLI) LookPath(name string) (string, error) {
	return "", fmt.Errorf("%s: %w", name, exec.ErrNotFound)
}

func (noCLI) Run(context.Context, string, ...string) ([]byte, error) { return nil, exec.ErrNotFound }

// Config says where the engines' files are and how their tools run.
type Config struct {
	// Root is the system root the files are under ("/" on a node).
	Root string
	// Runner runs the engines' tools and nvidia-ctk; nil means NoCLI.
	Runner Runner
	// NvidiaCTK is the nvidia-ctk binary; empty looks it up by name.
	NvidiaCTK string
}

func (c Config) runner() Runner {
	if c.Runner == nil {
		return NoCLI
	}
	return c.Runner
}

// File is one path under the root and what it should hold: Data, or absent
// when Data is nil.
type File struct {
	Path string
	Data []byte
}

// Record is what bcd remembers between passes (the daemon keeps it in its
// state directory): what daemon.json's keys held before bcd set them.
type Record struct {
	Docker *DockerRecord `json:"docker,omitempty"`
}

// DockerRecord is daemon.json before bcd merged its keys in.
type DockerRecord struct {
	// Created: there was no daemon.json.
	Created bool `json:"created,omitempty"`
	// HadFeatures: it had a features object.
	HadFeatures bool `json:"had_features,omitempty"`
	// PriorCDI and PriorDirs are features.cdi and cdi-spec-dirs as they
	// were (absent when nil).
	PriorCDI  json.RawMessage `json:"prior_cdi,omitempty"`
	PriorDirs json.RawMessage `json:"prior_dirs,omitempty"`
	// Dirs is the cdi-spec-dirs bcd last set.
	Dirs json.RawMessage `json:"dirs,omitempty"`
}

// Status is one engine's state, for the section's status reason.
type Status struct {
	Engine string
	// Named: the section names the engine.
	Named bool
	// Config is what was done to its configuration.
	Config string
	// Check is what the running engine says: "loaded", "not loaded: …",
	// "not checked: …"; empty when not named.
	Check string
}

// String is "engine: config (check)".
func (s Status) String() string {
	out := s.Engine + ": " + s.Config
	if s.Check != "" {
		out += " (" + s.Check + ")"
	}
	return out
}

// Result is what Plan wants on disk.
type Result struct {
	// Files are every path the package manages with their wanted content.
	Files []File
	// Record is the record to keep.
	Record Record
	// Engines are the statuses of the engines named, and of those
	// reverted.
	Engines []Status
	// Failure is what stopped an engine being configured (e.g. a
	// daemon.json that is not JSON); its file is left alone.
	Failure string
}

// Plan returns the files for engines (valid, see runtimespec.Validate)
// reading CDI specs from dirs, given the record kept so far; it reads the
// root and, with check, asks each named engine's tool whether it loaded
// the directories.
func Plan(ctx context.Context, cfg Config, engines, dirs []string, rec Record, check bool) (Result, error) {
	var res Result
	res.Record = rec
	read := func(rel string) ([]byte, error) {
		b, err := os.ReadFile(filepath.Join(cfg.Root, rel))
		if errors.Is(err, fs.ErrNotExist) {
			return nil, nil
		}
		return b, err
	}
	for _, e := range runtimespec.Engines {
		named := slices.Contains(engines, e)
		var st Status
		var f File
		var err error
		switch e {
		case runtimespec.Containerd:
			f, st, err = containerd(read, named, dirs)
		case runtimespec.CRIO:
			f, st, err = dropIn(read, e, CRIODropIn, named, "[crio.runtime]\ncdi_spec_dirs = "+tomlList(dirs)+"\n", ", CRI-O reads it at its next restart (bcd does not restart it)")
		case runtimespec.Podman:
			f, st, err = dropIn(read, e, PodmanDropIn, named, "[engine]\ncdi_spec_dirs = "+tomlList(dirs)+"\n", ", podman reads it at every run")
		case runtimespec.Docker:
			f, st, err = docker(read, named, dirs, &res.Record)
			var bad badConfig
			if errors.As(err, &bad) {
				res.Failure = string(bad)
				st = Status{Engine: e, Named: named, Config: "not configured: " + string(bad)}
				res.Engines = append(res.Engines, st)
				continue
			}
		}
		if err != nil {
			return Result{}, err
		}
		res.Files = append(res.Files, f)
		if named && check {
			st.Check = Check(ctx, cfg.runner(), e, dirs)
		}
		if st.Config != "" {
			res.Engines = append(res.Engines, st)
		}
	}
	return res, nil
}

// badConfig is an operator's file bcd cannot merge into.
type badConfig string

func (b badConfig) Error() string { return string(b) }

// dropIn is a drop-in bcd owns: body when named, else absent.
func dropIn(read func(string) ([]byte, error), engine, path string, named bool, body, loads string) (File, Status, error) {
	have, err := read(path)
	if err != nil {
		return File{}, Status{}, err
	}
	st := Status{Engine: engine, Named: named}
	if !named {
		if have != nil {
			st.Config = "reverted: /" + path + " removed"
		}
		return File{Path: path}, st, nil
	}
	data := []byte(header + body)
	switch {
	case bytes.Equal(have, data):
		st.Config = "/" + path + " in place" + loads
	default:
		st.Config = "/" + path + " written" + loads
	}
	return File{Path: path, Data: data}, st, nil
}

// containerd writes its drop-in in the config version of config.toml (2:
// containerd 1.x, the io.containerd.grpc.v1.cri plugin; 3: containerd 2,
// io.containerd.cri.v1.runtime) and says whether config.toml imports it.
func containerd(read func(string) ([]byte, error), named bool, dirs []string) (File, Status, error) {
	conf, err := read(ContainerdConf)
	if err != nil {
		return File{}, Status{}, err
	}
	version, plugin := "2", `plugins."io.containerd.grpc.v1.cri"`
	if v := topLevel(conf, "version"); strings.TrimSpace(v) == "3" {
		version, plugin = "3", `plugins."io.containerd.cri.v1.runtime"`
	}
	body := "version = " + version + "\n\n[" + plugin + "]\n  enable_cdi = true\n  cdi_spec_dirs = " + tomlList(dirs) + "\n"
	loads := ", containerd reads it at its next restart (bcd does not restart it)"
	abs := "/" + ContainerdDropIn
	switch {
	case conf == nil:
		loads = ", not imported: there is no /" + ContainerdConf + `, and containerd reads the drop-in only through imports = ["/etc/containerd/conf.d/*.toml"] in it`
	case !imports(conf, abs):
		loads = ", not imported: add imports = [\"/etc/containerd/conf.d/*.toml\"] at the top of /" + ContainerdConf + " (bcd does not edit it)"
	}
	return dropIn(read, runtimespec.Containerd, ContainerdDropIn, named, body, loads)
}

// imports reports whether config.toml's top-level imports list names
// path (globs and paths relative to /etc/containerd allowed).
func imports(conf []byte, path string) bool {
	for _, i := range tomlStrings(topLevel(conf, "imports")) {
		if !filepath.IsAbs(i) {
			i = filepath.Join("/etc/containerd", i)
		}
		if ok, _ := filepath.Match(i, path); ok || i == path {
			return true
		}
	}
	return false
}

// topLevel returns the value text of key before the first table header
// of a TOML document (an array may span lines), or "".
func topLevel(doc []byte, key string) string {
	lines := strings.Split(string(doc), "\n")
	for i, l := range lines {
		t := strings.TrimSpace(l)
		if strings.HasPrefix(t, "[") {
			return ""
		}
		k, v, ok := strings.Cut(t, "=")
		if !ok || strings.TrimSpace(k) != key {
			continue
		}
		v = strings.TrimSpace(v)
		if strings.HasPrefix(v, "[") {
			for j := i + 1; !strings.Contains(stripComment(v), "]") && j < len(lines); j++ {
				v += " " + strings.TrimSpace(lines[j])
			}
		}
		return stripComment(v)
	}
	return ""
}

// stripComment drops a trailing "# …" outside quotes.
func stripComment(v string) string {
	in := byte(0)
	for i := 0; i < len(v); i++ {
		switch c := v[i]; {
		case in != 0 && c == in:
			in = 0
		case in == 0 && (c == '"' || c == '\''):
			in = c
		case in == 0 && c == '#':
			return strings.TrimSpace(v[:i])
		}
	}
	return v
}

var tomlString = regexp.MustCompile(`"([^"\\]*)"|'([^']*)'`)

// tomlStrings returns the strings of a TOML array of strings.
func tomlStrings(v string) []string {
	var out []string
	for _, m := range tomlString.FindAllStringSubmatch(v, -1) {
		out = append(out, m[1]+m[2])
	}
	return out
}

// tomlList is dirs as a TOML array (runtimespec keeps quotes and
// backslashes out of them).
func tomlList(dirs []string) string {
	q := make([]string, len(dirs))
	for i, d := range dirs {
		q[i] = `"` + d + `"`
	}
	return "[" + strings.Join(q, ", ") + "]"
}

// docker merges features.cdi = true and cdi-spec-dirs into daemon.json,
// keeping the operator's keys, and on revert restores what the record
// says they held.
func docker(read func(string) ([]byte, error), named bool, dirs []string, rec *Record) (File, Status, error) {
	have, err := read(DockerConf)
	if err != nil {
		return File{}, Status{}, err
	}
	st := Status{Engine: runtimespec.Docker, Named: named}
	keep := File{Path: DockerConf, Data: have}
	if !named && rec.Docker == nil {
		return keep, st, nil
	}
	doc := map[string]json.RawMessage{}
	if len(bytes.TrimSpace(have)) > 0 {
		if err := json.Unmarshal(have, &doc); err != nil {
			return File{}, st, badConfig(fmt.Sprintf("/%s is not a JSON object: %v", DockerConf, err))
		}
	}
	var features map[string]json.RawMessage
	if f, ok := doc["features"]; ok {
		if err := json.Unmarshal(f, &features); err != nil {
			return File{}, st, badConfig(fmt.Sprintf("/%s: features is not an object: %v", DockerConf, err))
		}
	}
	ourDirs, _ := json.Marshal(dirs)
	if !named {
		// Revert: put back what the keys held, where they still hold ours.
		r := rec.Docker
		rec.Docker = nil
		if have == nil {
			st.Config = "reverted: /" + DockerConf + " is gone"
			return keep, st, nil
		}
		if jsonEqual(features["cdi"], []byte("true")) {
			setOrDelete(features, "cdi", r.PriorCDI)
		}
		if jsonEqual(doc["cdi-spec-dirs"], r.Dirs) {
			setOrDelete(doc, "cdi-spec-dirs", r.PriorDirs)
		}
		switch {
		case features != nil && (len(features) > 0 || r.HadFeatures):
			doc["features"], _ = json.Marshal(features)
		default:
			delete(doc, "features")
		}
		st.Config = "reverted: features.cdi and cdi-spec-dirs restored in /" + DockerConf + ", dockerd reads it at its next restart (bcd does not restart it)"
		if len(doc) == 0 && r.Created {
			st.Config = "reverted: /" + DockerConf + " removed (bcd had created it), dockerd notices at its next restart (bcd does not restart it)"
			return File{Path: DockerConf}, st, nil
		}
		return File{Path: DockerConf, Data: marshalDoc(doc)}, st, nil
	}
	loads := ", dockerd reads it at its next restart (bcd does not restart it)"
	if jsonEqual(features["cdi"], []byte("true")) && jsonEqual(doc["cdi-spec-dirs"], ourDirs) {
		if rec.Docker == nil {
			// The operator had set them already: nothing to restore.
			rec.Docker = &DockerRecord{HadFeatures: true, PriorCDI: []byte("true"), PriorDirs: ourDirs}
		}
		rec.Docker.Dirs = ourDirs
		st.Config = "features.cdi and cdi-spec-dirs in place in /" + DockerConf + loads
		return keep, st, nil
	}
	if rec.Docker == nil {
		rec.Docker = &DockerRecord{Created: have == nil, HadFeatures: features != nil,
			PriorCDI: features["cdi"], PriorDirs: doc["cdi-spec-dirs"]}
	}
	rec.Docker.Dirs = ourDirs
	if features == nil {
		features = map[string]json.RawMessage{}
	}
	features["cdi"] = []byte("true")
	doc["features"], _ = json.Marshal(features)
	doc["cdi-spec-dirs"] = ourDirs
	st.Config = "features.cdi and cdi-spec-dirs merged into /" + DockerConf + loads
	return File{Path: DockerConf, Data: marshalDoc(doc)}, st, nil
}

func setOrDelete(m map[string]json.RawMessage, k string, v json.RawMessage) {
	if v == nil {
		delete(m, k)
		return
	}
	m[k] = v
}

// jsonEqual compares two JSON values (nil: absent) by meaning.
func jsonEqual(a, b json.RawMessage) bool {
	if a == nil || b == nil {
		return a == nil && b == nil
	}
	var x, y any
	if json.Unmarshal(a, &x) != nil || json.Unmarshal(b, &y) != nil {
		return false
	}
	ja, _ := json.Marshal(x)
	jb, _ := json.Marshal(y)
	return bytes.Equal(ja, jb)
}

// marshalDoc is daemon.json, keys sorted, indented as Docker's docs show.
func marshalDoc(doc map[string]json.RawMessage) []byte {
	b, err := json.MarshalIndent(doc, "", "  ")
	if err != nil {
		panic(err) // every value came from json.Unmarshal or json.Marshal
	}
	return append(b, '\n')
}

// Check asks engine's running instance, through its tool, whether it reads
// CDI specs from dirs: "loaded", "not loaded: …" or "not checked: …".
func Check(ctx context.Context, r Runner, engine string, dirs []string) string {
	tool := map[string]string{runtimespec.Containerd: "crictl", runtimespec.CRIO: "crio", runtimespec.Docker: "docker", runtimespec.Podman: "podman"}[engine]
	p, err := r.LookPath(tool)
	if err != nil {
		return "not checked: " + tool + " not found"
	}
	var out []byte
	switch engine {
	case runtimespec.Docker:
		out, err = r.Run(ctx, p, "info", "--format", "{{json .CDISpecDirs}}")
	case runtimespec.Containerd:
		out, err = r.Run(ctx, p, "--runtime-endpoint", "unix:///run/containerd/containerd.sock", "info")
	case runtimespec.CRIO:
		out, err = r.Run(ctx, p, "status", "config")
	case runtimespec.Podman:
		out, err = r.Run(ctx, p, "version", "--format", "{{.Client.Version}}")
	}
	if err != nil {
		return fmt.Sprintf("not checked: %s: %s", tool, firstLine(err.Error()))
	}
	var have []string
	switch engine {
	case runtimespec.Docker:
		if err := json.Unmarshal(bytes.TrimSpace(out), &have); err != nil {
			return "not checked: docker info: unexpected output " + clip(firstLine(string(out)))
		}
	case runtimespec.Containerd:
		var info struct {
			Config *struct {
				EnableCDI   bool     `json:"enableCDI"`
				CDISpecDirs []string `json:"cdiSpecDirs"`
			} `json:"config"`
		}
		if err := json.Unmarshal(out, &info); err != nil || info.Config == nil {
			return "not checked: crictl info: no CRI config in its output"
		}
		if !info.Config.EnableCDI {
			return "not loaded: containerd runs with enable_cdi = false, restart containerd"
		}
		have = info.Config.CDISpecDirs
	case runtimespec.CRIO:
		var ok bool
		if have, ok = crioDirs(out); !ok {
			return "not checked: crio status config shows no cdi_spec_dirs"
		}
	case runtimespec.Podman:
		// Podman has no daemon: it reads containers.conf.d at every run.
		// It reads [engine] cdi_spec_dirs from 5.5 on (containers/podman
		// #25717); before, only the CDI library's /etc/cdi and /var/run/cdi.
		v := strings.TrimSpace(string(out))
		pv, err := runtimespec.ParseVersion(v)
		switch {
		case err != nil:
			return "not checked: podman version: unexpected output " + clip(firstLine(v))
		case pv.Less(runtimespec.Version{4, 1, 0}):
			return "not loaded: podman " + v + " predates CDI (4.1)"
		case !pv.Less(runtimespec.Version{5, 5, 0}):
			return "loaded: podman " + v + " reads containers.conf.d at every run"
		}
		var unseen []string
		for _, d := range dirs {
			if d != "/etc/cdi" && d != "/var/run/cdi" {
				unseen = append(unseen, d)
			}
		}
		if len(unseen) > 0 {
			return fmt.Sprintf("not loaded: podman %s ignores cdi_spec_dirs (read from 5.5) and reads only /etc/cdi, /var/run/cdi, not %s", v, strings.Join(unseen, ", "))
		}
		return "loaded: podman " + v + " reads /etc/cdi and /var/run/cdi"
	}
	var missing []string
	for _, d := range dirs {
		if !slices.Contains(have, d) {
			missing = append(missing, d)
		}
	}
	if len(missing) > 0 {
		return fmt.Sprintf("not loaded: %s reads CDI specs from [%s], not %s, restart %s",
			engine, strings.Join(have, ", "), strings.Join(missing, ", "), service[engine])
	}
	return "loaded"
}

// crioDirs reads cdi_spec_dirs from CRI-O's configuration as `crio status
// config` prints it (TOML, the key in [crio.runtime]); a key left at its
// default is printed commented out ("# cdi_spec_dirs = [ …"), which is read
// when no uncommented one is there.
func crioDirs(out []byte) ([]string, bool) {
	lines := strings.Split(string(out), "\n")
	for _, commented := range []bool{false, true} {
		for i, l := range lines {
			t := strings.TrimSpace(l)
			switch {
			case commented && !strings.HasPrefix(t, "#"):
				continue
			case commented:
				t = strings.TrimSpace(strings.TrimLeft(t, "#"))
			case strings.HasPrefix(t, "#"):
				continue
			}
			if !strings.HasPrefix(t, "cdi_spec_dirs") {
				continue
			}
			rest := []string{t}
			for _, m := range lines[i+1:] {
				m = strings.TrimSpace(m)
				if commented {
					m = strings.TrimSpace(strings.TrimLeft(m, "#"))
				}
				rest = append(rest, m)
			}
			if v := topLevel([]byte(strings.Join(rest, "\n")), "cdi_spec_dirs"); v != "" {
				return tomlStrings(v), true
			}
		}
	}
	return nil, false
}

// service is each engine's systemd unit.
var service = map[string]string{runtimespec.Containerd: "containerd", runtimespec.CRIO: "crio", runtimespec.Docker: "docker", runtimespec.Podman: "podman"}

// Toolkit checks the NVIDIA Container Toolkit against least (a version
// runtimespec.ParseVersion takes): it returns the installed version ("" when
// nvidia-ctk is absent) and, when it is absent or older than least, why the
// section fails.
func Toolkit(ctx context.Context, cfg Config, least string) (have, failure string) {
	r := cfg.runner()
	p := cfg.NvidiaCTK
	if p == "" {
		var err error
		if p, err = r.LookPath("nvidia-ctk"); err != nil {
			return "", "nvidia-ctk not found (min_container_toolkit_version " + least + ")"
		}
	} else if _, err := os.Stat(p); err != nil {
		return "", "nvidia-ctk not found at " + p + " (min_container_toolkit_version " + least + ")"
	}
	out, err := r.Run(ctx, p, "--version")
	if err != nil {
		return "", fmt.Sprintf("nvidia-ctk --version: %s (min_container_toolkit_version %s)", firstLine(err.Error()), least)
	}
	m := ctkVersion.FindSubmatch(out)
	if m == nil {
		return "", fmt.Sprintf("nvidia-ctk --version: no version in %q (min_container_toolkit_version %s)", clip(firstLine(string(out))), least)
	}
	have = string(m[1])
	hv, err := runtimespec.ParseVersion(have)
	if err != nil {
		return have, fmt.Sprintf("nvidia-ctk version %q: %v (min_container_toolkit_version %s)", have, err, least)
	}
	mv, err := runtimespec.ParseVersion(least)
	if err != nil {
		return have, "min_container_toolkit_version: " + err.Error()
	}
	if hv.Less(mv) {
		return have, fmt.Sprintf("nvidia-ctk %s is older than min_container_toolkit_version %s", have, least)
	}
	return have, ""
}

// ctkVersion finds "NVIDIA Container Toolkit CLI version 1.17.3".
var ctkVersion = regexp.MustCompile(`(?i)version\s+(v?[0-9]+\.[0-9]+(?:\.[0-9]+)?(?:-[0-9A-Za-z.]+)?)`)

func firstLine(s string) string {
	s = strings.TrimSpace(s)
	if i := strings.IndexByte(s, '\n'); i >= 0 {
		s = s[:i]
	}
	return clip(s)
}

func clip(s string) string {
	if len(s) > 200 {
		return s[:200] + "…"
	}
	return s
}

// DockerDevices asks the running Docker daemon which of names (qualified
// CDI names) it has discovered: docker info's DiscoveredDevices (Docker
// 28.2 and later; its CDI cache refreshes itself when a spec changes). It
// returns those it lacks, or a "not checked: …" reason when the daemon
// cannot say.
func DockerDevices(ctx context.Context, r Runner, names []string) (lacks []string, notChecked string) {
	if r == nil {
		r = NoCLI
	}
	p, err := r.LookPath("docker")
	if err != nil {
		return nil, "not checked: docker not found"
	}
	out, err := r.Run(ctx, p, "info", "--format", "{{json .DiscoveredDevices}}")
	if err != nil {
		if strings.Contains(err.Error(), "can't evaluate field DiscoveredDevices") {
			return nil, "not checked: this docker does not list discovered devices (28.2 and later do)"
		}
		return nil, "not checked: docker info: " + firstLine(err.Error())
	}
	var devs []struct {
		Source string `json:"Source"`
		ID     string `json:"ID"`
	}
	if err := json.Unmarshal(bytes.TrimSpace(out), &devs); err != nil {
		return nil, "not checked: docker info: unexpected output " + clip(firstLine(string(out)))
	}
	have := map[string]bool{}
	for _, d := range devs {
		if d.Source == "cdi" {
			have[d.ID] = true
		}
	}
	for _, n := range names {
		if !have[n] {
			lacks = append(lacks, n)
		}
	}
	return lacks, ""
}

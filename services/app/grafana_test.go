package app_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/model"
	"github.com/prometheus/prometheus/model/labels"
	"github.com/prometheus/prometheus/promql/parser"

	"github.com/bettercompute/bettercompute/pkg/natstest"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/telemetry"
	"github.com/bettercompute/bettercompute/services/app"
)

// dashboardDir is deploy/grafana, from services/app.
const dashboardDir = "../../deploy/grafana"

// TestGrafanaDashboards checks every dashboard in deploy/grafana against the
// metrics a process running every role registers: each is valid JSON with a
// uid (unique), a title, the better-compute tag, schemaVersion 39 or later
// and a Prometheus datasource variable; every panel has queries; and every
// metric a query names (a panel's targets, rows' nested panels, templating
// query variables), parsed as PromQL, is one the code registers, with only
// labels it has.
func TestGrafanaDashboards(t *testing.T) {
	t.Parallel()
	files := readDashboards(t, dashboardDir)
	known := registeredMetrics(t)
	addAgentMetrics(t, known)
	// The sanity of the registry itself: a metric of each part the
	// dashboards cover, a vector with no series yet among them.
	for _, name := range []string{"gpu_temperature_celsius", "bettercompute_gateway_sessions", "bettercompute_reconcile_runs_total", "bc_webhook_attempts_total", "bc_api_deprecated_fields_total", "bettercompute_capacity_atoms", "go_goroutines"} {
		if _, ok := known[name]; !ok {
			t.Errorf("the running app does not register %s: the registry capture is broken", name)
		}
	}
	stats, errs := checkDashboards(files, known)
	for _, err := range errs {
		t.Error(err)
	}
	if stats.exprs == 0 || stats.metrics == 0 {
		t.Fatalf("checked %d expressions naming %d metrics: nothing was checked", stats.exprs, stats.metrics)
	}
	if len(errs) == 0 {
		t.Logf("%d dashboards, %d expressions, %d distinct metrics, all registered", len(files), stats.exprs, stats.metrics)
	}
}

// TestGrafanaCheckerCatchesMistakes feeds the checker dashboards with one
// mistake each, against a small known set, and expects each mistake named.
func TestGrafanaCheckerCatchesMistakes(t *testing.T) {
	t.Parallel()
	known := map[string]metricInfo{
		"bc_runs_total":   {typ: dto.MetricType_COUNTER.Enum(), labels: set("kind", "outcome")},
		"bc_run_seconds":  {typ: dto.MetricType_HISTOGRAM.Enum(), labels: set("kind")},
		"bc_queue_depth":  {labels: set("kind")},
		"bc_gauge_nolabl": {typ: dto.MetricType_GAUGE.Enum(), labels: set()},
	}
	good := func(panels, vars string) string {
		return `{"uid": "u1", "title": "T", "tags": ["better-compute"], "schemaVersion": 39,
			"templating": {"list": [{"name": "datasource", "type": "datasource", "query": "prometheus"}` + vars + `]},
			"panels": [` + panels + `]}`
	}
	panel := func(expr string) string {
		b, _ := json.Marshal(expr)
		return `{"id": 1, "type": "timeseries", "title": "P", "datasource": {"type": "prometheus", "uid": "${datasource}"}, "targets": [{"refId": "A", "expr": ` + string(b) + `}]}`
	}
	ok := panel(`histogram_quantile(0.99, sum by (kind, le) (rate(bc_run_seconds_bucket{kind=~"$kind"}[$__rate_interval]))) / on (kind) group_left sum by (kind) (rate(bc_runs_total[5m]))`)
	if _, errs := checkDashboards(map[string][]byte{"a.json": []byte(good(ok, ""))}, known); len(errs) != 0 {
		t.Fatalf("a correct dashboard: %v", errs)
	}
	for _, tc := range []struct {
		name  string
		files map[string][]byte
		want  string
	}{
		{"invalid JSON", map[string][]byte{"a.json": []byte(`{"uid": "u1",`)}, "a.json: invalid JSON"},
		{"no uid", map[string][]byte{"a.json": []byte(strings.Replace(good(ok, ""), `"uid": "u1",`, "", 1))}, "a.json: no uid"},
		{"no title", map[string][]byte{"a.json": []byte(strings.Replace(good(ok, ""), `"title": "T",`, "", 1))}, "a.json: no title"},
		{"duplicate uid", map[string][]byte{"a.json": []byte(good(ok, "")), "b.json": []byte(good(ok, ""))}, `b.json: uid "u1" is also a.json's`},
		{"old schema", map[string][]byte{"a.json": []byte(strings.Replace(good(ok, ""), `"schemaVersion": 39`, `"schemaVersion": 27`, 1))}, "schemaVersion 27"},
		{"no tag", map[string][]byte{"a.json": []byte(strings.Replace(good(ok, ""), `"better-compute"`, `"other"`, 1))}, `tag "better-compute"`},
		{"no datasource variable", map[string][]byte{"a.json": []byte(strings.Replace(good(ok, ""), `"name": "datasource"`, `"name": "ds"`, 1))}, "datasource variable"},
		{"a panel with no targets", map[string][]byte{"a.json": []byte(good(`{"id": 2, "type": "stat", "title": "Empty"}`, ""))}, `panel "Empty": no targets`},
		{"a target with no expr", map[string][]byte{"a.json": []byte(good(strings.Replace(panel("x"), `"expr": "x"`, `"expr": ""`, 1), ""))}, "no expr"},
		{"a fixed datasource", map[string][]byte{"a.json": []byte(good(strings.Replace(panel("bc_queue_depth"), "${datasource}", "prom-1", 1), ""))}, "${datasource}"},
		{"a misspelt metric", map[string][]byte{"a.json": []byte(good(panel(`sum(rate(bc_runz_total[5m]))`), ""))}, "bc_runz_total: no role registers it"},
		{"a misspelt metric in a row's panel", map[string][]byte{"a.json": []byte(good(`{"id": 9, "type": "row", "title": "R", "collapsed": true, "panels": [`+panel(`bc_queue_dept`)+`]}`, ""))}, "bc_queue_dept: no role registers it"},
		{"a misspelt metric in a variable", map[string][]byte{"a.json": []byte(good(ok, `, {"name": "kind", "type": "query", "query": {"query": "label_values(bc_queue_deep, kind)"}}`))}, "bc_queue_deep: no role registers it"},
		{"a variable's unknown label", map[string][]byte{"a.json": []byte(good(ok, `, {"name": "kind", "type": "query", "query": "label_values(bc_queue_depth, kinds)"}`))}, `label "kinds"`},
		{"_bucket of a counter", map[string][]byte{"a.json": []byte(good(panel(`bc_runs_bucket`), ""))}, "bc_runs_bucket: no role registers it"},
		{"_bucket of a metric of unknown type", map[string][]byte{"a.json": []byte(good(panel(`bc_queue_depth_bucket`), ""))}, "bc_queue_depth_bucket: no role registers it"},
		{"a label the metric lacks", map[string][]byte{"a.json": []byte(good(panel(`bc_runs_total{kinds="x"}`), ""))}, `label "kinds"`},
		{"invalid PromQL", map[string][]byte{"a.json": []byte(good(panel(`sum(rate(bc_runs_total[5m])`), ""))}, "invalid PromQL"},
		{"a regex metric name", map[string][]byte{"a.json": []byte(good(panel(`{__name__=~"bc_.*"}`), ""))}, "name each metric exactly"},
	} {
		_, errs := checkDashboards(tc.files, known)
		if !slices.ContainsFunc(errs, func(e error) bool { return strings.Contains(e.Error(), tc.want) }) {
			t.Errorf("%s: want an error containing %q, got %v", tc.name, tc.want, errs)
		}
	}
}

// metricInfo is what a registered metric family is known to be: its type
// (nil when only its descriptor is known, as for a custom collector with no
// series now) and its labels.
type metricInfo struct {
	typ    *dto.MetricType
	labels map[string]bool
}

func set(ss ...string) map[string]bool {
	m := map[string]bool{}
	for _, s := range ss {
		m[s] = true
	}
	return m
}

// readDashboards reads every *.json in dir.
func readDashboards(t *testing.T, dir string) map[string][]byte {
	t.Helper()
	paths, err := filepath.Glob(filepath.Join(dir, "*.json"))
	if err != nil {
		t.Fatal(err)
	}
	if len(paths) == 0 {
		t.Fatalf("no dashboards in %s", dir)
	}
	files := map[string][]byte{}
	for _, p := range paths {
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		files[filepath.Base(p)] = b
	}
	return files
}

// registeredMetrics starts a process with every built role (the gateway and
// the bus included) and returns every metric family it can export: the
// descriptors of each collector a role registered (seen through
// App.ObserveRegistrations, so vectors with no series count) and what a
// Gather of the registry reports (the Go and process collectors and
// bettercompute_build_info, registered before any role).
func registeredMetrics(t *testing.T) map[string]metricInfo {
	t.Helper()
	cfg := testConfig(pgtest.NewDB(t))
	cfg.Gateway.Listen = "127.0.0.1:0"
	cfg.JoinService.KeyDir = t.TempDir()
	cfg.NATS.URL = natstest.New(t).URL()
	reg := telemetry.NewRegistry()
	a, err := app.New(cfg, app.Options{Registry: reg})
	if err != nil {
		t.Fatal(err)
	}
	all, _, err := app.ResolveRoles(nil)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(a.Roles(), all) {
		t.Fatalf("the process runs %v, not every built role %v", a.Roles(), all)
	}
	var mu sync.Mutex
	var collectors []prometheus.Collector
	a.ObserveRegistrations(func(c prometheus.Collector) {
		mu.Lock()
		defer mu.Unlock()
		collectors = append(collectors, c)
	})
	if err := a.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Stop(context.Background()) })

	known := map[string]metricInfo{}
	add := func(name string, typ *dto.MetricType, ls ...string) {
		mi, ok := known[name]
		if !ok {
			mi = metricInfo{labels: map[string]bool{}}
		}
		if typ != nil {
			mi.typ = typ
		}
		for _, l := range ls {
			mi.labels[l] = true
		}
		known[name] = mi
	}
	mu.Lock()
	seen := slices.Clone(collectors)
	mu.Unlock()
	if len(seen) == 0 {
		t.Fatal("no role registered a collector")
	}
	for _, c := range seen {
		typ := collectorType(c)
		for _, d := range describe(c) {
			name, ls, err := parseDesc(d)
			if err != nil {
				t.Fatal(err)
			}
			add(name, typ, ls...)
		}
	}
	fams, err := reg.Gather()
	if err != nil {
		// A collector that reads the database may fail a scrape; what it
		// described still counts.
		t.Logf("gather: %v", err)
	}
	for _, f := range fams {
		var ls []string
		for _, m := range f.GetMetric() {
			for _, lp := range m.GetLabel() {
				ls = append(ls, lp.GetName())
			}
		}
		add(f.GetName(), f.Type, ls...)
	}
	return known
}

// agentMetrics is the list of the metrics bcd (the node agent) exports over
// OTLP and its local scrape endpoint, kept current by the agent's own test
// (agent/telemetry's TestMetricsList).
const agentMetrics = "../../agent/telemetry/metrics.txt"

// addAgentMetrics adds bcd's metrics (name, type, labels per line) to known.
func addAgentMetrics(t *testing.T, known map[string]metricInfo) {
	t.Helper()
	b, err := os.ReadFile(agentMetrics)
	if err != nil {
		t.Fatal(err)
	}
	types := map[string]dto.MetricType{"counter": dto.MetricType_COUNTER, "gauge": dto.MetricType_GAUGE, "histogram": dto.MetricType_HISTOGRAM}
	for line := range strings.SplitSeq(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) == 0 || strings.HasPrefix(f[0], "#") {
			continue
		}
		if len(f) < 2 || len(f) > 3 {
			t.Fatalf("%s: cannot read %q", agentMetrics, line)
		}
		typ, ok := types[f[1]]
		if !ok {
			t.Fatalf("%s: cannot read %q", agentMetrics, line)
		}
		mi := metricInfo{typ: typ.Enum(), labels: set()}
		if len(f) == 3 {
			mi.labels = set(strings.Split(f[2], ",")...)
		}
		known[f[0]] = mi
	}
}

// describe returns what c describes.
func describe(c prometheus.Collector) []*prometheus.Desc {
	ch := make(chan *prometheus.Desc)
	go func() { c.Describe(ch); close(ch) }()
	var ds []*prometheus.Desc
	for d := range ch {
		ds = append(ds, d)
	}
	return ds
}

// collectorType is the metric type of a collector of one family whose type
// its Go type tells (a vector, or a single metric, written out), or nil.
func collectorType(c prometheus.Collector) *dto.MetricType {
	switch c.(type) {
	case *prometheus.CounterVec:
		return dto.MetricType_COUNTER.Enum()
	case *prometheus.GaugeVec:
		return dto.MetricType_GAUGE.Enum()
	case *prometheus.HistogramVec:
		return dto.MetricType_HISTOGRAM.Enum()
	case *prometheus.SummaryVec:
		return dto.MetricType_SUMMARY.Enum()
	}
	m, ok := c.(prometheus.Metric)
	if !ok {
		return nil
	}
	var out dto.Metric
	if m.Write(&out) != nil {
		return nil
	}
	switch {
	case out.Counter != nil:
		return dto.MetricType_COUNTER.Enum()
	case out.Gauge != nil:
		return dto.MetricType_GAUGE.Enum()
	case out.Histogram != nil:
		return dto.MetricType_HISTOGRAM.Enum()
	case out.Summary != nil:
		return dto.MetricType_SUMMARY.Enum()
	}
	return nil
}

// descPattern reads a Desc's String: the only way client_golang offers to a
// descriptor's name and labels.
var descPattern = regexp.MustCompile(`^Desc\{fqName: "([a-zA-Z_:][a-zA-Z0-9_:]*)", .*constLabels: \{(.*)\}, variableLabels: \{([^{}]*)\}\}$`)

func parseDesc(d *prometheus.Desc) (name string, ls []string, err error) {
	m := descPattern.FindStringSubmatch(d.String())
	if m == nil {
		return "", nil, fmt.Errorf("cannot read the descriptor %s", d)
	}
	for _, l := range strings.Split(m[3], ",") {
		if l = strings.TrimSuffix(strings.TrimPrefix(l, "c("), ")"); l != "" {
			ls = append(ls, l)
		}
	}
	for _, kv := range regexp.MustCompile(`(?:^|,)([a-zA-Z_][a-zA-Z0-9_]*)="`).FindAllStringSubmatch(m[2], -1) {
		ls = append(ls, kv[1])
	}
	return m[1], ls, nil
}

// scrapeLabels are the labels Prometheus attaches to every series of a
// target (job and instance always; the rest by the usual Kubernetes pod
// relabelling of the prometheus.io/scrape annotations deploy/kubernetes
// sets).
var scrapeLabels = set("job", "instance", "pod", "namespace", "container", "node")

// The dashboard JSON model, as much of it as is checked.
type dashboardJSON struct {
	UID           string         `json:"uid"`
	Title         string         `json:"title"`
	Tags          []string       `json:"tags"`
	SchemaVersion int            `json:"schemaVersion"`
	Panels        []panelJSON    `json:"panels"`
	Templating    templatingJSON `json:"templating"`
}

type templatingJSON struct {
	List []variableJSON `json:"list"`
}

type variableJSON struct {
	Name  string          `json:"name"`
	Type  string          `json:"type"`
	Query json.RawMessage `json:"query"`
}

type panelJSON struct {
	Type       string          `json:"type"`
	Title      string          `json:"title"`
	Datasource *datasourceJSON `json:"datasource"`
	Targets    []targetJSON    `json:"targets"`
	Panels     []panelJSON     `json:"panels"`
}

type targetJSON struct {
	RefID      string          `json:"refId"`
	Expr       string          `json:"expr"`
	Datasource *datasourceJSON `json:"datasource"`
}

type datasourceJSON struct {
	Type string `json:"type"`
	UID  string `json:"uid"`
}

// checkStats says how much checkDashboards looked at.
type checkStats struct{ exprs, metrics int }

// checkDashboards checks each file (by name) against the known metrics and
// returns every problem found.
func checkDashboards(files map[string][]byte, known map[string]metricInfo) (checkStats, []error) {
	var errs []error
	var stats checkStats
	metrics := map[string]bool{}
	uids := map[string]string{}
	names := make([]string, 0, len(files))
	for n := range files {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, file := range names {
		var d dashboardJSON
		if err := json.Unmarshal(files[file], &d); err != nil {
			errs = append(errs, fmt.Errorf("%s: invalid JSON: %w", file, err))
			continue
		}
		fail := func(format string, args ...any) { errs = append(errs, fmt.Errorf(file+": "+format, args...)) }
		if d.UID == "" {
			fail("no uid")
		} else if other, dup := uids[d.UID]; dup {
			fail("uid %q is also %s's", d.UID, other)
		} else {
			uids[d.UID] = file
		}
		if d.Title == "" {
			fail("no title")
		}
		if d.SchemaVersion < 39 {
			fail("schemaVersion %d, want 39 or later", d.SchemaVersion)
		}
		if !slices.Contains(d.Tags, "better-compute") {
			fail("no tag %q in %v", "better-compute", d.Tags)
		}
		if !slices.ContainsFunc(d.Templating.List, func(v variableJSON) bool {
			return v.Name == "datasource" && v.Type == "datasource" && string(v.Query) == `"prometheus"`
		}) {
			fail("no Prometheus datasource variable named datasource in templating.list")
		}
		check := func(where, expr string, label string) {
			stats.exprs++
			for _, err := range checkExpr(expr, label, known, metrics) {
				fail("%s: %v", where, err)
			}
		}
		for _, v := range d.Templating.List {
			if v.Type != "query" {
				continue
			}
			q, err := variableQuery(v.Query)
			if err != nil {
				fail("variable %q: %v", v.Name, err)
				continue
			}
			expr, label, err := templatingExpr(q)
			if err != nil {
				fail("variable %q: %v", v.Name, err)
				continue
			}
			if expr != "" {
				check(fmt.Sprintf("variable %q", v.Name), expr, label)
			}
		}
		var walk func(ps []panelJSON)
		walk = func(ps []panelJSON) {
			for _, p := range ps {
				if p.Type == "row" {
					if len(p.Targets) > 0 {
						fail("row %q has targets", p.Title)
					}
					walk(p.Panels)
					continue
				}
				if len(p.Targets) == 0 {
					fail("panel %q: no targets", p.Title)
					continue
				}
				for _, tg := range p.Targets {
					where := fmt.Sprintf("panel %q target %s", p.Title, tg.RefID)
					ds := cmpDatasource(tg.Datasource, p.Datasource)
					if ds == nil || ds.UID != "${datasource}" {
						fail("%s: the datasource must be the variable ${datasource}, is %v", where, ds)
					}
					if strings.TrimSpace(tg.Expr) == "" {
						fail("%s: no expr", where)
						continue
					}
					check(where, tg.Expr, "")
				}
			}
		}
		walk(d.Panels)
	}
	stats.metrics = len(metrics)
	return stats, errs
}

func cmpDatasource(ds ...*datasourceJSON) *datasourceJSON {
	for _, d := range ds {
		if d != nil {
			return d
		}
	}
	return nil
}

// variableQuery is a query variable's query: a string, or (Grafana 10 and
// later) an object whose query field is the string.
func variableQuery(raw json.RawMessage) (string, error) {
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return s, nil
	}
	var o struct {
		Query string `json:"query"`
	}
	if err := json.Unmarshal(raw, &o); err != nil {
		return "", fmt.Errorf("query is neither a string nor an object with a query: %w", err)
	}
	return o.Query, nil
}

// templatingExpr is the PromQL inside a Prometheus templating query
// (label_values(expr, label), query_result(expr)) and the label it lists;
// "" for label_values(label) and label_names(), which name no metric.
func templatingExpr(q string) (expr, label string, err error) {
	q = strings.TrimSpace(q)
	inner := func(fn string) (string, bool) {
		if !strings.HasPrefix(q, fn+"(") || !strings.HasSuffix(q, ")") {
			return "", false
		}
		return q[len(fn)+1 : len(q)-1], true
	}
	if s, ok := inner("label_values"); ok {
		i := strings.LastIndex(s, ",")
		if i < 0 {
			return "", "", nil
		}
		return strings.TrimSpace(s[:i]), strings.TrimSpace(s[i+1:]), nil
	}
	if s, ok := inner("query_result"); ok {
		return s, "", nil
	}
	if _, ok := inner("label_names"); ok {
		return "", "", nil
	}
	return "", "", fmt.Errorf("templating query %q is not label_values, query_result or label_names", q)
}

// grafanaDurations are Grafana's interval variables, which stand where a
// PromQL duration does.
var grafanaDurations = regexp.MustCompile(`\$\{?__(rate_interval|interval|range)(_ms|_s)?\}?`)

var promql = parser.NewParser(parser.Options{})

// checkExpr parses expr as PromQL and checks each metric it names against
// known (a histogram's _bucket, _sum and _count, a summary's _sum and
// _count, and a counter's _total where its name lacks it count as the
// metric's), and each label a selector matches on against the metric's
// labels; label is a templating query's listed label, checked the same way.
// Each metric resolved is added to seen.
func checkExpr(expr, label string, known map[string]metricInfo, seen map[string]bool) []error {
	e, err := promql.ParseExpr(grafanaDurations.ReplaceAllString(expr, "5m"))
	if err != nil {
		return []error{fmt.Errorf("invalid PromQL %q: %w", expr, err)}
	}
	var errs []error
	selectors := 0
	parser.Inspect(e, func(n parser.Node, _ []parser.Node) error {
		vs, ok := n.(*parser.VectorSelector)
		if !ok {
			return nil
		}
		selectors++
		name := vs.Name
		for _, m := range vs.LabelMatchers {
			if m.Name == model.MetricNameLabel && (m.Type != labels.MatchEqual || (name != "" && m.Value != name)) {
				errs = append(errs, fmt.Errorf("%q: name each metric exactly, not by a %s on __name__", expr, m.Type))
				return nil
			}
			if m.Name == model.MetricNameLabel {
				name = m.Value
			}
		}
		if name == "" {
			errs = append(errs, fmt.Errorf("%q: a selector with no metric name", expr))
			return nil
		}
		ls, err := resolve(name, known)
		if err != nil {
			errs = append(errs, err)
			return nil
		}
		seen[name] = true
		for _, m := range vs.LabelMatchers {
			if m.Name != model.MetricNameLabel && !ls[m.Name] && !scrapeLabels[m.Name] {
				errs = append(errs, fmt.Errorf("%q: %s has no label %q (it has %v)", expr, name, m.Name, sortedKeys(ls)))
			}
		}
		if label != "" && !ls[label] && !scrapeLabels[label] {
			errs = append(errs, fmt.Errorf("%q lists label %q, which %s lacks (it has %v)", expr, label, name, sortedKeys(ls)))
		}
		return nil
	})
	if selectors == 0 && len(errs) == 0 {
		errs = append(errs, fmt.Errorf("%q names no metric", expr))
	}
	return errs
}

// resolve finds the registered family a series name belongs to and returns
// the labels its series may carry.
func resolve(name string, known map[string]metricInfo) (map[string]bool, error) {
	if mi, ok := known[name]; ok {
		return mi.labels, nil
	}
	is := func(mi metricInfo, ts ...dto.MetricType) bool {
		return mi.typ != nil && slices.Contains(ts, *mi.typ)
	}
	with := func(ls map[string]bool, extra string) map[string]bool {
		out := map[string]bool{}
		if extra != "" {
			out[extra] = true
		}
		for l := range ls {
			out[l] = true
		}
		return out
	}
	for _, s := range []struct {
		suffix, extra string
		types         []dto.MetricType
	}{
		{"_bucket", "le", []dto.MetricType{dto.MetricType_HISTOGRAM}},
		{"_sum", "", []dto.MetricType{dto.MetricType_HISTOGRAM, dto.MetricType_SUMMARY}},
		{"_count", "", []dto.MetricType{dto.MetricType_HISTOGRAM, dto.MetricType_SUMMARY}},
		{"_total", "", []dto.MetricType{dto.MetricType_COUNTER}},
	} {
		base, ok := strings.CutSuffix(name, s.suffix)
		if mi, found := known[base]; ok && found && is(mi, s.types...) {
			return with(mi.labels, s.extra), nil
		}
	}
	return nil, errors.New(name + ": no role registers it")
}

func sortedKeys(m map[string]bool) []string {
	ks := make([]string, 0, len(m))
	for k := range m {
		ks = append(ks, k)
	}
	sort.Strings(ks)
	return ks
}

package telemetry

import (
	"bufio"
	"fmt"
	"math"
	"net/http"
	"sort"
	"strconv"
	"strings"
	"sync"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
)

// Handler serves the metrics in Prometheus's text format (0.0.4) for a
// local scrape, named as Prometheus's OTLP receiver names them (dots as
// underscores, the unit as a suffix, _total on counters), so one dashboard
// reads either path. bcd serves it only with --prometheus-listen.
func (t *Telemetry) Handler() http.Handler {
	var mu sync.Mutex // one scrape at a time: the reader's buffer is reused
	var rm metricdata.ResourceMetrics
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodGet && r.Method != http.MethodHead {
			http.Error(w, "GET only", http.StatusMethodNotAllowed)
			return
		}
		mu.Lock()
		defer mu.Unlock()
		if err := t.prom.Collect(r.Context(), &rm); err != nil && len(rm.ScopeMetrics) == 0 {
			http.Error(w, "collecting: "+err.Error(), http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
		bw := bufio.NewWriter(w)
		writeProm(bw, &rm)
		_ = bw.Flush()
	})
}

// unitSuffix is Prometheus's word for an OTLP unit ("" for none or an
// annotation such as {event}).
var unitSuffix = map[string]string{
	"%": "percent", "By": "bytes", "Cel": "celsius", "W": "watts", "MHz": "megahertz", "s": "seconds",
}

// PromName is the name Prometheus gives an OTLP metric: name with every
// character outside [a-zA-Z0-9_:] as "_", its unit's word appended unless
// already there, and "_total" for a monotonic counter.
func PromName(name, unit string, counter bool) string {
	n := sanitize(name)
	if s := unitSuffix[unit]; s != "" && !strings.HasSuffix(n, "_"+s) {
		n += "_" + s
	}
	if counter && !strings.HasSuffix(n, "_total") {
		n += "_total"
	}
	return n
}

func sanitize(s string) string {
	return strings.Map(func(r rune) rune {
		if r == '_' || r == ':' || (r >= 'a' && r <= 'z') || (r >= 'A' && r <= 'Z') || (r >= '0' && r <= '9') {
			return r
		}
		return '_'
	}, s)
}

func writeProm(w *bufio.Writer, rm *metricdata.ResourceMetrics) {
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			switch d := m.Data.(type) {
			case metricdata.Gauge[int64]:
				header(w, PromName(m.Name, m.Unit, false), m.Description, "gauge")
				for _, p := range d.DataPoints {
					sample(w, PromName(m.Name, m.Unit, false), p.Attributes, "", "", float64(p.Value))
				}
			case metricdata.Gauge[float64]:
				header(w, PromName(m.Name, m.Unit, false), m.Description, "gauge")
				for _, p := range d.DataPoints {
					sample(w, PromName(m.Name, m.Unit, false), p.Attributes, "", "", p.Value)
				}
			case metricdata.Sum[int64]:
				n, typ := PromName(m.Name, m.Unit, d.IsMonotonic), "counter"
				if !d.IsMonotonic {
					typ = "gauge"
				}
				header(w, n, m.Description, typ)
				for _, p := range d.DataPoints {
					sample(w, n, p.Attributes, "", "", float64(p.Value))
				}
			case metricdata.Sum[float64]:
				n, typ := PromName(m.Name, m.Unit, d.IsMonotonic), "counter"
				if !d.IsMonotonic {
					typ = "gauge"
				}
				header(w, n, m.Description, typ)
				for _, p := range d.DataPoints {
					sample(w, n, p.Attributes, "", "", p.Value)
				}
			case metricdata.Histogram[float64]:
				n := PromName(m.Name, m.Unit, false)
				header(w, n, m.Description, "histogram")
				for _, p := range d.DataPoints {
					var cum uint64
					for i, b := range p.Bounds {
						cum += p.BucketCounts[i]
						sample(w, n+"_bucket", p.Attributes, "le", strconv.FormatFloat(b, 'g', -1, 64), float64(cum))
					}
					sample(w, n+"_bucket", p.Attributes, "le", "+Inf", float64(p.Count))
					sample(w, n+"_sum", p.Attributes, "", "", p.Sum)
					sample(w, n+"_count", p.Attributes, "", "", float64(p.Count))
				}
			}
		}
	}
}

func header(w *bufio.Writer, name, help, typ string) {
	if help != "" {
		fmt.Fprintf(w, "# HELP %s %s\n", name, strings.NewReplacer(`\`, `\\`, "\n", `\n`).Replace(help))
	}
	fmt.Fprintf(w, "# TYPE %s %s\n", name, typ)
}

var labelEscaper = strings.NewReplacer(`\`, `\\`, "\n", `\n`, `"`, `\"`)

func sample(w *bufio.Writer, name string, attrs attribute.Set, extraKey, extraVal string, v float64) {
	b := make([]byte, 0, 128)
	b = append(b, name...)
	kvs := attrs.ToSlice()
	sort.Slice(kvs, func(i, j int) bool { return kvs[i].Key < kvs[j].Key })
	if len(kvs) > 0 || extraKey != "" {
		b = append(b, '{')
		for i, kv := range kvs {
			if i > 0 {
				b = append(b, ',')
			}
			b = fmt.Appendf(b, `%s="%s"`, sanitize(string(kv.Key)), labelEscaper.Replace(kv.Value.String()))
		}
		if extraKey != "" {
			if len(kvs) > 0 {
				b = append(b, ',')
			}
			b = fmt.Appendf(b, `%s="%s"`, extraKey, extraVal)
		}
		b = append(b, '}')
	}
	b = append(b, ' ')
	switch {
	case math.IsInf(v, 1):
		b = append(b, "+Inf"...)
	case math.IsInf(v, -1):
		b = append(b, "-Inf"...)
	default:
		b = strconv.AppendFloat(b, v, 'g', -1, 64)
	}
	b = append(b, '\n')
	_, _ = w.Write(b)
}

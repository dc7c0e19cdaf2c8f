// Command benchtable turns the output of `go test -bench` (every module's,
// concatenated) into one table, and measures this machine's limits in the
// same run to read it against: PostgreSQL's TPC-B rate (pgbench) and a raw
// single-row INSERT … ON CONFLICT rate on the same server. `make bench` runs
// it; the table is printed and written to --out.
//
//	go run ./tools/cmd/benchtable --in .bench/raw.txt --out .bench/results.md
//
// The limits are measured with pgbench against --db (default
// TEST_DATABASE_URL, else postgres://postgres@127.0.0.1:5432/postgres), in a
// scratch database it creates and drops; when pgbench or the server is
// missing the table says so instead.
package main

import (
	"bufio"
	"cmp"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"time"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "benchtable:", err)
		os.Exit(1)
	}
}

func run() error {
	var (
		in       = flag.String("in", "-", "go test -bench output to read (- is stdin)")
		out      = flag.String("out", ".bench/results.md", "where to write the table")
		dbURL    = flag.String("db", cmp.Or(os.Getenv("TEST_DATABASE_URL"), "postgres://postgres@127.0.0.1:5432/postgres"), "PostgreSQL server for the limits")
		duration = flag.Duration("limits-time", 10*time.Second, "how long each limit is measured")
		noLimits = flag.Bool("no-limits", false, "skip measuring the machine's limits")
	)
	flag.Parse()
	r := io.Reader(os.Stdin)
	if *in != "-" {
		f, err := os.Open(*in)
		if err != nil {
			return err
		}
		defer func() { _ = f.Close() }()
		r = f
	}
	results, err := parse(r)
	if err != nil {
		return err
	}
	var limits []limit
	if !*noLimits {
		limits = measureLimits(*dbURL, *duration)
	}
	table := render(results, limits, time.Now())
	fmt.Print(table)
	if err := os.MkdirAll(filepath.Dir(*out), 0o755); err != nil {
		return err
	}
	if err := os.WriteFile(*out, []byte(table), 0o644); err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "benchtable: written to %s\n", *out)
	return nil
}

// result is one benchmark's line.
type result struct {
	pkg, name string
	iters     int64
	metrics   []metric
}

type metric struct {
	value float64
	unit  string
}

var benchLine = regexp.MustCompile(`^(Benchmark\S+?)(-\d+)?\s+(\d+)\s+(.*)$`)

// parse reads go test -bench output: "pkg:" lines name the package of the
// benchmark lines after them; FAIL lines and everything else are skipped.
func parse(r io.Reader) ([]result, error) {
	var out []result
	pkg := ""
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if p, ok := strings.CutPrefix(line, "pkg: "); ok {
			pkg = p
			continue
		}
		m := benchLine.FindStringSubmatch(line)
		if m == nil {
			continue
		}
		iters, _ := strconv.ParseInt(m[3], 10, 64)
		res := result{pkg: pkg, name: m[1], iters: iters}
		fields := strings.Fields(m[4])
		for i := 0; i+1 < len(fields); i += 2 {
			v, err := strconv.ParseFloat(fields[i], 64)
			if err != nil {
				break
			}
			res.metrics = append(res.metrics, metric{value: v, unit: fields[i+1]})
		}
		out = append(out, res)
	}
	return out, sc.Err()
}

// limit is one measured limit of the machine.
type limit struct {
	name, value, how string
}

// measureLimits runs pgbench's TPC-B and a single-row upsert script against
// a scratch database on the server of dbURL.
func measureLimits(dbURL string, d time.Duration) []limit {
	fail := func(err error) []limit {
		return []limit{{name: "PostgreSQL limits", value: "not measured", how: err.Error()}}
	}
	if _, err := exec.LookPath("pgbench"); err != nil {
		return fail(errors.New("pgbench is not installed"))
	}
	u, err := url.Parse(dbURL)
	if err != nil {
		return fail(fmt.Errorf("database URL: %w", err))
	}
	scratch := *u
	scratch.Path = "/bc_bench_limits"
	admin := u.String()
	psql := func(url, sql string) error {
		out, err := exec.Command("psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", url, "-c", sql).CombinedOutput()
		if err != nil {
			return fmt.Errorf("psql: %v: %s", err, strings.TrimSpace(string(out)))
		}
		return nil
	}
	_ = psql(admin, "DROP DATABASE IF EXISTS bc_bench_limits")
	if err := psql(admin, "CREATE DATABASE bc_bench_limits"); err != nil {
		return fail(err)
	}
	defer func() { _ = psql(admin, "DROP DATABASE IF EXISTS bc_bench_limits") }()
	db := scratch.String()
	secs := strconv.Itoa(max(1, int(d.Seconds())))
	clients := strconv.Itoa(runtime.NumCPU())
	var out []limit
	if b, err := exec.Command("pgbench", "-i", "-q", "-s", "10", db).CombinedOutput(); err != nil {
		return fail(fmt.Errorf("pgbench -i: %v: %s", err, lastLine(b)))
	}
	tps, err := pgbench(db, "-T", secs, "-c", clients, "-j", clients, "-M", "prepared")
	out = append(out, limitOf("PostgreSQL TPC-B (pgbench, scale 10)", tps, err, "tx/s", fmt.Sprintf("pgbench -T %s -c %s -j %s -M prepared", secs, clients, clients)))

	if err := psql(db, "CREATE TABLE upserts (k int PRIMARY KEY, v bigint NOT NULL)"); err != nil {
		return append(out, limit{name: "INSERT … ON CONFLICT", value: "not measured", how: err.Error()})
	}
	script := filepath.Join(os.TempDir(), fmt.Sprintf("bc-upsert-%d.sql", os.Getpid()))
	if err := os.WriteFile(script, []byte("\\set k random(1, 100000)\nINSERT INTO upserts (k, v) VALUES (:k, 1) ON CONFLICT (k) DO UPDATE SET v = upserts.v + 1;\n"), 0o644); err != nil {
		return append(out, limit{name: "INSERT … ON CONFLICT", value: "not measured", how: err.Error()})
	}
	defer func() { _ = os.Remove(script) }()
	for _, c := range []string{"1", clients} {
		tps, err := pgbench(db, "-n", "-f", script, "-T", secs, "-c", c, "-j", c, "-M", "prepared")
		out = append(out, limitOf("single-row INSERT … ON CONFLICT, "+c+" client(s), each its own commit", tps, err, "rows/s",
			fmt.Sprintf("pgbench -n -f upsert.sql -T %s -c %s -M prepared", secs, c)))
	}
	// The same rows, 1,000 per statement and commit: the ceiling of a
	// batched writer.
	if err := os.WriteFile(script, []byte("\\set k random(1, 99000)\nINSERT INTO upserts (k, v) SELECT g, 1 FROM generate_series(:k, :k + 999) g ON CONFLICT (k) DO UPDATE SET v = upserts.v + 1;\n"), 0o644); err != nil {
		return out
	}
	tps, err = pgbench(db, "-n", "-f", script, "-T", secs, "-c", "1", "-M", "prepared")
	return append(out, limitOf("INSERT … ON CONFLICT, 1,000 rows per statement and commit, 1 client", tps*1000, err, "rows/s",
		fmt.Sprintf("pgbench -n -f upsert-1000.sql -T %s -c 1 -M prepared", secs)))
}

func limitOf(name string, v float64, err error, unit, how string) limit {
	if err != nil {
		return limit{name: name, value: "not measured", how: err.Error()}
	}
	return limit{name: name, value: fmt.Sprintf("%.0f %s", v, unit), how: how}
}

var tpsLine = regexp.MustCompile(`tps = ([0-9.]+) \(without initial connection time\)`)

// pgbench runs pgbench and returns its tps.
func pgbench(db string, args ...string) (float64, error) {
	b, err := exec.Command("pgbench", append(args, db)...).CombinedOutput()
	if err != nil {
		return 0, fmt.Errorf("pgbench: %v: %s", err, lastLine(b))
	}
	m := tpsLine.FindSubmatch(b)
	if m == nil {
		return 0, fmt.Errorf("pgbench printed no tps: %s", lastLine(b))
	}
	return strconv.ParseFloat(string(m[1]), 64)
}

func lastLine(b []byte) string {
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	return lines[len(lines)-1]
}

// render writes the markdown table.
func render(results []result, limits []limit, at time.Time) string {
	var b strings.Builder
	host, _ := os.Hostname()
	fmt.Fprintf(&b, "# Benchmarks\n\n%s on %s: %d CPUs, %s/%s.\n\n", at.UTC().Format(time.RFC3339), host, runtime.NumCPU(), runtime.GOOS, runtime.GOARCH)
	if len(limits) > 0 {
		b.WriteString("## This machine's limits, measured in the same run\n\n| limit | measured | how |\n|---|---|---|\n")
		for _, l := range limits {
			fmt.Fprintf(&b, "| %s | %s | `%s` |\n", l.name, l.value, strings.ReplaceAll(l.how, "|", "\\|"))
		}
		b.WriteString("\n")
	}
	b.WriteString("## Every benchmark\n\n| package | benchmark | runs | results |\n|---|---|---|---|\n")
	for _, r := range results {
		var ms []string
		for _, m := range r.metrics {
			ms = append(ms, formatMetric(m))
		}
		fmt.Fprintf(&b, "| %s | %s | %d | %s |\n", strings.TrimPrefix(r.pkg, "github.com/bettercompute/bettercompute/"), r.name, r.iters, strings.Join(ms, ", "))
	}
	if len(results) == 0 {
		b.WriteString("| | (no benchmark results in the input) | | |\n")
	}
	return b.String()
}

func formatMetric(m metric) string {
	if m.unit == "ns/op" {
		return time.Duration(m.value).Round(time.Microsecond).String() + "/op"
	}
	if m.value >= 100 || m.value == float64(int64(m.value)) {
		return strconv.FormatFloat(m.value, 'f', 0, 64) + " " + m.unit
	}
	return strconv.FormatFloat(m.value, 'g', 4, 64) + " " + m.unit
}

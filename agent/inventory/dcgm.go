package inventory

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os/exec"
	"strconv"
	"strings"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
)

// DefaultDCGMI is the dcgmi binary the daemon runs when Config.DCGMI is
// empty (looked up on PATH).
const DefaultDCGMI = "dcgmi"

// Bounds of a DcgmDiag (see the proto).
const (
	maxDCGMTests    = 256
	maxDCGMDetail   = 1024
	maxDCGMName     = 128
	maxDCGMCategory = 64
	maxDCGMResult   = 32
	maxDCGMVersion  = 64
	// maxDCGMOutput bounds what is read of dcgmi's stdout and stderr.
	maxDCGMOutput = 4 << 20
)

// RunDCGM runs `dcgmi diag -r runLevel -j` (with `-i` and the GPU ids when
// gpus is not empty: DCGM's GPU ids are NVML's indices) and parses each
// test's result per GPU, naming the GPU by uuids[index]. It never returns
// a silent pass: without the binary the status is NOT_INSTALLED; output it
// cannot read, or an exit status that no failed test explains, is ERROR.
//
// The output read is dcgmi's JSON (-j) of DCGM 3.x:
//
//	{"DCGM GPU Diagnostic": {"test_categories": [{"category": "Integration",
//	  "tests": [{"name": "PCIe", "results": [{"gpu_ids": "0", "status": "Fail",
//	  "warnings": [{"warning": "…", "error_id": 1}], "info": ["…"]}]}]}]},
//	 "version": "3.3.5"}
//
// with gpu_ids (or gpu_id) a string or a number, and warnings and info
// each a string, a list of strings or a list of {"warning": …} objects.
func RunDCGM(ctx context.Context, dcgmi string, runLevel int, gpus []uint32, uuids map[uint32]string) *agentv1.DcgmDiag {
	out := &agentv1.DcgmDiag{RunLevel: uint32(runLevel)}
	if dcgmi == "" {
		dcgmi = DefaultDCGMI
	}
	bin, err := exec.LookPath(dcgmi)
	if err != nil {
		out.Status = agentv1.DcgmStatus_DCGM_STATUS_NOT_INSTALLED
		out.Reason = clip(fmt.Sprintf("DCGM not installed: no dcgmi (%s): %v", dcgmi, err), maxDCGMDetail)
		return out
	}
	args := []string{"diag", "-r", strconv.Itoa(runLevel), "-j"}
	if len(gpus) > 0 {
		ids := make([]string, len(gpus))
		for i, g := range gpus {
			ids[i] = strconv.FormatUint(uint64(g), 10)
		}
		args = append(args, "-i", strings.Join(ids, ","))
	}
	stdout, stderr := &boundedBuffer{max: maxDCGMOutput}, &boundedBuffer{max: maxDCGMOutput}
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Stdout, cmd.Stderr = stdout, stderr
	runErr := cmd.Run()
	if ctx.Err() != nil {
		out.Status, out.Reason = agentv1.DcgmStatus_DCGM_STATUS_ERROR, "dcgmi diag interrupted: "+ctx.Err().Error()
		return out
	}
	parsed, perr := parseDCGM(stdout.Bytes(), uuids)
	if perr != nil {
		out.Status = agentv1.DcgmStatus_DCGM_STATUS_ERROR
		out.Reason = clip(fmt.Sprintf("dcgmi diag -r %d: %s: %s", runLevel, describeExit(runErr), firstNonEmpty(strings.TrimSpace(stderr.String()), strings.TrimSpace(stdout.String()), perr.Error())), maxDCGMDetail)
		return out
	}
	out.Tests, out.Version = parsed.tests, parsed.version
	var failed []string
	for _, t := range out.Tests {
		if t.GetResult() == "fail" {
			what := t.GetName()
			if t.GetGpuUuid() != "" {
				what += " on " + t.GetGpuUuid()
			}
			if t.GetDetail() != "" {
				what += " (" + t.GetDetail() + ")"
			}
			failed = append(failed, what)
		}
	}
	switch {
	case len(failed) > 0:
		out.Status = agentv1.DcgmStatus_DCGM_STATUS_FAILED
		out.Reason = clip("failed: "+strings.Join(failed, "; "), maxDCGMDetail)
	case runErr != nil:
		out.Status = agentv1.DcgmStatus_DCGM_STATUS_ERROR
		out.Reason = clip(fmt.Sprintf("dcgmi diag -r %d: %s with no failed test: %s", runLevel, describeExit(runErr), strings.TrimSpace(stderr.String())), maxDCGMDetail)
	case len(out.Tests) == 0:
		out.Status, out.Reason = agentv1.DcgmStatus_DCGM_STATUS_ERROR, fmt.Sprintf("dcgmi diag -r %d reported no test", runLevel)
	default:
		out.Status = agentv1.DcgmStatus_DCGM_STATUS_PASSED
	}
	return out
}

// describeExit says how dcgmi ended.
func describeExit(err error) string {
	var ee *exec.ExitError
	switch {
	case err == nil:
		return "exited 0"
	case errors.As(err, &ee):
		return fmt.Sprintf("exited %d", ee.ExitCode())
	}
	return err.Error()
}

type dcgmJSON struct {
	Diag struct {
		Categories []struct {
			Category string `json:"category"`
			Tests    []struct {
				Name    string `json:"name"`
				Results []struct {
					GPUIDs   json.RawMessage `json:"gpu_ids"`
					GPUID    json.RawMessage `json:"gpu_id"`
					Status   string          `json:"status"`
					Warnings json.RawMessage `json:"warnings"`
					Info     json.RawMessage `json:"info"`
				} `json:"results"`
			} `json:"tests"`
		} `json:"test_categories"`
	} `json:"DCGM GPU Diagnostic"`
	Version string `json:"version"`
}

type dcgmParsed struct {
	tests   []*agentv1.DcgmTest
	version string
}

// parseDCGM reads dcgmi diag's JSON (see RunDCGM).
func parseDCGM(b []byte, uuids map[uint32]string) (dcgmParsed, error) {
	var v dcgmJSON
	if err := json.Unmarshal(bytes.TrimSpace(b), &v); err != nil {
		return dcgmParsed{}, fmt.Errorf("reading dcgmi's JSON: %w", err)
	}
	if v.Diag.Categories == nil {
		return dcgmParsed{}, errors.New(`dcgmi's JSON has no "DCGM GPU Diagnostic" test_categories`)
	}
	p := dcgmParsed{version: clip(v.Version, maxDCGMVersion)}
	for _, c := range v.Diag.Categories {
		for _, t := range c.Tests {
			for _, r := range t.Results {
				if len(p.tests) == maxDCGMTests {
					return p, nil
				}
				dt := &agentv1.DcgmTest{Name: clip(t.Name, maxDCGMName), Category: clip(c.Category, maxDCGMCategory),
					Result: clip(dcgmResult(r.Status), maxDCGMResult)}
				id := r.GPUIDs
				if len(id) == 0 {
					id = r.GPUID
				}
				if idx, ok := gpuIndex(id); ok {
					dt.GpuUuid = uuids[idx]
					if dt.GpuUuid == "" {
						dt.GpuUuid = fmt.Sprintf("GPU %d", idx)
					}
				}
				dt.Detail = clip(strings.Join(append(texts(r.Warnings), texts(r.Info)...), "; "), maxDCGMDetail)
				p.tests = append(p.tests, dt)
			}
		}
	}
	return p, nil
}

// dcgmResult is dcgmi's status in lower case ("Not Run" is "skip").
func dcgmResult(s string) string {
	s = strings.ToLower(strings.TrimSpace(s))
	switch s {
	case "not run", "notrun", "skipped":
		return "skip"
	case "warning":
		return "warn"
	case "failed", "failure":
		return "fail"
	case "passed":
		return "pass"
	}
	return s
}

// gpuIndex reads a gpu_ids value: "0", 0 (a list like "0,1" is node-wide:
// no single GPU).
func gpuIndex(raw json.RawMessage) (uint32, bool) {
	if len(raw) == 0 {
		return 0, false
	}
	var s string
	if json.Unmarshal(raw, &s) != nil {
		s = string(raw)
	}
	n, err := strconv.ParseUint(strings.TrimSpace(s), 10, 32)
	if err != nil {
		return 0, false
	}
	return uint32(n), true
}

// texts reads warnings or info: a string, a list of strings, or a list of
// objects with a "warning" (or "info", "message") string.
func texts(raw json.RawMessage) []string {
	if len(raw) == 0 || string(raw) == "null" {
		return nil
	}
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return nonEmpty([]string{s})
	}
	var list []json.RawMessage
	if json.Unmarshal(raw, &list) != nil {
		return nil
	}
	var out []string
	for _, e := range list {
		if json.Unmarshal(e, &s) == nil {
			out = append(out, s)
			continue
		}
		var o map[string]any
		if json.Unmarshal(e, &o) == nil {
			for _, k := range []string{"warning", "info", "message"} {
				if v, ok := o[k].(string); ok {
					out = append(out, v)
					break
				}
			}
		}
	}
	return nonEmpty(out)
}

func nonEmpty(ss []string) []string {
	out := ss[:0]
	for _, s := range ss {
		if s = strings.TrimSpace(s); s != "" {
			out = append(out, s)
		}
	}
	return out
}

// clip cuts s to at most n characters.
func clip(s string, n int) string {
	if r := []rune(s); len(r) > n {
		return string(r[:n])
	}
	return s
}

// boundedBuffer keeps the first max bytes written and drops the rest.
type boundedBuffer struct {
	bytes.Buffer
	max int
}

func (b *boundedBuffer) Write(p []byte) (int, error) {
	if room := b.max - b.Len(); room > 0 {
		b.Buffer.Write(p[:min(len(p), room)])
	}
	return len(p), nil
}

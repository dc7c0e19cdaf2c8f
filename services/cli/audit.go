package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
)

// errAuditMismatch is a verification that found the chain broken; the
// verdict is already on stdout.
var errAuditMismatch = errors.New("the audit chain does not verify")

func newAudit(stdout, stderr io.Writer) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "audit",
		Short: "Check the audit log",
		Args:  cobra.NoArgs,
	}
	f := &apiFlags{}
	var raw bool
	verify := &cobra.Command{
		Use:   "verify",
		Short: "Recompute the audit hash chain and check its signed checkpoints",
		Long: "verify calls audit.verify (as `api audit.verify tenantId=root` would, with the same URL and token) and prints " +
			"the verdict: how many records were checked, the newest checkpoint, and, when the chain does not verify, " +
			"the first record that does not match and why. It exits 1 when the chain does not verify.",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return runAuditVerify(cmd.Context(), f, raw, cmd.InOrStdin(), stdout, stderr)
		},
	}
	fl := verify.Flags()
	fl.StringVar(&f.url, "url", "", "API base URL (default $"+EnvURL+", client.url, "+DefaultURL+")")
	fl.StringVar(&f.token, "token", "", "API key sent as a bearer token (default $"+EnvToken+", client.token)")
	fl.StringVar(&f.clientConfig, "client-config", "", "client config file (default $"+EnvClientConfig+", ~/.config/better-compute/client.yaml)")
	fl.DurationVar(&f.timeout, "timeout", 5*time.Minute, "how long to wait for the verdict (it reads the whole chain)")
	fl.BoolVar(&raw, "json", false, "print the API's JSON answer instead of the summary")
	cmd.AddCommand(verify)
	return cmd
}

// auditVerdict is audit.verify's answer (proto3 JSON: int64 as strings).
type auditVerdict struct {
	OK               bool   `json:"ok"`
	RecordsChecked   string `json:"recordsChecked"`
	FirstBadRecordID string `json:"firstBadRecordId"`
	Reason           string `json:"reason"`
	RecordsUnchained string `json:"recordsUnchained"`
	LastCheckpoint   *struct {
		ChainSeq  string `json:"chainSeq"`
		HeadHash  string `json:"headHash"`
		Time      string `json:"time"`
		Signature string `json:"signature"`
		KeyID     string `json:"keyId"`
	} `json:"lastCheckpoint"`
}

// runAuditVerify calls audit.verify through the api command's client and
// prints the verdict.
func runAuditVerify(ctx context.Context, f *apiFlags, raw bool, stdin io.Reader, stdout, stderr io.Writer) error {
	var answer bytes.Buffer
	if err := runAPICall(ctx, f, []string{"audit.verify", "tenantId=root"}, stdin, &answer, stderr); err != nil {
		return err
	}
	var v auditVerdict
	if err := json.Unmarshal(answer.Bytes(), &v); err != nil {
		return fmt.Errorf("audit.verify answered something else than a verdict: %w", err)
	}
	if raw {
		if _, err := stdout.Write(answer.Bytes()); err != nil {
			return err
		}
	} else {
		printVerdict(stdout, v)
	}
	if !v.OK {
		return errAuditMismatch
	}
	return nil
}

func printVerdict(w io.Writer, v auditVerdict) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	verdict := "ok"
	if !v.OK {
		verdict = "DOES NOT VERIFY"
	}
	row := func(k, format string, args ...any) {
		fmt.Fprintf(tw, "%s:\t"+format+"\n", append([]any{k}, args...)...)
	}
	row("audit chain", "%s", verdict)
	row("records checked", "%s", v.RecordsChecked)
	row("records unchained", "%s", v.RecordsUnchained)
	if cp := v.LastCheckpoint; cp != nil {
		signed := "unsigned"
		if cp.Signature != "" {
			signed = "signed by key " + cp.KeyID
		}
		row("last checkpoint", "chain position %s at %s, %s", cp.ChainSeq, cp.Time, signed)
	} else {
		row("last checkpoint", "none")
	}
	if v.FirstBadRecordID != "" {
		row("first bad record", "%s", v.FirstBadRecordID)
	}
	if v.Reason != "" {
		label := "reason"
		if v.OK {
			label = "note"
		}
		row(label, "%s", v.Reason)
	}
	_ = tw.Flush()
}

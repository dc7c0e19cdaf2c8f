package metal

import (
	"encoding/json"

	"github.com/jackc/pgx/v5"
	"google.golang.org/protobuf/proto"

	"github.com/bettercompute/bettercompute/proto/resultsig"

	"github.com/bettercompute/bettercompute/pkg/commands"
)

func jsonMarshal(v any) (json.RawMessage, error) { return json.Marshal(v) }

func protoUnmarshal(b []byte, m proto.Message) error { return proto.Unmarshal(b, m) }

func errBadSignature() error { return resultsig.ErrBadSignature }

func collectCommands(rows pgx.Rows, err error) ([]commands.Command, error) {
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (commands.Command, error) { return commands.Scan(r) })
}

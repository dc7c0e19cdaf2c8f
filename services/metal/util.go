package metal

import (
	"encoding/json"

	"google.golang.org/protobuf/proto"

	"github.com/bettercompute/bettercompute/proto/resultsig"
)

func jsonMarshal(v any) (json.RawMessage, error) { return json.Marshal(v) }

func protoUnmarshal(b []byte, m proto.Message) error { return proto.Unmarshal(b, m) }

func errBadSignature() error { return resultsig.ErrBadSignature }

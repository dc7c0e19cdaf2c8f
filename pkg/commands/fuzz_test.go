package commands_test

import (
	"bytes"
	"encoding/json"
	"testing"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"

	"github.com/bettercompute/bettercompute/pkg/commands"
	"github.com/bettercompute/bettercompute/pkg/fault"
)

// FuzzKindEncode feeds commands.run payloads (the REST body's "payload", any
// JSON) to every built-in kind's Encode. Encode never panics; a payload it
// refuses is INVALID_INPUT on "payload" (or a field under it); one it takes
// is a CommandBody holding the kind's message, and encoding that message
// again, as a proto or as its proto3 JSON, gives the same bytes.
func FuzzKindEncode(f *testing.F) {
	kinds := commands.Builtin().Kinds()
	for i := range kinds {
		for _, p := range []string{``, `null`, `{}`, ` {} `, `[]`, `"x"`, `1`, `{"unknown":1}`,
			`{"sources":["agent"]}`, `{"sources":["agent","agent"]}`, `{"sources":["nope"]}`,
			`{"sources":["agent"],"maxBytes":"1048576","since":"3600s"}`, `{"since":"-1.5s"}`, `{"maxBytes":-1}`,
			`{"gpuUuids":["GPU-1"],"level":"quick"}`, `{"sections":["gpus"],"rescan":true}`,
			`{"reason":"maintenance"}`, `{"reason":null}`, `{"sources":[1]}`, `{"sources":["agent"]`} {
			f.Add(uint8(i), []byte(p))
		}
	}
	f.Fuzz(func(t *testing.T, ki uint8, payload []byte) {
		k := kinds[int(ki)%len(kinds)]
		b, err := k.Encode(json.RawMessage(payload))
		if err != nil {
			fe, ok := fault.As(err)
			if !ok || fe.Code != fault.InvalidInput || (fe.Field != "payload" && !bytes.HasPrefix([]byte(fe.Field), []byte("payload."))) {
				t.Fatalf("%s: Encode(%q) = %v, want INVALID_INPUT on payload", k.Name, payload, err)
			}
			return
		}
		var body agentv1.CommandBody
		if err := proto.Unmarshal(b, &body); err != nil {
			t.Fatalf("%s: Encode gave bytes that are not a CommandBody: %v", k.Name, err)
		}
		fd := body.ProtoReflect().Descriptor().Fields().ByName(k.Field)
		if !body.ProtoReflect().Has(fd) {
			t.Fatalf("%s: the body does not hold field %s", k.Name, k.Field)
		}
		msg := body.ProtoReflect().Get(fd).Message().Interface()
		again, err := k.Encode(msg)
		if err != nil || !bytes.Equal(again, b) {
			t.Fatalf("%s: re-encoding the decoded message: %x, %v; want %x", k.Name, again, err, b)
		}
		js, err := protojson.Marshal(msg)
		if err != nil {
			t.Fatalf("%s: protojson.Marshal: %v", k.Name, err)
		}
		again, err = k.Encode(json.RawMessage(js))
		if err != nil || !bytes.Equal(again, b) {
			t.Fatalf("%s: re-encoding %s: %x, %v; want %x", k.Name, js, again, err, b)
		}
	})
}

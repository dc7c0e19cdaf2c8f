package api

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"

	"github.com/grpc-ecosystem/grpc-gateway/v2/runtime"
	"google.golang.org/protobuf/encoding/protojson"

	"github.com/bettercompute/bettercompute/pkg/fault"
)

// RESTMarshaler is the REST gateway's JSON: protojson, unpopulated fields
// written, unknown fields refused, and a body that is exactly one JSON
// value — data after it (`{…}{"junk"`, `{…} trailing`) is INVALID_INPUT
// rather than ignored. White space around the value is fine; an empty body
// is an empty request, as grpc-gateway reads it.
func RESTMarshaler() runtime.Marshaler {
	return &strictJSON{JSONPb: &runtime.JSONPb{
		MarshalOptions:   protojson.MarshalOptions{EmitUnpopulated: true},
		UnmarshalOptions: protojson.UnmarshalOptions{DiscardUnknown: false},
	}}
}

// strictJSON is runtime.JSONPb whose decoder refuses trailing data.
type strictJSON struct {
	*runtime.JSONPb
}

// NewDecoder reads one JSON value from r, refuses anything but white space
// after it, and decodes the value as JSONPb does.
func (m *strictJSON) NewDecoder(r io.Reader) runtime.Decoder {
	return runtime.DecoderFunc(func(v any) error {
		dec := json.NewDecoder(r)
		var raw json.RawMessage
		if err := dec.Decode(&raw); err != nil {
			return err // io.EOF for an empty body: an empty request
		}
		if _, err := dec.Token(); !errors.Is(err, io.EOF) {
			return fault.New(fault.InvalidInput, "", "data after the JSON body: send exactly one JSON object")
		}
		return m.JSONPb.NewDecoder(bytes.NewReader(raw)).Decode(v)
	})
}

package client_test

import (
	"go/parser"
	"go/token"
	"net"
	"os"
	"reflect"
	"strconv"
	"strings"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"
	"github.com/bettercompute/bettercompute/proto/client"
)

// computePackage is the proto package of the API's groups.
const computePackage protoreflect.FullName = "bettercompute.compute.v1"

// computeServices returns every service the compute.v1 proto files declare,
// from the protobuf registry (package computev1 registers them on import).
func computeServices(t *testing.T) []protoreflect.ServiceDescriptor {
	t.Helper()
	var svcs []protoreflect.ServiceDescriptor
	protoregistry.GlobalFiles.RangeFilesByPackage(computePackage, func(fd protoreflect.FileDescriptor) bool {
		for i := range fd.Services().Len() {
			svcs = append(svcs, fd.Services().Get(i))
		}
		return true
	})
	if len(svcs) == 0 {
		t.Fatalf("the registry holds no service of package %s", computePackage)
	}
	return svcs
}

// fieldFor is the Client field of a service: its name without "Service".
func fieldFor(svc protoreflect.ServiceDescriptor) string {
	return strings.TrimSuffix(string(svc.Name()), "Service")
}

// TestClientCoversEveryService fails when a service of the compute.v1 proto
// files has no Client field of its generated client type, or NewClient
// leaves it nil — so a new API group cannot be forgotten here.
func TestClientCoversEveryService(t *testing.T) {
	c := client.NewClient(&client.Conn{})
	v := reflect.ValueOf(c).Elem()
	goPkg := reflect.TypeFor[computev1.SystemServiceClient]().PkgPath()
	clientFields := map[string]bool{}
	for i := range v.NumField() {
		if f := v.Type().Field(i); f.Type.Kind() == reflect.Interface {
			clientFields[f.Name] = true
		}
	}
	for _, svc := range computeServices(t) {
		name := fieldFor(svc)
		delete(clientFields, name)
		f, ok := v.Type().FieldByName(name)
		if !ok {
			t.Errorf("service %s: Client has no field %s (add it to Client and NewClient)", svc.FullName(), name)
			continue
		}
		if want := string(svc.Name()) + "Client"; f.Type.Name() != want || f.Type.PkgPath() != goPkg {
			t.Errorf("Client.%s is a %s.%s, want %s.%s", name, f.Type.PkgPath(), f.Type.Name(), goPkg, want)
		}
		if v.FieldByName(name).IsNil() {
			t.Errorf("NewClient leaves Client.%s nil", name)
		}
	}
	for name := range clientFields {
		t.Errorf("Client.%s matches no service of %s", name, computePackage)
	}
}

// TestClientRoutesEveryMethod calls every method of every group through a
// Client and checks each reaches the server as its own full method name, so
// no field is wired to another group's client.
func TestClientRoutesEveryMethod(t *testing.T) {
	t.Parallel()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	// A server with no services: every call lands here and fails with the
	// method it was for.
	s := grpc.NewServer(grpc.UnknownServiceHandler(func(_ any, stream grpc.ServerStream) error {
		m, _ := grpc.MethodFromServerStream(stream)
		return status.Error(codes.Unimplemented, "reached "+m)
	}))
	go func() { _ = s.Serve(lis) }()
	t.Cleanup(s.Stop)
	conn, err := client.New(lis.Addr().String(), client.WithInsecure())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	c := reflect.ValueOf(client.NewClient(conn)).Elem()

	ctx := reflect.ValueOf(t.Context())
	calls := 0
	for _, svc := range computeServices(t) {
		group := c.FieldByName(fieldFor(svc))
		if !group.IsValid() {
			continue // TestClientCoversEveryService reports it
		}
		for i := range svc.Methods().Len() {
			md := svc.Methods().Get(i)
			want := "reached /" + string(svc.FullName()) + "/" + string(md.Name())
			m := group.MethodByName(string(md.Name()))
			if !m.IsValid() {
				t.Errorf("Client.%s has no method %s", fieldFor(svc), md.Name())
				continue
			}
			var err error
			switch {
			case md.IsStreamingClient() && md.IsStreamingServer():
				// A bidirectional stream (tunnels.Connect): opened with the
				// context alone, its first Recv says where it landed.
				out := m.Call([]reflect.Value{ctx})
				if e, _ := out[1].Interface().(error); e != nil {
					err = e
				} else {
					err, _ = out[0].MethodByName("Recv").Call(nil)[1].Interface().(error)
				}
			case md.IsStreamingClient():
				t.Errorf("%s: client streaming is not covered by this test yet", md.FullName())
				continue
			case md.IsStreamingServer():
				out := m.Call([]reflect.Value{ctx, reflect.New(m.Type().In(1).Elem())})
				if e, _ := out[1].Interface().(error); e != nil {
					err = e
				} else {
					err, _ = out[0].MethodByName("Recv").Call(nil)[1].Interface().(error)
				}
			default:
				out := m.Call([]reflect.Value{ctx, reflect.New(m.Type().In(1).Elem())})
				err, _ = out[1].Interface().(error)
			}
			if got := status.Convert(err); got.Code() != codes.Unimplemented || got.Message() != want {
				t.Errorf("Client.%s.%s: %v, want %q", fieldFor(svc), md.Name(), err, want)
			}
			calls++
		}
	}
	if calls == 0 {
		t.Fatal("no method called")
	}
}

// TestImportsGRPCAndProtobufOnly keeps the package's own imports to the
// standard library, grpc, protobuf (with the google.rpc error details) and
// the API's generated package.
func TestImportsGRPCAndProtobufOnly(t *testing.T) {
	t.Parallel()
	allowed := []string{"google.golang.org/grpc", "google.golang.org/protobuf/", "google.golang.org/genproto/googleapis/rpc/",
		"github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"}
	files, err := os.ReadDir(".")
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range files {
		if !strings.HasSuffix(f.Name(), ".go") || strings.HasSuffix(f.Name(), "_test.go") {
			continue
		}
		parsed, err := parser.ParseFile(token.NewFileSet(), f.Name(), nil, parser.ImportsOnly)
		if err != nil {
			t.Fatal(err)
		}
		for _, imp := range parsed.Imports {
			path, _ := strconv.Unquote(imp.Path.Value)
			first, _, _ := strings.Cut(path, "/")
			if !strings.Contains(first, ".") {
				continue // the standard library
			}
			ok := false
			for _, a := range allowed {
				ok = ok || path == a || strings.HasPrefix(path, a) && (strings.HasSuffix(a, "/") || strings.HasPrefix(path, a+"/"))
			}
			if !ok {
				t.Errorf("%s imports %s", f.Name(), path)
			}
		}
	}
}

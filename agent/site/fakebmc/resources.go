package fakebmc

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"strings"
)

const (
	root           = "/redfish/v1"
	systemsPath    = root + "/Systems"
	sessionSvcPath = root + "/SessionService"
	sessionsPath   = sessionSvcPath + "/Sessions"
)

func link(path string) map[string]any { return map[string]any{"@odata.id": path} }

func (b *BMC) systemPath() string { return systemsPath + "/" + b.machine.SystemID }

func (b *BMC) serviceRoot() map[string]any {
	return map[string]any{
		"@odata.id":      root + "/",
		"@odata.type":    "#ServiceRoot.v1_15_0.ServiceRoot",
		"Id":             "RootService",
		"Name":           "Root Service",
		"RedfishVersion": "1.17.0",
		"UUID":           b.machine.UUID,
		"Systems":        link(systemsPath),
		"SessionService": link(sessionSvcPath),
		"Links":          map[string]any{"Sessions": link(sessionsPath)},
	}
}

func collection(path, typ, name string, members []string) map[string]any {
	ms := make([]any, 0, len(members))
	for _, m := range members {
		ms = append(ms, link(m))
	}
	return map[string]any{
		"@odata.id":           path,
		"@odata.type":         "#" + typ + "." + typ,
		"Name":                name,
		"Members":             ms,
		"Members@odata.count": len(ms),
	}
}

// route serves every authenticated path.
func (b *BMC) route(w http.ResponseWriter, r *http.Request, path string) {
	b.mu.Lock()
	sys := b.systemPath()
	b.mu.Unlock()

	switch {
	case path == systemsPath:
		if allow(w, r, http.MethodGet) {
			writeJSON(w, http.StatusOK, collection(systemsPath, "ComputerSystemCollection", "Computer System Collection", []string{sys}))
		}
	case path == sys:
		switch r.Method {
		case http.MethodGet:
			b.mu.Lock()
			body, etag := b.system(), b.etag()
			b.mu.Unlock()
			w.Header().Set("ETag", etag)
			writeJSON(w, http.StatusOK, body)
		case http.MethodPatch:
			b.patchSystem(w, r)
		default:
			allow(w, r, http.MethodGet, http.MethodPatch)
		}
	case path == sys+"/Actions/ComputerSystem.Reset":
		if allow(w, r, http.MethodPost) {
			b.reset(w, r)
		}
	case path == sys+"/ResetActionInfo":
		if allow(w, r, http.MethodGet) {
			writeJSON(w, http.StatusOK, map[string]any{
				"@odata.id":   path,
				"@odata.type": "#ActionInfo.v1_3_0.ActionInfo",
				"Id":          "ResetActionInfo",
				"Name":        "Reset Action Info",
				"Parameters": []any{map[string]any{
					"Name": "ResetType", "Required": true, "DataType": "String", "AllowableValues": resetTypes,
				}},
			})
		}
	case path == sessionSvcPath:
		if allow(w, r, http.MethodGet) {
			writeJSON(w, http.StatusOK, map[string]any{
				"@odata.id":      sessionSvcPath,
				"@odata.type":    "#SessionService.v1_1_9.SessionService",
				"Id":             "SessionService",
				"Name":           "Session Service",
				"ServiceEnabled": true,
				"SessionTimeout": 1800,
				"Sessions":       link(sessionsPath),
			})
		}
	case path == sessionsPath:
		if allow(w, r, http.MethodGet, http.MethodPost) {
			b.mu.Lock()
			var ids []string
			for id := range b.sessions {
				ids = append(ids, sessionsPath+"/"+id)
			}
			b.mu.Unlock()
			slices.Sort(ids)
			writeJSON(w, http.StatusOK, collection(sessionsPath, "SessionCollection", "Session Collection", ids))
		}
	case strings.HasPrefix(path, sessionsPath+"/"):
		b.sessionResource(w, r, path, strings.TrimPrefix(path, sessionsPath+"/"))
	case strings.HasPrefix(path, sys+"/"):
		if allow(w, r, http.MethodGet) {
			b.mu.Lock()
			body, ok := b.subresource(sys, strings.TrimPrefix(path, sys+"/"))
			b.mu.Unlock()
			if !ok {
				notFound(w, path)
				return
			}
			writeJSON(w, http.StatusOK, body)
		}
	default:
		notFound(w, path)
	}
}

// etag is the system's entity tag; b.mu is held.
func (b *BMC) etag() string { return `W/"` + strconv.Itoa(b.generation) + `"` }

// system is the ComputerSystem; b.mu is held.
func (b *BMC) system() map[string]any {
	m := b.machine
	sys := b.systemPath()
	cores, threads, memMiB := 0, 0, 0
	for _, c := range m.CPUs {
		cores += c.Cores
		threads += c.Threads
	}
	for _, d := range m.DIMMs {
		memMiB += d.CapacityMiB
	}
	cpuModel := ""
	if len(m.CPUs) > 0 {
		cpuModel = m.CPUs[0].Model
	}
	return map[string]any{
		"@odata.id":    sys,
		"@odata.type":  "#ComputerSystem.v1_20_0.ComputerSystem",
		"Id":           m.SystemID,
		"Name":         "System",
		"SystemType":   "Physical",
		"Manufacturer": m.Manufacturer,
		"Model":        m.Model,
		"SerialNumber": m.SerialNumber,
		"UUID":         m.UUID,
		"PowerState":   powerState(b.powerOn),
		"Status":       map[string]any{"State": "Enabled", "Health": "OK"},
		"Boot": map[string]any{
			"BootSourceOverrideEnabled":                         b.override,
			"BootSourceOverrideTarget":                          b.target,
			"BootSourceOverrideMode":                            "UEFI",
			"BootSourceOverrideEnabled@Redfish.AllowableValues": overrideValues,
			"BootSourceOverrideTarget@Redfish.AllowableValues":  targetValues,
		},
		"ProcessorSummary": map[string]any{
			"Count": len(m.CPUs), "CoreCount": cores, "LogicalProcessorCount": threads, "Model": cpuModel,
			"Status": map[string]any{"State": "Enabled", "Health": "OK"},
		},
		"MemorySummary": map[string]any{
			"TotalSystemMemoryGiB": float64(memMiB) / 1024,
			"Status":               map[string]any{"State": "Enabled", "Health": "OK"},
		},
		"Processors":         link(sys + "/Processors"),
		"Memory":             link(sys + "/Memory"),
		"EthernetInterfaces": link(sys + "/EthernetInterfaces"),
		"Storage":            link(sys + "/Storage"),
		"Actions": map[string]any{
			"#ComputerSystem.Reset": map[string]any{
				"target":                            sys + "/Actions/ComputerSystem.Reset",
				"ResetType@Redfish.AllowableValues": resetTypes,
				"@Redfish.ActionInfo":               sys + "/ResetActionInfo",
			},
		},
	}
}

// subresource serves the system's collections and members; b.mu is held.
func (b *BMC) subresource(sys, rest string) (map[string]any, bool) {
	m := b.machine
	parts := strings.Split(rest, "/")
	member := func(prefix string, n int) (int, bool) {
		if len(parts) != 2 || !strings.HasPrefix(parts[1], prefix) {
			return 0, false
		}
		i, err := strconv.Atoi(strings.TrimPrefix(parts[1], prefix))
		if err != nil || i < 1 || i > n || strconv.Itoa(i) != strings.TrimPrefix(parts[1], prefix) {
			return 0, false
		}
		return i - 1, true
	}
	members := func(base, prefix string, n int) []string {
		out := make([]string, n)
		for i := range n {
			out[i] = fmt.Sprintf("%s/%s%d", base, prefix, i+1)
		}
		return out
	}
	self := sys + "/" + rest
	switch parts[0] {
	case "Processors":
		if len(parts) == 1 {
			return collection(self, "ProcessorCollection", "Processors Collection", members(self, "CPU", len(m.CPUs))), true
		}
		i, ok := member("CPU", len(m.CPUs))
		if !ok {
			return nil, false
		}
		c := m.CPUs[i]
		return map[string]any{
			"@odata.id": self, "@odata.type": "#Processor.v1_18_0.Processor",
			"Id": parts[1], "Name": "Processor", "Socket": fmt.Sprintf("CPU %d", i+1),
			"ProcessorType": "CPU", "Manufacturer": c.Manufacturer, "Model": c.Model,
			"TotalCores": c.Cores, "TotalThreads": c.Threads,
			"Status": map[string]any{"State": "Enabled", "Health": "OK"},
		}, true
	case "Memory":
		if len(parts) == 1 {
			return collection(self, "MemoryCollection", "Memory Collection", members(self, "DIMM", len(m.DIMMs))), true
		}
		i, ok := member("DIMM", len(m.DIMMs))
		if !ok {
			return nil, false
		}
		d := m.DIMMs[i]
		return map[string]any{
			"@odata.id": self, "@odata.type": "#Memory.v1_17_0.Memory",
			"Id": parts[1], "Name": "DIMM", "MemoryDeviceType": "DDR5",
			"CapacityMiB": d.CapacityMiB, "SerialNumber": d.SerialNumber,
			"Status": map[string]any{"State": "Enabled", "Health": "OK"},
		}, true
	case "EthernetInterfaces":
		if len(parts) == 1 {
			return collection(self, "EthernetInterfaceCollection", "Ethernet Interface Collection", members(self, "NIC", len(m.NICs))), true
		}
		i, ok := member("NIC", len(m.NICs))
		if !ok {
			return nil, false
		}
		n := m.NICs[i]
		return map[string]any{
			"@odata.id": self, "@odata.type": "#EthernetInterface.v1_10_0.EthernetInterface",
			"Id": parts[1], "Name": fmt.Sprintf("NIC %d", i+1),
			"MACAddress": n.MAC, "PermanentMACAddress": n.MAC, "SpeedMbps": n.SpeedMbps,
			"LinkStatus": "LinkUp", "InterfaceEnabled": true,
			"Status": map[string]any{"State": "Enabled", "Health": "OK"},
		}, true
	case "Storage":
		if len(parts) == 1 {
			return collection(self, "StorageCollection", "Storage Collection", []string{self + "/1"}), true
		}
		if parts[1] != "1" {
			return nil, false
		}
		drives := members(sys+"/Storage/1/Drives", "Disk", len(m.Disks))
		if len(parts) == 2 {
			ds := make([]any, 0, len(drives))
			for _, d := range drives {
				ds = append(ds, link(d))
			}
			return map[string]any{
				"@odata.id": self, "@odata.type": "#Storage.v1_15_0.Storage",
				"Id": "1", "Name": "Storage", "Drives": ds, "Drives@odata.count": len(ds),
				"Status": map[string]any{"State": "Enabled", "Health": "OK"},
			}, true
		}
		if len(parts) != 4 || parts[2] != "Drives" {
			return nil, false
		}
		parts = []string{"", parts[3]}
		i, ok := member("Disk", len(m.Disks))
		if !ok {
			return nil, false
		}
		d := m.Disks[i]
		media := d.MediaType
		if media == "" {
			media = "SSD"
		}
		return map[string]any{
			"@odata.id": self, "@odata.type": "#Drive.v1_17_0.Drive",
			"Id": parts[1], "Name": d.Model, "Model": d.Model, "SerialNumber": d.SerialNumber,
			"CapacityBytes": d.CapacityBytes, "MediaType": media, "Protocol": "NVMe",
			"Status": map[string]any{"State": "Enabled", "Health": "OK"},
		}, true
	}
	return nil, false
}

// decode reads a JSON object body into v, answering 400 on failure.
func decode(w http.ResponseWriter, r *http.Request, v any) bool {
	if err := json.NewDecoder(r.Body).Decode(v); err != nil {
		var tooBig *http.MaxBytesError
		if errors.As(err, &tooBig) {
			writeError(w, http.StatusRequestEntityTooLarge, "Base.1.16.PayloadTooLarge", "The request body is too large.")
			return false
		}
		writeError(w, http.StatusBadRequest, "Base.1.16.MalformedJSON", "The request body submitted was malformed JSON.")
		return false
	}
	return true
}

// patchSystem applies a PATCH of the boot override.
func (b *BMC) patchSystem(w http.ResponseWriter, r *http.Request) {
	var body map[string]json.RawMessage
	if !decode(w, r, &body) {
		return
	}
	var boot map[string]json.RawMessage
	for k, v := range body {
		if k != "Boot" {
			writeError(w, http.StatusBadRequest, "Base.1.16.PropertyNotWritable",
				fmt.Sprintf("The property %s is a read only property and cannot be assigned a value.", safeName(k)))
			return
		}
		if err := json.Unmarshal(v, &boot); err != nil {
			writeError(w, http.StatusBadRequest, "Base.1.16.PropertyValueTypeError", "The value for the property Boot is of a different type than the property can accept.")
			return
		}
	}
	if len(boot) == 0 {
		writeError(w, http.StatusBadRequest, "Base.1.16.NoOperation", "The request body submitted contain no data to act upon.")
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if im := r.Header.Get("If-Match"); im != "" && im != "*" && im != b.etag() {
		writeError(w, http.StatusPreconditionFailed, "Base.1.16.PreconditionFailed",
			"The ETag supplied did not match the ETag required to change this resource.")
		return
	}
	enabled, target := b.override, b.target
	for k, v := range boot {
		var s string
		if err := json.Unmarshal(v, &s); err != nil {
			writeError(w, http.StatusBadRequest, "Base.1.16.PropertyValueTypeError",
				fmt.Sprintf("The value for the property %s is of a different type than the property can accept.", safeName(k)))
			return
		}
		switch k {
		case "BootSourceOverrideEnabled":
			if !slices.Contains(overrideValues, s) {
				writeError(w, http.StatusBadRequest, "Base.1.16.PropertyValueNotInList",
					fmt.Sprintf("The value %s for the property BootSourceOverrideEnabled is not in the list of acceptable values.", safeName(s)))
				return
			}
			enabled = s
		case "BootSourceOverrideTarget":
			if !slices.Contains(targetValues, s) {
				writeError(w, http.StatusBadRequest, "Base.1.16.PropertyValueNotInList",
					fmt.Sprintf("The value %s for the property BootSourceOverrideTarget is not in the list of acceptable values.", safeName(s)))
				return
			}
			target = s
		case "BootSourceOverrideMode":
			if s != "UEFI" {
				writeError(w, http.StatusBadRequest, "Base.1.16.PropertyValueNotInList",
					"The value for the property BootSourceOverrideMode is not in the list of acceptable values.")
				return
			}
		default:
			writeError(w, http.StatusBadRequest, "Base.1.16.PropertyNotWritable",
				fmt.Sprintf("The property %s is a read only property and cannot be assigned a value.", safeName(k)))
			return
		}
	}
	b.override, b.target = enabled, target
	b.generation++
	b.record("BootOverride", enabled+"/"+target)
	w.Header().Set("ETag", b.etag())
	w.WriteHeader(http.StatusNoContent)
}

// reset performs ComputerSystem.Reset.
func (b *BMC) reset(w http.ResponseWriter, r *http.Request) {
	var body struct{ ResetType string }
	if !decode(w, r, &body) {
		return
	}
	if body.ResetType == "" {
		writeError(w, http.StatusBadRequest, "Base.1.16.ActionParameterMissing",
			"The action ComputerSystem.Reset requires the parameter ResetType to be present in the request body.")
		return
	}
	if !slices.Contains(resetTypes, body.ResetType) {
		writeError(w, http.StatusBadRequest, "Base.1.16.ActionParameterValueNotInList",
			fmt.Sprintf("The value %s for the parameter ResetType in the action ComputerSystem.Reset is not in the list of acceptable values.", safeName(body.ResetType)))
		return
	}

	b.mu.Lock()
	if im := r.Header.Get("If-Match"); im != "" && im != "*" && im != b.etag() {
		b.mu.Unlock()
		writeError(w, http.StatusPreconditionFailed, "Base.1.16.PreconditionFailed",
			"The ETag supplied did not match the ETag required to change this resource.")
		return
	}
	was := b.powerOn
	var off, boot bool
	switch body.ResetType {
	case ResetOn:
		boot = !was
	case ResetForceOff, ResetGracefulShutdown:
		off = was
	case ResetForceRestart:
		off, boot = was, was
	case ResetPowerCycle:
		off, boot = was, true
	}
	if !off && !boot {
		b.mu.Unlock()
		writeError(w, http.StatusConflict, "Base.1.16.ActionNotSupported",
			fmt.Sprintf("The system is already powered %s.", strings.ToLower(powerState(was))))
		return
	}
	b.record("Reset", body.ResetType)
	var offHook func()
	if off {
		b.powerOn = false
		b.record("PowerOff", body.ResetType)
		offHook = b.onPowerOff
	}
	target := ""
	var onHook func(string)
	if boot {
		b.powerOn = true
		target = b.machine.DefaultBoot
		if b.override != OverrideDisabled && b.target != TargetNone {
			target = b.target
		}
		if b.override == OverrideOnce {
			b.override, b.target = OverrideDisabled, TargetNone
		}
		b.record("Boot", target)
		onHook = b.onPowerOn
	}
	b.generation++
	b.mu.Unlock()

	if offHook != nil {
		offHook()
	}
	if onHook != nil {
		onHook(target)
	}
	w.WriteHeader(http.StatusNoContent)
}

// createSession serves POST .../Sessions and returns the user name for the log.
func (b *BMC) createSession(w http.ResponseWriter, r *http.Request) string {
	var body struct{ UserName, Password string }
	if !decode(w, r, &body) {
		return ""
	}
	if len(body.UserName) > maxCredential || len(body.Password) > maxCredential ||
		!equal(body.UserName, b.cfg.Username) || !equal(body.Password, b.cfg.Password) {
		writeError(w, http.StatusUnauthorized, "Base.1.16.NoValidSession",
			"The user name or password is not valid.")
		return ""
	}
	b.mu.Lock()
	if len(b.sessions) >= maxSessions {
		b.mu.Unlock()
		writeError(w, http.StatusServiceUnavailable, "Base.1.16.SessionLimitExceeded",
			"The session establishment failed due to the number of simultaneous sessions exceeding the limit of the implementation.")
		return body.UserName
	}
	b.nextSess++
	s := &session{id: strconv.Itoa(b.nextSess), token: newToken(), user: body.UserName}
	b.sessions[s.id] = s
	b.record("SessionCreate", s.user)
	b.mu.Unlock()

	loc := sessionsPath + "/" + s.id
	w.Header().Set("Location", loc)
	w.Header().Set("X-Auth-Token", s.token)
	writeJSON(w, http.StatusCreated, sessionBody(s))
	return body.UserName
}

func sessionBody(s *session) map[string]any {
	return map[string]any{
		"@odata.id":   sessionsPath + "/" + s.id,
		"@odata.type": "#Session.v1_6_0.Session",
		"Id":          s.id,
		"Name":        "User Session",
		"UserName":    s.user,
	}
}

func (b *BMC) sessionResource(w http.ResponseWriter, r *http.Request, path, id string) {
	b.mu.Lock()
	s, ok := b.sessions[id]
	b.mu.Unlock()
	if !ok {
		notFound(w, path)
		return
	}
	switch r.Method {
	case http.MethodGet:
		writeJSON(w, http.StatusOK, sessionBody(s))
	case http.MethodDelete:
		b.mu.Lock()
		delete(b.sessions, id)
		b.record("SessionDelete", s.user)
		b.mu.Unlock()
		w.WriteHeader(http.StatusNoContent)
	default:
		allow(w, r, http.MethodGet, http.MethodDelete)
	}
}

// allow answers 405 unless r's method is one of methods.
func allow(w http.ResponseWriter, r *http.Request, methods ...string) bool {
	if slices.Contains(methods, r.Method) {
		return true
	}
	w.Header().Set("Allow", strings.Join(methods, ", "))
	writeError(w, http.StatusMethodNotAllowed, "Base.1.16.OperationNotAllowed",
		"The HTTP method is not allowed on this resource.")
	return false
}

func notFound(w http.ResponseWriter, path string) {
	writeError(w, http.StatusNotFound, "Base.1.16.ResourceMissingAtURI",
		fmt.Sprintf("The resource at the URI %s was not found.", safeName(path)))
}

// safeName bounds a client-supplied string echoed in an error message.
func safeName(s string) string {
	if len(s) > 64 {
		s = s[:64] + "…"
	}
	return strconv.Quote(s)
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json; charset=utf-8")
	w.Header().Set("OData-Version", "4.0")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

// writeError writes a Redfish error response.
func writeError(w http.ResponseWriter, status int, id, msg string) {
	writeJSON(w, status, map[string]any{"error": map[string]any{
		"code":    id,
		"message": msg,
		"@Message.ExtendedInfo": []any{map[string]any{
			"@odata.type": "#Message.v1_1_2.Message",
			"MessageId":   id,
			"Message":     msg,
			"Severity":    "Warning",
		}},
	}})
}

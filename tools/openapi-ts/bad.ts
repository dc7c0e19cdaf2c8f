// bad.ts — calls the generated types must refuse (TestTypeScriptClient
// expects tsc to fail on exactly these lines, proving it checks the calls).
import type { components, paths } from "./compute";

type NodesGetRequest = paths["/api/compute/nodes/get"]["post"]["requestBody"]["content"]["application/json"];

export const wrongType: NodesGetRequest = { tenantId: 42 }; // BAD: tenantId is a string
export const notACode: components["schemas"]["ErrorCode"] = "NOPE"; // BAD: no such code
export const noMessage: components["schemas"]["Error"] = { code: "INTERNAL" }; // BAD: message is required

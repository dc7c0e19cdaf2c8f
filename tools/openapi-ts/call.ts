// call.ts — a typed call of the Better Compute REST API through the types
// openapi-typescript generates from proto/openapi/compute.openapi.json
// (written next to this file as compute.ts by tools/cmd/openapi3's
// TestTypeScriptClient, then type-checked with tsc --noEmit). It compiles
// only if the document describes nodes.get's request and response, the
// error envelope and every stable error code.
import type { components, paths } from "./compute";

type NodesGet = paths["/api/compute/nodes/get"]["post"];
export type NodesGetRequest = NodesGet["requestBody"]["content"]["application/json"];
export type NodesGetResponse = NodesGet["responses"][200]["content"]["application/json"];

// The envelope every error response carries: {"code","message","field"}.
export type ApiError = components["schemas"]["Error"];
export type ErrorCode = components["schemas"]["ErrorCode"];

// An API key, sent as a bearer token (components.securitySchemes.bearer).
export type ApiKey = `bck_${string}.${string}`;

export class BetterComputeError extends Error {
  constructor(
    readonly status: number,
    readonly body: ApiError,
  ) {
    super(`${body.code}${body.field ? " " + body.field : ""}: ${body.message}`);
  }
}

// getNode is nodes.get: POST /api/compute/nodes/get with the bearer header.
export async function getNode(base: string, key: ApiKey, req: NodesGetRequest): Promise<NodesGetResponse> {
  const resp = await fetch(`${base}/api/compute/nodes/get`, {
    method: "POST",
    headers: { Authorization: `Bearer ${key}`, "Content-Type": "application/json" },
    body: JSON.stringify(req),
  });
  if (!resp.ok) {
    // The default response and each documented status are the envelope.
    const err: NodesGet["responses"]["default"]["content"]["application/json"] = await resp.json();
    const notFound: NodesGet["responses"][404]["content"]["application/json"] = err;
    throw new BetterComputeError(resp.status, notFound);
  }
  return (await resp.json()) as NodesGetResponse;
}

// retryable switches over every stable code: a code missing from the enum,
// or one the enum has and this does not, fails to compile.
export function retryable(code: ErrorCode): boolean {
  switch (code) {
    case "INVALID_INPUT":
    case "INVALID_CONFIG":
    case "UNAUTHENTICATED":
    case "ACCESS_DENIED":
    case "NOT_FOUND":
    case "CONFLICT":
    case "UNSUPPORTED":
    case "QUOTA_EXCEEDED":
      return false;
    case "NO_CAPACITY":
    case "RATE_LIMITED":
    case "UNAVAILABLE":
    case "INTERNAL":
      return true;
    default: {
      const unhandled: never = code;
      return unhandled;
    }
  }
}

export async function example(base: string, key: ApiKey): Promise<string | undefined> {
  try {
    const res = await getNode(base, key, { tenantId: "root" });
    const hostname: string | undefined = res.node?.hostname;
    return hostname;
  } catch (e) {
    if (e instanceof BetterComputeError && e.body.code === "NOT_FOUND") {
      return undefined;
    }
    throw e;
  }
}

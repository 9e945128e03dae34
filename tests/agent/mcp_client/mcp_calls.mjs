// Calls cellblock-gateway's /mcp tools in order with the official MCP TypeScript SDK client (Streamable HTTP
// transport) and prints one JSON array on stdout: per call {"result": CallToolResult} or, when the SDK threw
// (a JSON-RPC error), {"error": {"code", "message", "data"}}. Used by tests/agent/test_agent_parity.py to
// compare the MCP answer of an operation with the REST one.
// Usage: GATEWAY_URL=http://127.0.0.1:PORT GATEWAY_TOKEN=... node mcp_calls.mjs '[{"name": ..., "arguments": {...}}]'
// A call may add "timeout_s": how long to wait for its answer (default 300; the SDK then reports a timeout error).
import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";

const calls = JSON.parse(process.argv[2]);
const transport = new StreamableHTTPClientTransport(new URL("/mcp", process.env.GATEWAY_URL), {
  requestInit: { headers: { Authorization: `token ${process.env.GATEWAY_TOKEN}` } },
});
const client = new Client({ name: "cellblock-parity-tests", version: "0.1.0" });

try {
  await client.connect(transport);
  const answers = [];
  for (const { timeout_s = 300, ...call } of calls) {
    try {
      answers.push({ result: await client.callTool(call, undefined, { timeout: timeout_s * 1000 }) });
    } catch (error) {
      if (typeof error?.code !== "number") throw error;  // not a JSON-RPC error: the client itself failed
      answers.push({ error: { code: error.code, message: error.message, data: error.data ?? null } });
    }
  }
  await client.close();
  process.stdout.write(JSON.stringify(answers));
} catch (error) {
  process.stderr.write(`MCP client failed: ${error?.stack ?? error}\n`);
  process.exit(1);
}

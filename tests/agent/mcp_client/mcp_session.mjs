// Drives cellblock-gateway's /mcp endpoint with the official MCP TypeScript SDK client over the Streamable HTTP
// transport, and prints what each call returned as one JSON document on stdout for tests/agent/test_mcp.py to check.
// Usage: GATEWAY_URL=http://127.0.0.1:PORT GATEWAY_TOKEN=... MCP_SESSION=name node mcp_session.mjs
import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";

const url = new URL("/mcp", process.env.GATEWAY_URL);
const session = process.env.MCP_SESSION ?? "mcp-test";
const transport = new StreamableHTTPClientTransport(url, {
  requestInit: { headers: { Authorization: `token ${process.env.GATEWAY_TOKEN}` } },
});
const client = new Client({ name: "cellblock-agent-tests", version: "0.1.0" });

const report = {};
try {
  await client.connect(transport);
  report.server = client.getServerVersion();
  report.protocolVersion = transport.protocolVersion ?? null;
  report.tools = (await client.listTools()).tools.map((tool) => tool.name);
  report.upload = await client.callTool({
    name: "upload_file",
    arguments: { session, path: "data/sales.csv", content: "product,units\napple,3\npear,5\napple,4\n" },
  });
  report.list = await client.callTool({ name: "list_files", arguments: { session } });
  report.run = await client.callTool({
    name: "run_python",
    arguments: {
      session,
      code: "import pandas as pd\ntotals = pd.read_csv('data/sales.csv').groupby('product').units.sum()\nprint(totals.to_csv())\ntotals['apple'] * 6",
    },
  });
  report.state = await client.callTool({ name: "run_python", arguments: { session, code: "totals['pear']" } });
  report.error = await client.callTool({ name: "run_python", arguments: { session, code: "1/0" } });
  report.read = await client.callTool({ name: "read_file", arguments: { session, path: "data/sales.csv" } });
  report.escape = await client.callTool({ name: "read_file", arguments: { session, path: "../etc/passwd" } });
  report.reset = await client.callTool({ name: "reset_session", arguments: { session } });
  report.after_reset = await client.callTool({ name: "run_python", arguments: { session, code: "'totals' in globals()" } });
  await client.close();
  process.stdout.write(JSON.stringify(report));
} catch (error) {
  process.stderr.write(`MCP client failed: ${error?.stack ?? error}\n`);
  process.exit(1);
}

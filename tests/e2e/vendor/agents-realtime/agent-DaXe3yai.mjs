var z = Object.defineProperty;
var X = (t, i, e) => i in t ? z(t, i, { enumerable: !0, configurable: !0, writable: !0, value: e }) : t[i] = e;
var o = (t, i, e) => X(t, typeof i != "symbol" ? i + "" : i, e);
import { Capability as S, UserError as b, requireBoundSession as U, tool as w, object as k, string as d, applyPatchTool as q, withSandboxSpan as I, isRecord as R, encodeUint8ArrayToBase64 as G, ApplyPatchOperation as Y, number as m, boolean as N, prompt as A, Agent as J, SANDBOX_AGENT_BRAND as V, cloneManifest as Q, Manifest as Z, normalizeUser as ee } from "./index-D3yXDbeW.mjs";
function te(t) {
  return t ? !(typeof t == "object" && t && "constructor" in t && typeof t.constructor == "function" ? t.constructor.name : "").includes("ChatCompletions") : !0;
}
function ie(t) {
  return j(t);
}
function j(t) {
  return t ? !(typeof t == "object" && t && "constructor" in t && typeof t.constructor == "function" ? t.constructor.name : "").includes("ChatCompletions") : !1;
}
class ne {
}
class se extends ne {
  constructor(e = 0.9, n = 24e4) {
    super();
    o(this, "thresholdRatio");
    o(this, "fallbackThreshold");
    if (!Number.isFinite(e) || e < 0 || e > 1)
      throw new b("DynamicCompactionPolicy.thresholdRatio must be a finite number between 0 and 1.");
    this.thresholdRatio = e, this.fallbackThreshold = n;
  }
  compactThreshold(e) {
    if (!e)
      return this.fallbackThreshold;
    const n = f.forModel(e);
    return n ? Math.floor(n.contextWindow * this.thresholdRatio) : this.fallbackThreshold;
  }
}
class f {
  constructor(i) {
    o(this, "contextWindow");
    this.contextWindow = i;
  }
  static forModel(i) {
    for (const e of ae(i)) {
      if (ce.has(e))
        return new f(1047576);
      if (le.has(e))
        return new f(4e5);
      if (pe.has(e))
        return new f(2e5);
      if (ue.has(e))
        return new f(128e3);
    }
  }
}
class re extends S {
  constructor(e = new se()) {
    super();
    o(this, "type", "compaction");
    o(this, "policy");
    this.policy = e;
  }
  samplingParams(e) {
    if (e.modelInstance && !te(e.modelInstance))
      return {};
    const n = typeof e.model == "string" ? e.model : void 0;
    return {
      context_management: [
        {
          type: "compaction",
          compact_threshold: this.policy.compactThreshold(n)
        }
      ]
    };
  }
  processContext(e) {
    let n = -1;
    for (let s = 0; s < e.length; s += 1)
      e[s].type === "compaction" && (n = s);
    return n === -1 ? e : e.slice(n);
  }
}
function oe(t = {}) {
  return new re(t.policy);
}
function ae(t) {
  const i = t.trim();
  if (!i)
    return [];
  const n = (i.includes("/") ? i.slice(i.lastIndexOf("/") + 1) : i).toLowerCase(), s = n.replace(/-\d{4}-\d{2}-\d{2}$/u, "");
  return [.../* @__PURE__ */ new Set([n, s])];
}
const ce = /* @__PURE__ */ new Set([
  "gpt-5.6",
  "gpt-5.6-sol",
  "gpt-5.6-terra",
  "gpt-5.6-luna",
  "gpt-5.4",
  "gpt-5.4-2026-03-05",
  "gpt-5.4-pro",
  "gpt-5.4-pro-2026-03-05",
  "gpt-4.1",
  "gpt-4.1-2025-04-14",
  "gpt-4.1-mini",
  "gpt-4.1-mini-2025-04-14",
  "gpt-4.1-nano",
  "gpt-4.1-nano-2025-04-14"
]), le = /* @__PURE__ */ new Set([
  "gpt-5",
  "gpt-5-codex",
  "gpt-5-mini",
  "gpt-5-nano",
  "gpt-5-pro",
  "gpt-5.1",
  "gpt-5.1-codex",
  "gpt-5.1-codex-max",
  "gpt-5.1-codex-mini",
  "gpt-5.2",
  "gpt-5.2-codex",
  "gpt-5.2-codex-cyber",
  "gpt-5.2-pro",
  "gpt-5.3-codex",
  "gpt-5.3-codex-spark",
  "gpt-5.4-mini",
  "gpt-5.4-nano"
]), pe = /* @__PURE__ */ new Set([
  "codex-mini-latest",
  "o1",
  "o1-2024-12-17",
  "o1-pro",
  "o3",
  "o3-2025-04-16",
  "o3-mini",
  "o3-pro",
  "o3-deep-research",
  "o4-mini",
  "o4-mini-2025-04-16",
  "o4-mini-deep-research"
]), ue = /* @__PURE__ */ new Set([
  "gpt-4o",
  "gpt-4o-2024-08-06",
  "gpt-4o-mini",
  "gpt-4o-mini-2024-07-18",
  "gpt-5-chat-latest",
  "gpt-5.1-chat-latest",
  "gpt-5.2-chat-latest",
  "gpt-5.3-chat-latest"
]), he = {
  type: "object",
  properties: {
    patch: {
      type: "string",
      description: "A freeform apply_patch payload wrapped in *** Begin Patch and *** End Patch."
    },
    operation: {
      type: "object",
      description: "A single structured apply_patch operation."
    },
    operations: {
      type: "array",
      items: { type: "object" },
      description: "Structured apply_patch operations to apply in order."
    },
    command: {
      type: "array",
      description: 'Optional ["apply_patch", patch] command tuple form.'
    },
    type: {
      type: "string",
      enum: ["create_file", "update_file", "delete_file"],
      description: "The patch operation to apply."
    },
    path: {
      type: "string",
      description: "The sandbox file path to patch."
    },
    diff: {
      type: "string",
      description: "The V4A patch diff for create_file and update_file operations."
    },
    moveTo: {
      type: "string",
      description: "Optional destination path for update_file move operations."
    }
  },
  required: [],
  additionalProperties: !0
}, v = "*** Begin Patch", $ = "*** End Patch", P = "*** Add File: ", E = "*** Delete File: ", C = "*** Update File: ", L = "*** Move to: ";
function D(t) {
  if (t instanceof Error)
    return t.message || t.toString();
  try {
    return JSON.stringify(t);
  } catch {
    return String(t);
  }
}
function de(t) {
  if (typeof t == "string")
    return t;
  const i = t.image;
  if (typeof i == "string")
    return i;
  if (!R(i))
    return "No image data was returned by the sandbox session.";
  const e = i;
  return typeof e.url == "string" ? e.url : typeof e.fileId == "string" ? `OpenAI file reference: ${e.fileId}` : typeof e.data == "string" ? `data:${typeof e.mediaType == "string" ? e.mediaType : "application/octet-stream"};base64,${e.data}` : e.data instanceof Uint8Array ? `data:${typeof e.mediaType == "string" ? e.mediaType : "application/octet-stream"};base64,${G(e.data)}` : "No image data was returned by the sandbox session.";
}
function fe(t, i) {
  const e = D(i);
  if (/not found/iu.test(e))
    return `image path \`${t}\` was not found`;
  if (/not a file/iu.test(e))
    return `image path \`${t}\` is not a file`;
  if (/exceeds the 10 MB limit|exceeded the allowed size/iu.test(e))
    return `image path \`${t}\` exceeded the allowed size of 10MB; resize or compress the image and try again`;
  if (/unsupported image format|not a supported image/iu.test(e))
    return `image path \`${t}\` is not a supported image file`;
  const n = i instanceof Error ? i.name : typeof i;
  return `unable to read image at \`${t}\`: ${n}`;
}
function me(t) {
  const i = t.trimStart();
  if (i.startsWith(v))
    return g(i);
  let e;
  try {
    e = JSON.parse(t);
  } catch (n) {
    return {
      ok: !1,
      error: `Invalid apply_patch JSON: ${D(n)}`
    };
  }
  return ye(e);
}
function ye(t) {
  if (typeof t == "string")
    return g(t);
  if (Array.isArray(t))
    return y(t);
  if (!R(t))
    return {
      ok: !1,
      error: "apply_patch input must be an object or array."
    };
  if (typeof t.patch == "string")
    return g(t.patch);
  if (Array.isArray(t.command)) {
    const [i, e] = t.command;
    if (i === "apply_patch" && typeof e == "string")
      return g(e);
  }
  return Array.isArray(t.operations) ? y(t.operations) : t.operation !== void 0 ? y([t.operation]) : y([t]);
}
function y(t) {
  const i = [];
  for (const e of t) {
    const n = Y.safeParse(e);
    if (!n.success)
      return {
        ok: !1,
        error: `Invalid apply_patch operation: ${n.error.message}`
      };
    i.push(n.data);
  }
  return i.length === 0 ? { ok: !1, error: "apply_patch input must include an operation." } : { ok: !0, operations: i };
}
function g(t) {
  const i = t.split(/\r?\n/);
  if (i.at(-1) === "" && i.pop(), i[0] !== v)
    return {
      ok: !1,
      error: `apply_patch input must start with "${v}".`
    };
  if (i.length < 2 || i.at(-1) !== $)
    return {
      ok: !1,
      error: `apply_patch input must end with "${$}".`
    };
  const e = [];
  let n = 1;
  for (; n < i.length - 1; ) {
    const s = i[n];
    let r;
    if (s.startsWith(P))
      r = ge(i, n);
    else if (s.startsWith(E))
      r = be(i, n);
    else if (s.startsWith(C))
      r = we(i, n);
    else
      return {
        ok: !1,
        error: `Invalid apply_patch file operation header: ${s}`
      };
    if ("error" in r)
      return { ok: !1, error: r.error };
    e.push(r.operation), n = r.nextIndex;
  }
  return e.length === 0 ? {
    ok: !1,
    error: "apply_patch input must include at least one file operation."
  } : { ok: !0, operations: e };
}
function ge(t, i) {
  const e = _(t[i], P);
  if (!e)
    return { error: `Missing path in apply_patch header: ${t[i]}` };
  i += 1;
  const n = [];
  for (; i < t.length - 1 && !M(t[i]); ) {
    const s = t[i];
    if (!s.startsWith("+"))
      return { error: `Invalid Add File line: ${s}` };
    n.push(s), i += 1;
  }
  return n.length === 0 ? {
    error: `Add File patch for ${e} must include at least one + line.`
  } : {
    operation: {
      type: "create_file",
      path: e,
      diff: K(n)
    },
    nextIndex: i
  };
}
function be(t, i) {
  const e = _(t[i], E);
  return e ? (i += 1, i < t.length - 1 && !M(t[i]) ? { error: `Delete File patch for ${e} must not include a diff.` } : {
    operation: {
      type: "delete_file",
      path: e
    },
    nextIndex: i
  }) : { error: `Missing path in apply_patch header: ${t[i]}` };
}
function we(t, i) {
  const e = _(t[i], C);
  if (!e)
    return { error: `Missing path in apply_patch header: ${t[i]}` };
  i += 1;
  let n;
  if (i < t.length - 1 && t[i].startsWith(L)) {
    const r = _(t[i], L);
    if (!r)
      return { error: `Missing path in apply_patch header: ${t[i]}` };
    n = r, i += 1;
  }
  const s = [];
  for (; i < t.length - 1 && !M(t[i]); )
    s.push(t[i]), i += 1;
  return s.length === 0 && !n ? { error: `Update File patch for ${e} must include a hunk.` } : {
    operation: {
      type: "update_file",
      path: e,
      diff: s.length > 0 ? K(s) : "",
      ...n ? { moveTo: n } : {}
    },
    nextIndex: i
  };
}
function _(t, i) {
  const e = t.slice(i.length).trim();
  return e || null;
}
function M(t) {
  return t.startsWith(P) || t.startsWith(E) || t.startsWith(C);
}
function K(t) {
  return `${t.join(`
`)}
`;
}
async function ke(t, i, e) {
  let n;
  try {
    switch (i.type) {
      case "create_file":
        n = await t.createFile(i, { runContext: e });
        break;
      case "update_file":
        n = await t.updateFile(i, { runContext: e });
        break;
      case "delete_file":
        n = await t.deleteFile(i, { runContext: e });
        break;
      default:
        return "Unsupported apply_patch operation.";
    }
  } catch (s) {
    return `Failed to apply patch: ${D(s)}`;
  }
  return (n == null ? void 0 : n.status) === "failed" ? n.output ? `Patch failed: ${n.output}` : "Patch failed." : (n == null ? void 0 : n.output) ?? "Patch applied.";
}
async function _e(t, i, e) {
  const n = [];
  for (const s of i) {
    const r = await ke(t, s, e);
    r && n.push(r);
  }
  return n.join(`
`) || "Patch applied.";
}
function Te(t) {
  return {
    type: "function",
    name: "apply_patch",
    description: "Applies a create, update, move, or delete file patch in the sandbox workspace. Accepts a freeform patch string or structured apply_patch operations.",
    parameters: he,
    strict: !1,
    deferLoading: !1,
    needsApproval: async () => !1,
    isEnabled: async () => !0,
    invoke: async (e, n) => {
      const s = me(n);
      return s.ok ? await _e(t, s.operations, e) : s.error;
    }
  };
}
class xe extends S {
  constructor(e = {}) {
    super();
    o(this, "type", "filesystem");
    o(this, "configureTools");
    this.configureTools = e.configureTools;
  }
  tools() {
    var p, u;
    const e = U(this.type, this._session), n = (p = e.createEditor) == null ? void 0 : p.call(e, this._runAs);
    if (!n)
      throw new b("Filesystem sandbox sessions must provide createEditor().");
    const s = (u = this._workspaceScope) != null && u.cwd ? Ie(n, this._workspaceScope) : n, r = [], l = async (a, h) => {
      var T;
      if (!e.viewImage)
        throw new b("Filesystem sandbox sessions must provide viewImage().");
      const c = ((T = this._workspaceScope) == null ? void 0 : T.anchor(a)) ?? a;
      try {
        return await I("sandbox.view_image", {
          path: c,
          run_as: this._runAs
        }, async () => await e.viewImage({
          path: c,
          runAs: this._runAs
        }), this.tracingParent(h));
      } catch (x) {
        return fe(a, x);
      }
    };
    return j(this._modelInstance) ? r.push(w({
      name: "view_image",
      description: "Returns an image output from a path in the sandbox workspace or an explicitly granted sandbox path.",
      parameters: k({
        path: d().describe("Path to an image file in the sandbox workspace or an explicitly granted sandbox path")
      }),
      execute: async ({ path: a }, h, c) => await l(a, c)
    })) : r.push(w({
      name: "view_image",
      description: "Returns an image from a path in the sandbox workspace or an explicitly granted sandbox path as a data URL or reference string.",
      parameters: k({
        path: d().describe("Path to an image file in the sandbox workspace or an explicitly granted sandbox path")
      }),
      execute: async ({ path: a }, h, c) => de(await l(a, c))
    })), ie(this._modelInstance) ? r.push(q({
      name: "apply_patch",
      editor: s
    })) : r.push(Te(s)), this.configureTools ? this.configureTools([...r]) : r;
  }
}
function Ie(t, i) {
  return {
    createFile: async (e, n) => await t.createFile({ ...e, path: i.anchor(e.path) }, n),
    updateFile: async (e, n) => await t.updateFile({
      ...e,
      path: i.anchor(e.path),
      ...e.moveTo ? { moveTo: i.anchor(e.moveTo) } : {}
    }, n),
    deleteFile: async (e, n) => await t.deleteFile({ ...e, path: i.anchor(e.path) }, n)
  };
}
function ve(t = {}) {
  return new xe(t);
}
const Se = 1e4, Ae = 250, Pe = [
  "When using the shell:",
  "- Use `exec_command` for shell execution.",
  "- If available, use `write_stdin` to interact with or poll running sessions.",
  "- To interrupt a long-running process via `write_stdin`, start it with `tty=true` and send Ctrl-C (`\\u0003`).",
  "- Prefer `rg` and `rg --files` for text/file discovery when available.",
  "- Avoid using Python scripts just to print large file chunks."
].join(`
`);
class Ee extends S {
  constructor(e = {}) {
    super();
    o(this, "type", "shell");
    o(this, "configureTools");
    this.configureTools = e.configureTools;
  }
  tools() {
    var s;
    const e = U(this.type, this._session);
    if (!e.execCommand)
      throw new b("Shell sandbox sessions must provide execCommand().");
    const n = [
      w({
        name: "exec_command",
        description: "Runs a command in a PTY, returning output or a session ID for ongoing interaction.",
        parameters: k({
          cmd: d().min(1).describe("Shell command to execute."),
          workdir: d().optional().describe("Optional working directory to run the command in; defaults to the turn cwd."),
          shell: d().optional().describe("Shell binary to launch. Defaults to the user's default shell."),
          login: N().default(!0).describe("Whether to run the shell with -l/-i semantics. Defaults to true."),
          tty: N().default(!1).describe("Whether to allocate a TTY for the command. Defaults to false (plain pipes); set to true to open a PTY and access TTY process."),
          yield_time_ms: m().int().min(0).default(Se).describe("How long to wait (in milliseconds) for output before yielding."),
          max_output_tokens: m().int().min(1).optional().describe("Maximum number of tokens to return. Excess output will be truncated.")
        }),
        execute: async ({ cmd: r, workdir: l, shell: p, login: u, tty: a, yield_time_ms: h, max_output_tokens: c }, T, x) => {
          var O;
          const F = ((O = this._workspaceScope) == null ? void 0 : O.anchor(l)) ?? l;
          return await I("sandbox.exec", {
            cmd: r,
            workdir: F,
            shell: p,
            login: u,
            tty: a,
            run_as: this._runAs
          }, async () => await e.execCommand({
            cmd: r,
            workdir: F,
            shell: p,
            login: u,
            tty: a,
            yieldTimeMs: h,
            maxOutputTokens: c,
            runAs: this._runAs
          }), this.tracingParent(x));
        }
      })
    ];
    return (s = e.supportsPty) != null && s.call(e) && e.writeStdin && n.push(w({
      name: "write_stdin",
      description: "Writes characters to an existing unified exec session and returns recent output.",
      parameters: k({
        session_id: m().int().describe("Identifier of the running unified exec session."),
        chars: d().default("").describe("Bytes to write to stdin (may be empty to poll)."),
        yield_time_ms: m().int().min(0).default(Ae).describe("How long to wait (in milliseconds) for output before yielding."),
        max_output_tokens: m().int().min(1).optional().describe("Maximum number of tokens to return. Excess output will be truncated.")
      }),
      execute: async ({ session_id: r, chars: l, yield_time_ms: p, max_output_tokens: u }, a, h) => await I("sandbox.write_stdin", {
        session_id: r
      }, async () => await e.writeStdin({
        sessionId: r,
        chars: l,
        yieldTimeMs: p,
        maxOutputTokens: u
      }), this.tracingParent(h))
    })), this.configureTools ? this.configureTools([...n]) : n;
  }
  instructions() {
    return Pe;
  }
}
function Ce(t = {}) {
  return new Ee(t);
}
A`
A skill is a set of local instructions to follow that is stored in a \`SKILL.md\` file. Below is the list of skills that can be used. Each entry includes a name, description, and file path so you can open the source for full instructions when using a specific skill.
`;
A`
### How to use skills
- Discovery: The list above is the skills available in this session (name + description + file path). Skill bodies live on disk at the listed paths.
- Trigger rules: If the user names a skill (with \`$SkillName\` or plain text) OR the task clearly matches a skill's description shown above, you must use that skill for that turn. Multiple mentions mean use them all. Do not carry skills across turns unless re-mentioned.
- Missing/blocked: If a named skill isn't in the list or the path can't be read, say so briefly and continue with the best fallback.
- How to use a skill (progressive disclosure):
  1) After deciding to use a skill, open its \`SKILL.md\`. Read only enough to follow the workflow.
  2) If \`SKILL.md\` points to extra folders such as \`references/\`, load only the specific files needed for the request; don't bulk-load everything.
  3) If \`scripts/\` exist, prefer running or patching them instead of retyping large code blocks.
  4) If \`assets/\` or templates exist, reuse them instead of recreating from scratch.
- Coordination and sequencing:
  - If multiple skills apply, choose the minimal set that covers the request and state the order you'll use them.
  - Announce which skill(s) you're using and why (one short line). If you skip an obvious skill, say why.
- Context hygiene:
  - Keep context small: summarize long sections instead of pasting them; only load extra files when needed.
  - Avoid deep reference-chasing: prefer opening only files directly linked from \`SKILL.md\` unless you're blocked.
  - When variants exist (frameworks, providers, domains), pick only the relevant reference file(s) and note that choice.
- Safety and fallback: If a skill can't be applied cleanly (missing files, unclear instructions), state the issue, pick the next-best approach, and continue.
`;
A`
### How to use skills
- Discovery: The list above is the skill index available in this session (name + description + workspace path). In lazy mode, those paths are loaded on demand instead of being present up front.
- Trigger rules: If the user names a skill (with \`$SkillName\` or plain text) OR the task clearly matches a skill's description shown above, you must use that skill for that turn. Multiple mentions mean use them all. Do not carry skills across turns unless re-mentioned.
- Missing/blocked: If a named skill isn't in the list or the path can't be read, say so briefly and continue with the best fallback.
- How to use a skill (progressive disclosure):
  1) After deciding to use a lazy skill, call \`load_skill\` for that skill first, then open its \`SKILL.md\`.
  2) If \`SKILL.md\` points to extra folders such as \`references/\`, load only the specific files needed for the request; don't bulk-load everything.
  3) If \`scripts/\` exist, prefer running or patching them instead of retyping large code blocks.
  4) If \`assets/\` or templates exist, reuse them instead of recreating from scratch.
- Coordination and sequencing:
  - If multiple skills apply, choose the minimal set that covers the request and state the order you'll use them.
  - Announce which skill(s) you're using and why (one short line). If you skip an obvious skill, say why.
- Context hygiene:
  - Keep context small: summarize long sections instead of pasting them; only load extra files when needed.
  - Avoid deep reference-chasing: prefer opening only files directly linked from \`SKILL.md\` unless you're blocked.
  - When variants exist (frameworks, providers, domains), pick only the relevant reference file(s) and note that choice.
- Safety and fallback: If a skill can't be applied cleanly (missing files, unclear instructions), state the issue, pick the next-best approach, and continue.
`;
function De() {
  return [ve(), Ce(), oe()];
}
const Me = {
  default: De
};
var W, B;
class H extends (B = J, W = V, B) {
  constructor(e) {
    super(e);
    o(this, W, !0);
    o(this, "defaultManifest");
    o(this, "baseInstructions");
    o(this, "capabilities");
    o(this, "runAs");
    o(this, "runtimeManifest");
    if (e.baseInstructions !== void 0 && typeof e.baseInstructions != "string" && typeof e.baseInstructions != "function")
      throw new TypeError("SandboxAgent baseInstructions must be a string or function.");
    this.defaultManifest = e.defaultManifest ? Q(e.defaultManifest) : void 0, this.baseInstructions = e.baseInstructions, this.capabilities = e.capabilities ?? Me.default(), this.runAs = Fe(e.runAs), this.runtimeManifest = this.defaultManifest ?? new Z();
  }
  clone(e) {
    return new H({
      name: e.name ?? this.name,
      instructions: e.instructions ?? this.instructions,
      prompt: e.prompt ?? this.prompt,
      handoffDescription: e.handoffDescription ?? this.handoffDescription,
      handoffs: e.handoffs ?? this.handoffs,
      model: e.model ?? this.model,
      modelSettings: e.modelSettings ?? this.modelSettings,
      tools: e.tools ?? this.tools,
      mcpServers: e.mcpServers ?? this.mcpServers,
      mcpConfig: e.mcpConfig ?? this.mcpConfig,
      inputGuardrails: e.inputGuardrails ?? this.inputGuardrails,
      outputGuardrails: e.outputGuardrails ?? this.outputGuardrails,
      outputType: e.outputType ?? this.outputType,
      toolUseBehavior: e.toolUseBehavior ?? this.toolUseBehavior,
      resetToolChoice: e.resetToolChoice ?? this.resetToolChoice,
      defaultManifest: e.defaultManifest ?? this.defaultManifest,
      baseInstructions: e.baseInstructions ?? this.baseInstructions,
      capabilities: e.capabilities ?? this.capabilities,
      runAs: e.runAs ?? this.runAs
    });
  }
}
function Fe(t) {
  if (t !== void 0) {
    if (typeof t == "string") {
      const i = t.trim();
      if (!i)
        throw new TypeError("SandboxAgent runAs must be non-empty.");
      return i;
    }
    return ee(t);
  }
}
export {
  H as SandboxAgent
};

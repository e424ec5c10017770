// A small stand-in DOM and ComfyUI app / api, for web/qwen35.js under Node (tests/test_web_stream.py puts a copy of
// it beside this file as qwen35.mjs, its two imports read from globalThis.__mocks).
class FakeEl {
  constructor(tag) {
    this.tagName = tag; this.childNodes = []; this.parentNode = null; this._text = "";
    this.dataset = {}; this.hidden = false; this.open = false; this.title = ""; this.id = "";
    this._cls = new Set(); this._listeners = {}; this.scrollHeight = 0; this.value = "";
    const self = this;
    this.classList = {
      contains: (c) => self._cls.has(c),
      add: (c) => self._cls.add(c),
      remove: (c) => self._cls.delete(c),
      toggle: (c, on) => {
        const v = on === undefined ? !self._cls.has(c) : !!on;
        if (v) self._cls.add(c); else self._cls.delete(c);
        return v;
      },
    };
  }
  set className(v) { this._cls = new Set(String(v).split(/\s+/).filter(Boolean)); }
  get className() { return [...this._cls].join(" "); }
  appendChild(c) {
    c.remove();
    c.parentNode = this; this.childNodes.push(c); return c;
  }
  replaceChildren(...cs) { for (const c of this.childNodes) c.parentNode = null; this.childNodes = [];
    for (const c of cs) this.appendChild(c); }
  remove() {
    if (this.parentNode) this.parentNode.childNodes = this.parentNode.childNodes.filter((x) => x !== this);
    this.parentNode = null;
  }
  set textContent(v) {
    this._text = v === undefined || v === null ? "" : String(v);
    for (const c of this.childNodes) c.parentNode = null;
    this.childNodes = [];
  }
  get textContent() { return this._text + this.childNodes.map((c) => c.textContent).join(""); }
  set innerHTML(v) { throw new Error("innerHTML used: " + v); }
  addEventListener(t, f) { (this._listeners[t] ??= []).push(f); }
  click() { for (const f of this._listeners.click ?? []) f({ stopPropagation() {} }); }
  select() {}
}
globalThis.document = {
  head: new FakeEl("head"), body: new FakeEl("body"),
  createElement: (t) => new FakeEl(t),
  getElementById: (id) => document.head.childNodes.find((c) => c.id === id) ?? null,
  execCommand: () => true,
};

class EventTarget2 {
  constructor() { this.l = {}; }
  addEventListener(t, f) { (this.l[t] ??= []).push(f); }
  emit(t, detail) { for (const f of this.l[t] ?? []) f({ detail }); }
}

export let nextPromptId = 1;
export function makeEnv() {
  const api = new EventTarget2();
  api.queuePrompt = async () => ({ prompt_id: "P" + nextPromptId++ });
  let ext = null;
  const workflowStore = { activeWorkflow: null };
  const app = {
    registerExtension: (e) => { ext = e; },
    extensionManager: { workflow: workflowStore },
    rootGraph: null,
    get graph() { return this.rootGraph; },
  };
  return { api, app, workflowStore, getExt: () => ext };
}

export class FakeGraph {
  constructor() { this.nodes = []; }
  getNodeById(id) { return this.nodes.find((n) => String(n.id) === String(id)) ?? null; }
}

let nodeTypes = {};
export async function defineTypes(ext, names) {
  for (const name of names) {
    const T = function (id) { this.id = id; this.type = name; this.size = [200, 60]; this.widgets = []; };
    T.prototype.addDOMWidget = function (name, type, el, opts) {
      const w = { name, el, options: { ...opts } };
      this.widgets.push(w);
      return w;
    };
    T.prototype.computeSize = function () { return [200, 180]; };
    T.prototype.setSize = function (s) { this.size = s; };
    T.prototype.setDirtyCanvas = function () {};
    await ext.beforeRegisterNodeDef(T, { name });
    nodeTypes[name] = T;
  }
}
export function makeNode(graph, name, id) {
  const n = new nodeTypes[name](id);
  n.onNodeCreated?.();
  graph.nodes.push(n);
  return n;
}

export async function load(env) {
  globalThis.__mocks = { app: env.app, api: env.api };
  await import("./qwen35.mjs?" + Math.random());
  const ext = env.getExt();
  await ext.setup();
  await defineTypes(ext, ["Qwen35Generate", "Qwen35TextPrefill", "Qwen35MultimodalPrefill", "Qwen35ContinuePrefill",
    "Qwen35ModelLoader"]);
  return ext;
}

// ComfyUI's own `executed` handler + listeners, in the order the front end runs them (its own first)
export function executed(env, detail, findNode) {
  const node = findNode(String(detail.display_node || detail.node));
  node?.onExecuted?.(detail.output);
  env.api.emit("executed", detail);
}

export function panel(node) {
  const v = node.qwen35;
  return { stats: v.stats.textContent, thinking: v.thinkingText?.textContent, thinkingHidden: v.thinking?.hidden,
    thinkingOpen: v.thinking?.open, answer: v.answer?.textContent,
    streaming: v.answer?.classList.contains("qwen35-streaming") };
}

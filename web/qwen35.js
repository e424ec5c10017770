// Qwen3.5 nodes in the ComfyUI front end: the answer streams onto the Generate node as tokens
// arrive (thinking folded away, a copy button); Prefill and Loader show what they measured.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

// sent by nodes/text.py: {node, display_node, item, prompt_id, delta, n, max, t, thinking}. n == 0 starts an answer
// (item: its place in a list of prefills; thinking: whether thinking text comes first); n above 0 is token n, whose
// text is `delta`, with `answering` (the thinking ended before this delta) and `closes` (this token ended it: its
// delta ends with the text "</think>", the answer starts after it). Both follow the runtime's </think> token, as
// the node's outputs split thinking and answer: thinking that spells "</think>" out of other tokens is thinking.
// A node of an earlier version sent no `closes`: its events are cut at the text's first "</think>".
const STREAM_EVENT = "qwen35.stream";
const THINK_END = "</think>";

const CSS = `
.qwen35-panel { display: flex; flex-direction: column; gap: 4px; width: 100%; height: 100%;
  box-sizing: border-box; padding: 4px 6px; font: 12px/1.4 sans-serif; color: var(--input-text, #ddd);
  overflow: hidden; }
.qwen35-stats { opacity: 0.75; font-size: 11px; white-space: nowrap; overflow: hidden; text-overflow: ellipsis; }
.qwen35-stats:empty { display: none; }
.qwen35-stats.qwen35-lines { white-space: pre-line; text-overflow: clip; }
.qwen35-thinking { border-left: 2px solid #666; padding-left: 6px; opacity: 0.8; }
.qwen35-thinking summary { cursor: pointer; font-size: 11px; user-select: none; }
.qwen35-thinking-text, .qwen35-answer { white-space: pre-wrap; word-break: break-word; overflow-y: auto;
  user-select: text; }
.qwen35-thinking-text { max-height: 120px; font-size: 11px; }
.qwen35-answer { flex: 1 1 auto; min-height: 40px; background: var(--comfy-input-bg, #222);
  border-radius: 4px; padding: 4px 6px; }
.qwen35-answer.qwen35-streaming::after { content: "\\258D"; opacity: 0.6; }
.qwen35-bar { display: flex; gap: 6px; justify-content: flex-end; }
.qwen35-bar button { font-size: 11px; padding: 1px 8px; cursor: pointer; }
`;

function addStyle() {
  if (document.getElementById("qwen35-style")) return;
  const style = document.createElement("style");
  style.id = "qwen35-style";
  style.textContent = CSS;
  document.head.appendChild(style);
}

function el(tag, cls, parent) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (parent) parent.appendChild(e);
  return e;
}

function fmt(x, digits = 1) {
  return Number(x).toLocaleString(undefined, { maximumFractionDigits: digits });
}

async function copyText(text) {
  try {
    await navigator.clipboard.writeText(text);
    return true;
  } catch {
    // Pages served over plain http on another host have no clipboard API.
    const area = el("textarea", null, document.body);
    area.value = text;
    area.select();
    const ok = document.execCommand("copy");
    area.remove();
    return ok;
  }
}

// A view is a panel's elements and state, made apart from any node: a workflow that is not shown has no nodes,
// and its runs write into the views it had (see viewFor).
function addPanel(node, name, minHeight, view) {
  addStyle();
  const widget = node.addDOMWidget(name, "qwen35_panel", view.root, {
    serialize: false,
    // a list of prefills' stats (one line each, wrapped at the node's width) as tall as they are drawn
    getMinHeight: () => {
      const stats = node.qwen35?.stats;
      return stats?.classList.contains("qwen35-lines") ? Math.max(minHeight, stats.scrollHeight + 10) : minHeight;
    },
  });
  widget.serialize = false; // never part of widgets_values: workflows load with or without this script
  widget.options.serialize = false;
  node.qwen35 = view;
  view.node = node;
}

// A node grows to show what its panel now holds (it never shrinks under the user's size).
function fit(view) {
  const node = view.node;
  if (!node?.computeSize || node.qwen35 !== view) return;
  const want = node.computeSize();
  if (want[1] > node.size[1]) node.setSize([node.size[0], want[1]]);
  node.setDirtyCanvas?.(true, true);
}

// --- Generate: streamed answer, folded thinking, copy button, decode stats ---
function makeGenerateView() {
  const root = el("div", "qwen35-panel");
  const view = {
    kind: "generate",
    root,
    stats: el("div", "qwen35-stats", root),
    thinking: el("details", "qwen35-thinking", root),
    answer: el("div", "qwen35-answer", root),
    bar: el("div", "qwen35-bar", root),
    raw: "",
    done: [], // the finished answers of a list of prefills, before the one streaming (item > 0)
    expectThinking: false,
  };
  view.answer.dataset.qwen35 = "answer";
  el("summary", null, view.thinking).textContent = "Thinking";
  view.thinkingText = el("div", "qwen35-thinking-text", view.thinking);
  view.thinking.hidden = true;
  const copy = el("button", null, view.bar);
  copy.textContent = "Copy";
  copy.title = "Copy the answer";
  copy.addEventListener("click", async (e) => {
    e.stopPropagation();
    const ok = await copyText(view.answer.textContent);
    copy.textContent = ok ? "Copied" : "Copy failed";
    setTimeout(() => (copy.textContent = "Copy"), 1200);
  });
  return view;
}

function setupGenerate(node) {
  addPanel(node, "qwen35_answer", 140, makeGenerateView());
  const size = node.computeSize();
  node.setSize([Math.max(node.size[0], 380), Math.max(node.size[1], size[1])]);
}

// The Generate views showing a stream now, wherever their node is (the root graph, a subgraph, a workflow not
// shown): a cancel or an error of their run stops each of them.
const streamingViews = new Set();

function showAnswer(view, thinking, answer, streaming) {
  if (streaming) streamingViews.add(view);
  else streamingViews.delete(view);
  view.thinking.hidden = !thinking;
  view.thinkingText.textContent = thinking;
  view.answer.textContent = answer;
  view.answer.classList.toggle("qwen35-streaming", streaming);
}

// The streamed text so far as (thinking, answer): cut where the token that ended the thinking ended (view.cut).
function streamed(view) {
  if (!view.expectThinking) return ["", view.raw];
  if (view.cut < 0) return [view.raw.replace(/^\s*<think>/, "").trim(), ""];
  let thinking = view.raw.slice(0, view.cut).replace(/^\s*<think>/, "");
  if (thinking.endsWith(THINK_END)) thinking = thinking.slice(0, -THINK_END.length);
  return [thinking.trim(), view.raw.slice(view.cut).trimStart()];
}

// Where the answer starts in view.raw once event d has come (`before`: where its delta starts), or -1 while the
// model thinks: after the delta that `closes` the thinking, or before the first that says `answering` where the
// page missed the one that closed it (a dropped connection); never at the text while the node says where.
// Events without `closes` (a node of an earlier version) are cut as that node cut: at the first "</think>".
function answerStart(view, d, before) {
  if (!("closes" in d)) {
    const end = view.raw.indexOf(THINK_END);
    return end < 0 ? -1 : end + THINK_END.length;
  }
  if (d.closes) return view.raw.length;
  return d.answering ? before : -1;
}

// The answer being streamed after the finished ones of its list, each numbered by its place in the list ([2] ...;
// a page that joined mid-list starts at the answer it joined).
function withEarlier(view, answer) {
  if (!view.done.length) return answer;
  const first = view.item - view.done.length;
  return [...view.done, answer].map((t, i) => `[${first + i + 1}] ${t}`).join("\n\n");
}

// A finished answer of a list, as nodes/text.py splits it: a turn that ended before its max_new_tokens without
// closing its thinking is all answer (the model's end of turn), one cut at max_new_tokens there has none.
function finishedAnswer(view) {
  const [thinking, answer] = streamed(view);
  return (view.expectThinking && view.cut < 0 && view.n < view.max ? thinking : answer).trim();
}

// The view laid out for the answer event d begins (every stream event says whether the answer thinks).
function startAnswer(view, d) {
  view.promptId = d.prompt_id; // a cancel or an error of this run stops it
  view.item = d.item ?? 0;
  view.raw = "";
  view.cut = -1;
  view.n = d.n;
  view.max = d.max;
  // (a page that joins after the thinking ended shows the rest as the answer: the thinking went to the old page)
  view.expectThinking = !!d.thinking && !d.answering;
  view.thinking.open = view.expectThinking; // watch the thinking while it is written; fold it after
}

function onStream(view, d) {
  if (d.n === 0) {
    // the next answer of a list of prefills keeps the finished ones; a new run starts afresh
    if ((d.item ?? 0) > 0 && view.promptId === d.prompt_id) view.done.push(finishedAnswer(view));
    else view.done = [];
    startAnswer(view, d);
    view.stats.textContent = `generating (max ${d.max} tokens)…`;
    showAnswer(view, "", withEarlier(view, ""), true);
    return;
  }
  if (view.promptId !== d.prompt_id) {
    // joined mid-answer (the page reloaded while it streamed): laid out for this run from here on
    view.done = [];
    startAnswer(view, d);
  }
  const before = view.raw.length;
  view.raw += d.delta;
  view.n = d.n;
  view.max = d.max;
  view.stats.textContent = `${d.n} / ${d.max} tokens`;
  if (view.expectThinking && view.cut < 0) {
    view.cut = answerStart(view, d, before);
    if (view.cut >= 0) view.thinking.open = false; // thinking done: fold it, show the answer
  }
  const [thinking, answer] = streamed(view);
  showAnswer(view, thinking, withEarlier(view, answer), true);
}

// The run stopped before this node finished (cancel or error): keep the partial text, say so.
function onStopped(view, why) {
  if (!view.answer.classList.contains("qwen35-streaming")) return;
  streamingViews.delete(view);
  view.answer.classList.remove("qwen35-streaming");
  const n = view.stats.textContent.match(/^(\d+) \//);
  const of = view.item || view.done.length ? ` of answer ${view.item + 1}` : "";
  view.stats.textContent = n ? `${why} after ${n[1]} tokens${of}` : why + of;
}

// A list of prefills (one prompt per image) comes to the node in one run, which answers each in turn: every
// answer is shown, numbered, with the stats of each. skipEmpty leaves out empty items (thinking that an answer
// did not have) and keeps the others' numbers: each stays its image's.
function numbered(items, skipEmpty = false) {
  if (items.length <= 1) return items[0] ?? "";
  return items.map((t, i) => (skipEmpty && !t ? null : `[${i + 1}/${items.length}] ${t}`))
    .filter((t) => t !== null).join("\n\n");
}

function onGenerateExecuted(view, output) {
  const texts = output?.text ?? [];
  showAnswer(view, numbered(output?.thinking ?? [], true), numbered(texts), false);
  view.thinking.open = false;
  const all = output?.qwen35_generate ?? [];
  const s = all[0];
  if (!all.length) {  // an empty list of prefills came in: no answer, and nothing of the last one's stats
    view.stats.textContent = "no answers: an empty list of prefills came in";
  } else if (all.length === 1) {
    view.stats.textContent = `first token ${fmt(s.first_token_ms)} ms · ${fmt(s.decode_tokens_per_s)} tok/s decode · ` +
      `${s.n_tokens} tokens (${s.finish_reason})` + (s.note ? ` · ${s.note}` : "");
  } else if (all.length > 1) {  // one line: the answers' count, mean rates and all their tokens
    const mean = (k) => all.reduce((a, x) => a + x[k], 0) / all.length;
    // nodes/text.py's flags: stopped while thinking (no answer), and / or cut where the model's positions ran out
    const unanswered = all.filter((x) => x.no_answer).length;
    const full = all.filter((x) => x.positions_ran_out).length;
    view.stats.textContent = `${all.length} answers · first token ${fmt(mean("first_token_ms"))} ms · ` +
      `${fmt(mean("decode_tokens_per_s"))} tok/s decode (means) · ${all.reduce((a, x) => a + x.n_tokens, 0)} tokens` +
      (unanswered ? ` · ${unanswered} stopped while thinking, with no answer` : "") +
      (full ? ` · ${full} stopped where the prompt and the answer filled the model's positions: shorten the prompt`
        : unanswered ? ": raise max_new_tokens" : "");
  }
}

// --- Prefill and Loader: one line of what they measured ---
function makeStatsView() {
  const root = el("div", "qwen35-panel");
  return { kind: "stats", root, stats: el("div", "qwen35-stats", root) };
}

// "12 reused + 30 new · ": tokens taken from the K/V cache (an earlier prompt's system prompt and images, or
// the prefill a Continue node continues) and tokens read now
function reuseText(s) {
  return s.cached_tokens !== undefined ? `${s.cached_tokens} reused + ${s.new_tokens} new · ` : "";
}

function prefillLine(s) {
  if (s.vision_tokens !== undefined) {  // Multimodal Prefill: one line per prefill of the list
    return reuseText(s) + `${s.vision_tokens} image/video + ${s.text_tokens} text tokens · ` +
      `vision ${fmt(s.vision_ms, 1)} ms · prefill ${fmt(s.prefill_ms, 1)} ms · ${s.backend}` +
      (s.thinking ? " · thinking" : "") + (s.note ? ` · ${s.note}` : "");
  }
  return `${s.n_tokens} prompt tokens · ` + reuseText(s) +
    `${fmt(s.ms, 2)} ms · ${fmt(s.tokens_per_s, 0)} tok/s · ${s.backend}` + (s.thinking ? " · thinking" : "");
}

function loaderLine(s) {
  const cache = s.cache_mb !== undefined ? ` (K/V cache ${fmt(s.cache_mb, 0)} MiB, ${s.cache_tokens} tokens)` : "";
  const note = s.device_note ? ` · ${s.device_note}` : "";
  const dtype = s.weights === "int8" ? `int8 weights, ${s.dtype} compute` : s.dtype;
  return `${s.backend} on ${s.device} · ${dtype} · ${fmt(s.size_mb, 0)} MiB${cache} — ${s.backend_reason}${note}`;
}

const SETUP = {
  Qwen35Generate: (node) => setupGenerate(node),
  Qwen35TextPrefill: (node) => addPanel(node, "qwen35_prefill_stats", 24, makeStatsView()),
  Qwen35MultimodalPrefill: (node) => addPanel(node, "qwen35_prefill_stats", 24, makeStatsView()),
  Qwen35ContinuePrefill: (node) => addPanel(node, "qwen35_prefill_stats", 24, makeStatsView()),
  Qwen35ModelLoader: (node) => addPanel(node, "qwen35_model_info", 24, makeStatsView()),
};

// The view that shows a node's output, made apart from a node: null for an output of another node type.
function makeViewFor(output) {
  if (output?.qwen35_generate) return makeGenerateView();
  return output?.qwen35_prefill || output?.qwen35_model ? makeStatsView() : null;
}

function showOutput(view, output) {
  if (view.kind === "generate") {
    view.done = [];
    onGenerateExecuted(view, output);
    return;
  }
  const lines = output?.qwen35_prefill?.[0] ? output.qwen35_prefill.map(prefillLine)
    : output?.qwen35_model?.[0] ? [loaderLine(output.qwen35_model[0])] : null;
  if (!lines) return;
  view.stats.textContent = lines.join("\n");
  view.stats.title = view.stats.textContent; // the whole text where the panel is narrower than a line
  view.stats.classList.toggle("qwen35-lines", lines.length > 1);
  fit(view);
}

// A node's id in a run is a path for a node inside a subgraph: "outer:inner" (one step per subgraph level).
// Each step is a node of the graph before it; a subgraph node's inner graph is its `subgraph`.
function findNode(id) {
  let graph = app.rootGraph ?? app.graph;
  let node = null;
  for (const step of String(id).split(":")) {
    node = graph?.getNodeById(step) ?? graph?.getNodeById(Number(step)) ?? null;
    if (!node) return null;
    graph = node.subgraph;
  }
  return node;
}

// The node an entry of the front end's outputs belongs to: keyed by node id in the root graph, and by
// "<subgraph id>:<node id>" (a locator) inside a subgraph; an execution id path ("12:5") where the key is one.
function nodeOfOutput(key) {
  const cut = key.lastIndexOf(":");
  const subgraph = cut > 0 ? app.rootGraph?.subgraphs?.get?.(key.slice(0, cut)) : null;
  if (subgraph) return subgraph.getNodeById(key.slice(cut + 1)) ?? subgraph.getNodeById(Number(key.slice(cut + 1)));
  return findNode(key);
}

// --- Which workflow a run writes into ---
// The front end shows one of several workflow tabs and makes a tab's graph again from its saved state each time it
// is shown, while ComfyUI's events name a node by its id alone: a run must find its node in the workflow that
// queued it, not in whichever tab is shown. As the front end does for its own outputs, a prompt id is tied to the
// workflow shown when it was queued. A prompt this page did not queue (or a front end without a workflow store)
// writes into the shown graph's node, as ComfyUI's own `executed` handler does.
const queuedBy = new Map(); // prompt_id -> the workflow (the front end's object) that queued it, until it ends
// A prompt removed from the queue before it ran (or whose end the page missed, offline) gets no end event: ties
// are let go when ComfyUI says its queue is empty, but for those made since its last word (their prompt queued
// after that was said, the word on its way): they are let go at the next empty queue.
const tiedSinceStatus = new Set();
const endedUntied = new Set(); // the last prompts that ended before queuePrompt answered (a run all cached)
const kept = new WeakMap(); // workflow -> Map(node execution id -> view): its panels while other tabs are shown
// workflow -> Set(node id): ids under which ComfyUI's own handler stored another workflow's output in this one's
// output store (it writes a run's outputs into the shown graph's store by id), never to be shown from there
const foreign = new WeakMap();
let running = null; // the prompt_id of the run going on: onExecuted is not told which run its output is from

function shownWorkflow() {
  return app.extensionManager?.workflow?.activeWorkflow ?? null;
}

function tieRunsToWorkflows() {
  const queuePrompt = api.queuePrompt;
  api.queuePrompt = async function (...args) {
    const workflow = shownWorkflow(); // before the request: a tab switch while it is out must not count
    const res = await queuePrompt.apply(this, args);
    if (workflow && res?.prompt_id && !endedUntied.delete(res.prompt_id)) {
      queuedBy.set(res.prompt_id, workflow);
      tiedSinceStatus.add(res.prompt_id);
    }
    return res;
  };
}

// A shown workflow's graph was made again: its kept view's elements and state move into the new node's panel.
function adopt(node, view) {
  if (node.qwen35 === view || node.qwen35?.kind !== view.kind) return;
  node.qwen35.root.replaceChildren(...view.root.childNodes);
  view.root = node.qwen35.root;
  node.qwen35 = view;
  view.node = node;
  fit(view);
}

function adoptKept() {
  for (const [id, view] of kept.get(shownWorkflow()) ?? []) {
    const node = findNode(id);
    if (node) adopt(node, view);
  }
}

// The view a run of `promptId` writes for node `id` (an execution id): the node's own when its workflow is shown,
// else the one kept for that workflow (made by `make` if there is none yet); null when there is no such node.
function viewFor(promptId, id, make) {
  const workflow = queuedBy.get(promptId);
  if (!workflow) return findNode(id)?.qwen35 ?? null;
  if (!kept.has(workflow)) kept.set(workflow, new Map());
  const views = kept.get(workflow);
  let view = views.get(String(id));
  if (workflow === shownWorkflow()) {
    const node = findNode(id);
    if (!node?.qwen35) return null;
    if (view) adopt(node, view);
    view = node.qwen35;
  } else {
    view ??= make();
  }
  if (view) views.set(String(id), view);
  return view;
}

app.registerExtension({
  name: "qwen35.fast",
  async setup() {
    tieRunsToWorkflows();
    api.addEventListener("execution_start", ({ detail }) => (running = detail.prompt_id));
    api.addEventListener(STREAM_EVENT, ({ detail }) => {
      const view = viewFor(detail.prompt_id, detail.display_node ?? detail.node, makeGenerateView);
      if (view?.kind === "generate") onStream(view, detail);
    });
    // ComfyUI's handler has called onExecuted on the shown graph's node with this id; a run tied to a workflow
    // writes here instead (onExecuted skips it), into that workflow's node.
    api.addEventListener("executed", ({ detail }) => {
      const shown = shownWorkflow(), id = String(detail.display_node || detail.node);
      if (shown) {
        if (!foreign.has(shown)) foreign.set(shown, new Set());
        const by = queuedBy.get(detail.prompt_id);
        if (by && by !== shown) foreign.get(shown).add(id);
        else foreign.get(shown).delete(id);
      }
      if (!queuedBy.has(detail.prompt_id)) return;
      const view = viewFor(detail.prompt_id, id, () => makeViewFor(detail.output));
      if (view) showOutput(view, detail.output);
    });
    // a run ended; a cancel or an error stops its streaming panels (in every tab), keeping their text
    const ended = (why) => ({ detail }) => {
      const ofRun = (view) => !detail?.prompt_id || !view.promptId || view.promptId === detail.prompt_id;
      if (why) for (const view of [...streamingViews].filter(ofRun)) onStopped(view, why);
      // a finished run's views still streaming lost their node (deleted mid-run): no `executed` comes for them
      else for (const view of [...streamingViews].filter(ofRun)) streamingViews.delete(view);
      if (!queuedBy.delete(detail?.prompt_id) && detail?.prompt_id) {
        endedUntied.add(detail.prompt_id);
        if (endedUntied.size > 64) endedUntied.delete(endedUntied.values().next().value);
      }
    };
    api.addEventListener("status", ({ detail }) => {
      if (detail?.exec_info?.queue_remaining === 0) {
        for (const id of queuedBy.keys()) if (!tiedSinceStatus.has(id)) queuedBy.delete(id);
      }
      tiedSinceStatus.clear();
    });
    api.addEventListener("execution_interrupted", ended("stopped"));
    api.addEventListener("execution_error", ended("failed"));
    api.addEventListener("execution_success", ended(null));
  },
  // Called when a tab is shown again (the front end restores its outputs): its panels come back as they were; and
  // when a past job is opened again (its graph and outputs): a panel this page kept nothing for shows its output.
  onNodeOutputsUpdated(outputs) {
    adoptKept();
    const skip = foreign.get(shownWorkflow());
    for (const [id, output] of Object.entries(outputs ?? {})) {
      const view = nodeOfOutput(id)?.qwen35;
      if (!view || !output || skip?.has(id) || streamingViews.has(view)) continue;
      const blank = view.kind === "generate" ? !view.answer.textContent && !view.stats.textContent
        : !view.stats.textContent;
      if (blank) showOutput(view, output);
    }
  },
  async beforeRegisterNodeDef(nodeType, nodeData) {
    const setup = SETUP[nodeData.name];
    if (!setup) return;
    const created = nodeType.prototype.onNodeCreated;
    nodeType.prototype.onNodeCreated = function () {
      const r = created?.apply(this, arguments);
      setup(this);
      return r;
    };
    const executed = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (output) {
      executed?.apply(this, arguments);
      if (this.qwen35 && !queuedBy.has(running)) showOutput(this.qwen35, output);
    };
  },
});

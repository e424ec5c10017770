// The Generate node's streamed text on the page (web/qwen35.js), from the events nodes/text.py sends; run by
// tests/test_web_stream.py. Each case is an event sequence and what the node shows after it.
import assert from "node:assert/strict";
import { makeEnv, load, FakeGraph, makeNode, panel, executed } from "./harness.mjs";

async function page() {
  const env = makeEnv();
  const g = new FakeGraph();
  env.app.rootGraph = g;
  const ext = await load(env);
  return { env, ext, g, gen: makeNode(g, "Qwen35Generate", 5) };
}

// An event as nodes/text.py sends it for token n (n == 0: the answer starts), thinking on unless `more` says
const tokenEvent = (n, delta, more = {}) => ({ node: "5", display_node: "5", item: 0, prompt_id: "P1", delta, n,
  max: 256, t: 0, thinking: true, ...(n ? { answering: false, closes: false } : {}), ...more });

// The node's outputs at the end of a run of one answer, shown over what streamed
function finish(env, g, text, thinking, more = {}) {
  executed(env, { node: "5", display_node: "5", prompt_id: "P1", output: { text: [text], thinking: [thinking],
    qwen35_generate: [{ n_tokens: 9, first_token_ms: 5, decode_tokens_per_s: 9, finish_reason: "stop", ...more }] } },
  (id) => g.getNodeById(id));
  env.api.emit("execution_success", { prompt_id: "P1" });
}

const cases = {
  // a page reloaded after the answer's </think> (the thinking went to the old page): the rest is the answer
  async "a page that joins after the thinking shows the rest as the answer"() {
    const { env, gen } = await page();
    const ev = (n, delta) => tokenEvent(n, delta, { answering: true });
    env.api.emit("qwen35.stream", ev(31, "The answer"));
    env.api.emit("qwen35.stream", ev(32, " is 42."));
    assert.equal(panel(gen).answer, "The answer is 42.");
    assert.equal(panel(gen).thinkingHidden, true);
    env.api.emit("qwen35.stream", ev(33, " More."));
    env.api.emit("execution_interrupted", { prompt_id: "P1" });
    assert.deepEqual([panel(gen).answer, panel(gen).stats], ["The answer is 42. More.", "stopped after 33 tokens"]);
  },
  // the thinking ends at the runtime's </think> token (the event that `closes` it), not where its text spells
  // "</think>" out of ordinary tokens: the page shows what the node's outputs will say, all the way
  async "thinking that spells </think> stays thinking until the token that ends it"() {
    const { env, g, gen } = await page();
    env.api.emit("qwen35.stream", tokenEvent(0, ""));
    for (const [n, delta] of [[1, "<think>Hmm"], [2, " </thi"], [3, "nk>"], [4, " so"], [5, " </think>"]]) {
      env.api.emit("qwen35.stream", tokenEvent(n, delta));
      assert.equal(panel(gen).answer, "", `an answer shown after token ${n}`);
    }
    assert.deepEqual([panel(gen).thinking, panel(gen).thinkingOpen], ["Hmm </think> so </think>", true]);
    env.api.emit("qwen35.stream", tokenEvent(6, "</think>", { closes: true }));
    assert.deepEqual([panel(gen).thinking, panel(gen).answer, panel(gen).thinkingOpen],
      ["Hmm </think> so </think>", "", false]);
    env.api.emit("qwen35.stream", tokenEvent(7, "\n\nRed", { answering: true }));
    env.api.emit("qwen35.stream", tokenEvent(8, " </think>.", { answering: true }));
    const streamedView = [panel(gen).thinking, panel(gen).answer];
    assert.deepEqual(streamedView, ["Hmm </think> so </think>", "Red </think>."]);
    finish(env, g, "Red </think>.", "Hmm </think> so </think>");
    assert.deepEqual([panel(gen).thinking, panel(gen).answer, panel(gen).streaming], [...streamedView, false]);
  },
  // the close token's delta can carry text before the tag (the end of a character the token before it began):
  // that text is thinking, the answer starts after the delta; a page that joins at that event splits it so too
  async "the boundary inside a delta: its text before the tag is thinking"() {
    for (const joined of [false, true]) {
      const { env, gen } = await page();
      if (!joined) {
        env.api.emit("qwen35.stream", tokenEvent(0, ""));
        env.api.emit("qwen35.stream", tokenEvent(1, "Caf"));
      }
      env.api.emit("qwen35.stream", tokenEvent(2, "\u00e9</think>", { closes: true }));
      assert.deepEqual([panel(gen).thinking, panel(gen).answer], [joined ? "\u00e9" : "Caf\u00e9", ""]);
      env.api.emit("qwen35.stream", tokenEvent(3, "\n\nA caf\u00e9.", { answering: true }));
      assert.deepEqual([panel(gen).thinking, panel(gen).answer], [joined ? "\u00e9" : "Caf\u00e9", "A caf\u00e9."]);
    }
  },
  // with thinking off the model's text is all answer, a literal </think> in it too, to the end of the run
  async "an answer without thinking keeps a </think> it writes"() {
    const { env, g, gen } = await page();
    const ev = (n, delta) => tokenEvent(n, delta, { thinking: false });
    env.api.emit("qwen35.stream", ev(0, ""));
    env.api.emit("qwen35.stream", ev(1, "Tags: "));
    env.api.emit("qwen35.stream", ev(2, "</think>"));
    env.api.emit("qwen35.stream", ev(3, " and more"));
    assert.deepEqual([panel(gen).thinkingHidden, panel(gen).thinking, panel(gen).answer],
      [true, "", "Tags: </think> and more"]);
    finish(env, g, "Tags: </think> and more", "");
    assert.deepEqual([panel(gen).thinkingHidden, panel(gen).answer], [true, "Tags: </think> and more"]);
  },
  // max_new_tokens reached while thinking (a spelled </think> in it): no answer while it streams, nor after
  async "a run cut at max_new_tokens while thinking has no answer"() {
    const { env, g, gen } = await page();
    const ev = (n, delta) => tokenEvent(n, delta, { max: 4 });
    env.api.emit("qwen35.stream", ev(0, ""));
    for (const [n, delta] of [[1, "The tag"], [2, " </"], [3, "think>"], [4, " ends"]]) {
      env.api.emit("qwen35.stream", ev(n, delta));
    }
    assert.deepEqual([panel(gen).thinking, panel(gen).answer, panel(gen).stats],
      ["The tag </think> ends", "", "4 / 4 tokens"]);
    finish(env, g, "", "The tag </think> ends", { n_tokens: 4, finish_reason: "length" });
    assert.deepEqual([panel(gen).thinking, panel(gen).thinkingHidden, panel(gen).answer, panel(gen).streaming],
      ["The tag </think> ends", false, "", false]);
  },
  // a page that missed the event that closed the thinking (its connection dropped) cuts before the first event
  // that says `answering`, not at a "</think>" the thinking spelled
  async "a missed closing event is not made up from the text"() {
    const { env, gen } = await page();
    env.api.emit("qwen35.stream", tokenEvent(0, ""));
    env.api.emit("qwen35.stream", tokenEvent(1, "Hmm </think> so"));
    env.api.emit("qwen35.stream", tokenEvent(4, "Red", { answering: true }));
    assert.deepEqual([panel(gen).thinking, panel(gen).answer], ["Hmm </think> so", "Red"]);
  },
  // events of an earlier node version (no `closes`): cut as that node cut, at the text's first </think>, as soon
  // as the text shows it
  async "an earlier node's events are cut at the text"() {
    const { env, gen } = await page();
    const ev = (n, delta) => ({ node: "5", display_node: "5", item: 0, prompt_id: "P1", delta, n, max: 256, t: 0,
      thinking: true, answering: false });
    env.api.emit("qwen35.stream", { ...ev(0, ""), answering: undefined });
    env.api.emit("qwen35.stream", ev(1, "<think>So red"));
    env.api.emit("qwen35.stream", ev(2, "</think>"));
    assert.deepEqual([panel(gen).thinking, panel(gen).answer, panel(gen).thinkingOpen], ["So red", "", false]);
    env.api.emit("qwen35.stream", { ...ev(3, "Red."), answering: true });
    assert.deepEqual([panel(gen).thinking, panel(gen).answer], ["So red", "Red."]);
  },
  // an earlier node's events, joined while the model thinks: the cut at the text's first </think>
  async "a page that joins while the model thinks shows the thinking apart"() {
    const { env, gen } = await page();
    const ev = (n, delta, answering) => ({ node: "5", display_node: "5", item: 0, prompt_id: "P1", delta, n,
      max: 256, t: 0, thinking: true, answering });
    env.api.emit("qwen35.stream", ev(5, " so red", false));
    env.api.emit("qwen35.stream", ev(6, "</think>", false));
    env.api.emit("qwen35.stream", ev(7, "Red.", true));
    assert.deepEqual([panel(gen).thinking, panel(gen).answer], ["so red", "Red."]);
  },
  // a list's answer that ended (end of turn, before max_new_tokens) without closing its thinking is all answer,
  // as nodes/text.py splits it; one cut at max_new_tokens there has none
  async "a finished answer of a list is split as the node splits it"() {
    const { env, gen } = await page();
    const ev = (item, n, delta, max = 256, more = {}) => tokenEvent(n, delta, { item, max, ...more });
    env.api.emit("qwen35.stream", ev(0, 0, ""));
    env.api.emit("qwen35.stream", ev(0, 1, "A red"));
    env.api.emit("qwen35.stream", ev(0, 2, " car."));
    env.api.emit("qwen35.stream", ev(1, 0, "", 2));
    env.api.emit("qwen35.stream", ev(1, 1, "Hmm", 2));
    env.api.emit("qwen35.stream", ev(1, 2, " no", 2));
    env.api.emit("qwen35.stream", ev(2, 0, ""));
    env.api.emit("qwen35.stream", ev(2, 1, "Hmm"));
    env.api.emit("qwen35.stream", ev(2, 2, "</think>", 256, { closes: true }));
    env.api.emit("qwen35.stream", ev(2, 3, "A dog.", 256, { answering: true }));
    assert.equal(panel(gen).answer, "[1] A red car.\n\n[2] \n\n[3] A dog.");
    env.api.emit("execution_interrupted", { prompt_id: "P1" });
    assert.equal(panel(gen).stats, "stopped after 3 tokens of answer 3");
  },
  // a page that joins a list mid-way numbers the answers by their place in the list
  async "a page that joins mid-list numbers the answers by their place"() {
    const { env, gen } = await page();
    const ev = (item, n, delta) => tokenEvent(n, delta, { item, max: 64, thinking: false });
    env.api.emit("qwen35.stream", ev(1, 7, " dog."));
    env.api.emit("qwen35.stream", ev(2, 0, ""));
    env.api.emit("qwen35.stream", ev(2, 1, "A cat."));
    assert.equal(panel(gen).answer, "[2] dog.\n\n[3] A cat.");
    env.api.emit("execution_interrupted", { prompt_id: "P1" });
    assert.equal(panel(gen).stats, "stopped after 1 tokens of answer 3");
  },
  // a past job opened again: the front end's outputs are keyed "<subgraph id>:<node id>" inside a subgraph
  async "a past job's outputs fill the panels of nodes inside a subgraph too"() {
    const { ext, g, gen } = await page();
    const sub = new FakeGraph();
    g.subgraphs = new Map([["0b4e4e0e-0000-4000-8000-000000000001", sub]]);
    const inner = makeNode(sub, "Qwen35Generate", 5);
    const out = (text) => ({ text: [text], thinking: [""], qwen35_generate: [{ n_tokens: 2, first_token_ms: 5,
      decode_tokens_per_s: 9, finish_reason: "stop" }] });
    ext.onNodeOutputsUpdated({ "0b4e4e0e-0000-4000-8000-000000000001:5": out("inside"), 5: out("outside") });
    assert.deepEqual([panel(inner).answer, panel(gen).answer], ["inside", "outside"]);
  },
  // the page ties a prompt to the workflow that queued it until its end event; one removed from the queue before it
  // ran gets none, and is let go when ComfyUI says the queue is empty (not by a word said before it was queued)
  async "a prompt removed from the queue lets go of its workflow"() {
    const { env } = await page();
    let workflow = { name: "a tab closed later" };
    env.workflowStore.activeWorkflow = workflow;
    await env.api.queuePrompt(0, {});
    const tie = new WeakRef(workflow);
    env.workflowStore.activeWorkflow = workflow = null;
    env.api.emit("status", { exec_info: { queue_remaining: 0 } }); // said before the prompt was queued
    assert.ok(await collected(tie) === false, "a prompt still queued lost its workflow");
    env.api.emit("status", { exec_info: { queue_remaining: 1 } });
    env.api.emit("status", { exec_info: { queue_remaining: 0 } });
    assert.ok(await collected(tie), "the workflow of a prompt removed from the queue is still held");
  },
  // a run all cached can end before queuePrompt answers: its tie is never made
  async "a prompt that ended before queuePrompt answered is not tied"() {
    const env = makeEnv();
    env.app.rootGraph = new FakeGraph();
    env.api.queuePrompt = async () => {
      env.api.emit("execution_start", { prompt_id: "C1" });
      env.api.emit("execution_success", { prompt_id: "C1" });
      return { prompt_id: "C1" };
    };
    await load(env);
    let workflow = { name: "a tab closed later" };
    env.workflowStore.activeWorkflow = workflow;
    await env.api.queuePrompt(0, {});
    const tie = new WeakRef(workflow);
    env.workflowStore.activeWorkflow = workflow = null;
    assert.ok(await collected(tie), "the workflow of a prompt that had ended is still held");
  },
};

// whether the object behind `ref` is gone after garbage collection (node --expose-gc)
async function collected(ref) {
  for (let i = 0; i < 3; i++) {
    await new Promise((r) => setTimeout(r, 0));
    globalThis.gc();
  }
  await new Promise((r) => setTimeout(r, 0));
  return ref.deref() === undefined;
}

let failed = 0;
for (const [name, run] of Object.entries(cases)) {
  try {
    await run();
    console.log(`ok ${name}`);
  } catch (e) {
    failed += 1;
    console.log(`FAILED ${name}\n${e.stack}`);
  }
}
process.exit(failed ? 1 : 0);

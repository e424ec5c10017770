"""The front end in a real browser: headless Chromium (Debian's `chromium`) driven by Playwright.

Loads each example workflow into ComfyUI's page, checks the front end turns it into the prompt we
expect, queues one with the Run button and watches the answer stream onto the Generate node.
Set QWEN35_UPDATE_SCREENSHOT=1 to write the screenshot to docs/screenshot.png (else a temp folder).
"""
from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from comfyui_harness import DEMO_MODEL, ROOT, WORKFLOWS, load_workflow, to_api

pytestmark = pytest.mark.comfyui

CHROMIUM = os.environ.get("QWEN35_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"]


@pytest.fixture(scope="module")
def browser_env(comfy_server):
    pytest.importorskip("playwright.async_api", reason="pip install playwright")
    if not shutil.which(CHROMIUM) and not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} not found (apt-get install chromium)")
    comfy_server.post("/settings/Comfy.TutorialCompleted", True)  # no first-run template dialog
    return comfy_server


async def _open(playwright, url: str, user_dir: str):
    ctx = await playwright.chromium.launch_persistent_context(
        user_dir, executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS,
        viewport={"width": 1600, "height": 900})
    await ctx.grant_permissions(["clipboard-read", "clipboard-write"], origin=url)
    page = ctx.pages[0] if ctx.pages else await ctx.new_page()
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    await page.goto(url)
    await page.wait_for_function(
        "window.app && window.app.graph && app.extensions.some(e => e.name === 'qwen35.fast')", timeout=90_000)
    return ctx, page, errors


def _in_browser(env, body):
    """await body(page) on ComfyUI's page in a fresh headless Chromium; its result, once the page has raised
    no error."""
    from playwright.async_api import async_playwright

    async def run():
        # the browser's profile (~7 MB) goes with the test: the machine's disk is shared with later runs
        with tempfile.TemporaryDirectory(prefix="qwen35-chromium-", ignore_cleanup_errors=True) as user_dir:
            async with async_playwright() as p:
                ctx, page, errors = await _open(p, env.url, user_dir)
                try:
                    out = await body(page)
                    assert not errors, errors
                    return out
                finally:
                    await ctx.close()

    return asyncio.run(run())


GENERATE_VIEW = "app.graph.nodes.find(n => n.type === 'Qwen35Generate').qwen35"


def _one_long_answer() -> dict:
    """The two-seeds example with one Generate: an answer long enough to cancel while it streams."""
    workflow = load_workflow("qwen35_one_prefill_two_seeds.json")
    workflow["nodes"] = [n for n in workflow["nodes"] if n["id"] != 4]
    workflow["links"] = [link for link in workflow["links"] if link[3] != 4]
    return workflow


async def _set_widget(page, node_type: str, widget: str, expression: str):
    """The first `node_type` node's widget set to the JavaScript `expression` (of its value `v`)."""
    await page.evaluate(f"""() => {{ const w = app.graph.nodes.find(n => n.type === '{node_type}')
        .widgets.find(w => w.name === '{widget}'); const v = w.value; w.value = {expression}; }}""")


async def _load(page, workflow: dict, max_new_tokens: int):
    types = sorted({n["type"] for n in workflow["nodes"]})
    for _ in range(3):  # once a CI run's busy page lost the graph just loaded (none of its nodes there): again
        await page.evaluate("wf => app.loadGraphData(wf)", workflow)
        await page.wait_for_timeout(300)
        if await page.evaluate("types => types.every(t => app.graph.nodes.some(n => n.type === t))", types):
            break
    else:
        raise AssertionError(f"the page did not keep the workflow's nodes {types}")
    await page.evaluate("""([model, maxNew]) => {
        for (const n of app.graph.nodes) for (const w of n.widgets ?? []) {
            if (n.type === 'Qwen35ModelLoader' && w.name === 'model') w.value = model;
            if (n.type === 'Qwen35Generate' && w.name === 'max_new_tokens') w.value = maxNew;
        }
        app.graph.setDirtyCanvas(true, true);
    }""", [DEMO_MODEL, max_new_tokens])


def test_front_end_reads_every_example_workflow(browser_env, object_info):
    async def body(page):
        for path in sorted(WORKFLOWS.glob("*.json")):
            workflow = load_workflow(path.name)
            await page.evaluate("wf => app.loadGraphData(wf)", workflow)
            theirs = await page.evaluate("async () => (await app.graphToPrompt()).output")
            ours = to_api(workflow, object_info)
            for nid, node in ours.items():
                if node["class_type"].startswith("Qwen35"):  # every node of ours, sockets and all
                    assert theirs[nid]["class_type"] == node["class_type"], path.name
                    assert theirs[nid]["inputs"] == node["inputs"], (path.name, nid)

    _in_browser(browser_env, body)


def test_answer_streams_onto_the_node_in_the_browser(browser_env):
    update = os.environ.get("QWEN35_UPDATE_SCREENSHOT") == "1"
    shot = ROOT / "docs" / "screenshot.png" if update else Path(tempfile.mkdtemp()) / "screenshot.png"

    async def body(page):
        await _load(page, load_workflow("qwen35_one_prefill_two_seeds.json"), max_new_tokens=48)
        await page.get_by_test_id("queue-button").click()
        # text on the node while the cursor still blinks: it arrived token by token
        await page.wait_for_function(
            "[...document.querySelectorAll('.qwen35-answer.qwen35-streaming')]"
            ".some(e => e.textContent.trim().length > 60)", timeout=180_000)
        streaming_text = await page.evaluate(
            "[...document.querySelectorAll('.qwen35-answer.qwen35-streaming')]"
            ".map(e => e.textContent).find(t => t.trim())")
        shot.parent.mkdir(parents=True, exist_ok=True)
        await page.screenshot(path=str(shot))  # mid-answer: the text as it streams in
        await page.wait_for_function(
            "[...document.querySelectorAll('.qwen35-stats')]"
            ".filter(e => e.textContent.includes('tok/s decode')).length === 2", timeout=300_000)
        answers = await page.evaluate("""() => app.graph.nodes
            .filter(n => n.type === 'Qwen35Generate')
            .map(n => [String(n.id), n.qwen35.answer.textContent])""")
        prefill_stats = await page.evaluate(
            "[...document.querySelectorAll('.qwen35-stats')].map(e => e.textContent)")
        # the copy button puts the answer on the clipboard
        await page.locator(".qwen35-bar button").first.click()
        copied = await page.evaluate("navigator.clipboard.readText()")
        first_answer = await page.evaluate("document.querySelector('.qwen35-answer').textContent")
        return streaming_text, dict(answers), prefill_stats, copied, first_answer

    streaming_text, answers, stats, copied, first_answer = _in_browser(browser_env, body)
    assert streaming_text.strip()
    assert any("prompt tokens" in s and "tok/s" in s for s in stats), stats
    assert copied == first_answer
    history = browser_env.get("/history?max_items=1")
    outputs = next(iter(history.values()))["outputs"]
    for nid, shown in answers.items():
        assert shown == outputs[nid]["text"][0], f"node {nid}: the node shows other text than /history"
    assert shot.stat().st_size > 10_000


def test_thinking_is_folded_away_in_the_browser(browser_env):
    async def body(page):
        await _load(page, load_workflow("qwen35_thinking.json"), max_new_tokens=24)
        await page.get_by_test_id("queue-button").click()
        await page.wait_for_function(
            "[...document.querySelectorAll('.qwen35-stats')].some(e => e.textContent.includes('decode'))",
            timeout=300_000)
        return await page.evaluate("""() => {
            const d = document.querySelector('details.qwen35-thinking');
            return {hidden: d.hidden, open: d.open,
                    thinking: d.querySelector('.qwen35-thinking-text').textContent};
        }""")

    state = _in_browser(browser_env, body)
    history = browser_env.get("/history?max_items=1")
    outputs = next(iter(history.values()))["outputs"]
    gen = next(nid for nid, out in outputs.items() if "qwen35_generate" in out)
    assert state["thinking"] == outputs[gen]["thinking"][0]
    assert not state["open"], "thinking should be folded once the answer is there"
    assert state["hidden"] == (not outputs[gen]["thinking"][0])


def test_a_page_reloaded_while_it_thinks_keeps_the_thinking_apart(browser_env):
    """The page reloaded while a thinking answer streams (the same tab: ComfyUI keeps its client id, so the rest of
    the stream comes to the new page, which never saw the answer's first event): the rest of the thinking goes on
    into the folded-open Thinking panel, not into the answer."""
    async def body(page):
        thinking = load_workflow("qwen35_thinking.json")
        await _load(page, thinking, max_new_tokens=5000)
        await _set_widget(page, "Qwen35Generate", "seed", "9191")
        await page.get_by_test_id("queue-button").click()
        await page.wait_for_function(f"() => {GENERATE_VIEW}.thinkingText.textContent.length > 20", timeout=180_000)
        await page.reload()
        await page.wait_for_function("() => !!window.app?.graph?.nodes.find(n => n.type === 'Qwen35Generate')?.qwen35",
                                     timeout=120_000)
        await page.wait_for_function(f"() => {GENERATE_VIEW}.thinkingText.textContent.length > 20", timeout=120_000)
        state = await page.evaluate(f"""() => {{ const v = {GENERATE_VIEW};
            return {{thinking: v.thinkingText.textContent, answer: v.answer.textContent, hidden: v.thinking.hidden,
                     open: v.thinking.open}}; }}""")
        await asyncio.to_thread(browser_env.post, "/interrupt", {})
        return state

    state = _in_browser(browser_env, body)
    assert not state["hidden"] and state["open"], state
    assert "</think>" in state["answer"] or not state["answer"].strip(), state  # (random weights rarely end it)


def test_a_past_job_opened_again_shows_its_outputs_on_the_panels(browser_env):
    """What opening a past job does (the front end loads its graph, then hands its outputs to the extensions'
    onNodeOutputsUpdated through app.nodeOutputs): the loader, prefill and Generate panels show them, as ComfyUI's
    own nodes show theirs."""
    async def body(page):
        await _load(page, load_workflow("qwen35_thinking.json"), max_new_tokens=8)
        await page.get_by_test_id("queue-button").click()
        await page.wait_for_function(f"() => {GENERATE_VIEW}.stats.textContent.includes('decode')", timeout=300_000)
        job = next(iter((await asyncio.to_thread(browser_env.get, "/history?max_items=1")).values()))
        await page.evaluate("wf => app.loadGraphData(wf)", job["prompt"][3]["extra_pnginfo"]["workflow"])
        await page.wait_for_timeout(300)
        blank = await page.evaluate(f"() => {GENERATE_VIEW}.answer.textContent")
        await page.evaluate("outputs => { app.nodeOutputs = outputs; }", job["outputs"])
        panels = await page.evaluate("""() => app.graph.nodes.filter(n => n.qwen35).map(n => ({type: n.type,
            stats: n.qwen35.stats.textContent, answer: n.qwen35.answer?.textContent}))""")
        return blank, panels, job["outputs"]

    blank, panels, outputs = _in_browser(browser_env, body)
    assert blank == "", "a graph loaded anew starts with blank panels"
    by_type = {p["type"]: p for p in panels}
    assert set(by_type) == {"Qwen35ModelLoader", "Qwen35TextPrefill", "Qwen35Generate"}
    assert all(p["stats"] for p in panels), panels
    text = next(out["text"][0] for out in outputs.values() if "qwen35_generate" in out)
    assert by_type["Qwen35Generate"]["answer"] == text


def test_cancel_leaves_the_partial_answer_marked_stopped(browser_env):
    async def body(page):
        await _load(page, _one_long_answer(), max_new_tokens=5000)
        await _set_widget(page, "Qwen35Generate", "seed", "4242")
        await page.get_by_test_id("queue-button").click()
        await page.wait_for_function(
            "[...document.querySelectorAll('.qwen35-answer.qwen35-streaming')]"
            ".some(e => e.textContent.trim().length > 10)", timeout=180_000)
        await asyncio.to_thread(browser_env.post, "/interrupt", {})
        await page.wait_for_function(
            "[...document.querySelectorAll('.qwen35-stats')].some(e => e.textContent.startsWith('stopped'))",
            timeout=60_000)
        return await page.evaluate("""() => ({
            streaming: document.querySelectorAll('.qwen35-answer.qwen35-streaming').length,
            answer: document.querySelector('.qwen35-answer').textContent,
            stats: [...document.querySelectorAll('.qwen35-stats')].map(e => e.textContent)})""")

    state = _in_browser(browser_env, body)
    assert state["streaming"] == 0 and state["answer"].strip()
    assert any(s.startswith("stopped after ") for s in state["stats"]), state["stats"]


def test_a_generate_node_inside_a_subgraph_streams_and_stops(browser_env):
    """A node inside a subgraph runs with a path id ("outer:inner"): its stream reaches it, not a node of the
    outer graph that happens to have the inner id, and a cancel marks it stopped."""
    async def body(page):
        await _load(page, _one_long_answer(), max_new_tokens=5000)
        await _set_widget(page, "Qwen35Generate", "seed", "4343")
        await page.evaluate("""() => app.rootGraph.convertToSubgraph(
            new Set([app.graph.nodes.find(n => n.type === 'Qwen35Generate')]))""")
        inner = ("[...app.rootGraph.subgraphs.values()].flatMap(s => s.nodes)"
                 ".find(n => n.type === 'Qwen35Generate').qwen35")
        assert await page.evaluate(f"() => !app.graph.nodes.some(n => n.type === 'Qwen35Generate') && !!{inner}")
        await page.get_by_test_id("queue-button").click()
        await page.wait_for_function(f"() => {inner}.answer.textContent.trim().length > 10", timeout=180_000)
        await asyncio.to_thread(browser_env.post, "/interrupt", {})
        await page.wait_for_function(f"() => {inner}.stats.textContent.startsWith('stopped')", timeout=60_000)
        return await page.evaluate(f"""() => ({{answer: {inner}.answer.textContent,
            streaming: {inner}.answer.classList.contains('qwen35-streaming'), stats: {inner}.stats.textContent}})""")

    state = _in_browser(browser_env, body)
    assert state["answer"].strip() and not state["streaming"]
    assert state["stats"].startswith("stopped after "), state["stats"]


async def _open_tab(page, max_new_tokens: int, seed: int) -> str:
    """A new workflow tab with the one-Generate workflow (the same node ids in every such tab); its path."""
    await page.wait_for_function("() => app.extensionManager.workflow.activeWorkflow")  # the first tab is open
    await _load(page, _one_long_answer(), max_new_tokens=max_new_tokens)
    await _set_widget(page, "Qwen35Generate", "seed", str(seed))
    return await page.evaluate("() => app.extensionManager.workflow.activeWorkflow.path")


async def _show(page, path: str):
    """A click on the tab of the open workflow `path`: its graph is made again from its saved state."""
    label = path.removeprefix("workflows/").removesuffix(".json")
    await page.locator(".workflow-tab .workflow-label").get_by_text(label, exact=True).click()
    await page.wait_for_function("path => app.extensionManager.workflow.activeWorkflow.path === path", arg=path)
    await page.wait_for_timeout(200)  # the rest of the switch (outputs restored) is not awaited by the click


async def _watch_runs(page):
    """Every stream event the page gets, with the workflow shown when it came; window.qwen35Done once the
    run ends."""
    await page.evaluate("""() => {
        window.qwen35Seen = []; window.qwen35Done = false;
        app.api.addEventListener('qwen35.stream', ({detail}) => window.qwen35Seen.push(
            {...detail, shown: app.extensionManager.workflow.activeWorkflow.path}));
        for (const e of ['execution_success', 'execution_interrupted', 'execution_error'])
            app.api.addEventListener(e, () => { window.qwen35Done = true; });
    }""")


async def _queue_in_first_of_two_tabs(page, max_new_tokens: int, seeds: tuple[int, int]) -> tuple[str, str]:
    """Two workflow tabs with the same nodes (each Generate's max_new_tokens, seeds A's and B's); A shown, the
    runs watched (_watch_runs) and A queued. Returns the two tabs' paths."""
    a = await _open_tab(page, max_new_tokens=max_new_tokens, seed=seeds[0])
    b = await _open_tab(page, max_new_tokens=max_new_tokens, seed=seeds[1])
    await _show(page, a)
    await _watch_runs(page)
    await page.get_by_test_id("queue-button").click()
    return a, b


async def _panel(page) -> dict:
    return await page.evaluate(f"""() => {{ const v = {GENERATE_VIEW};
        return {{answer: v.answer.textContent, stats: v.stats.textContent,
                 streaming: v.answer.classList.contains('qwen35-streaming')}}; }}""")


def test_a_stream_stays_in_the_workflow_that_queued_it(browser_env):
    """Two workflow tabs with the same nodes: A's answer streams into A's Generate only, not into B's node of the
    same id while B is shown, and A's panel has the whole answer so far (and goes on) when A is shown again."""
    async def body(page):
        a, b = await _queue_in_first_of_two_tabs(page, 5000, (4545, 4646))
        await page.wait_for_function(f"() => {GENERATE_VIEW}.answer.textContent.trim().length > 10",
                                     timeout=180_000)
        await _show(page, b)
        await page.wait_for_function(
            f"() => window.qwen35Seen.filter(e => e.shown === {b!r}).length >= 20", timeout=120_000)
        b_while_a_streams = await _panel(page)
        await _show(page, a)
        shown_on_return = (await _panel(page))["answer"]
        await page.wait_for_function(
            f"n => {GENERATE_VIEW}.answer.textContent.length > n", arg=len(shown_on_return), timeout=60_000)
        await asyncio.to_thread(browser_env.post, "/interrupt", {})
        await page.wait_for_function(f"() => {GENERATE_VIEW}.stats.textContent.startsWith('stopped')",
                                     timeout=60_000)
        a_stopped = await _panel(page)
        streamed = await page.evaluate("() => window.qwen35Seen.map(e => e.delta).join('')")
        await _show(page, b)
        return b_while_a_streams, shown_on_return, a_stopped, streamed, await _panel(page)

    b_while, shown_on_return, a_stopped, streamed, b_after = _in_browser(browser_env, body)
    empty = {"answer": "", "stats": "", "streaming": False}
    assert b_while == empty, "A's stream reached B's node of the same id"
    assert b_after == empty
    assert len(shown_on_return.strip()) > 10, "A's answer so far is gone once A is shown again"
    assert streamed.startswith(shown_on_return)
    assert a_stopped["answer"] == streamed and not a_stopped["streaming"]
    assert a_stopped["stats"].startswith("stopped after "), a_stopped["stats"]


def test_an_answer_finished_in_a_hidden_workflow_shows_on_return(browser_env):
    """A's run ends while B is shown: B's node never shows A's answer, and A's node shows it (as /history has it)
    when A is shown again."""
    async def body(page):
        a, b = await _queue_in_first_of_two_tabs(page, 64, (4747, 4848))
        await page.wait_for_function("() => window.qwen35Seen.length > 0", timeout=180_000)
        await _show(page, b)
        await page.wait_for_function("() => window.qwen35Done", timeout=300_000)
        b_after_run = await _panel(page)
        await _show(page, a)
        a_back = await _panel(page)
        await _show(page, b)
        return b_after_run, a_back, await _panel(page)

    b_after_run, a_back, b_again = _in_browser(browser_env, body)
    history = browser_env.get("/history?max_items=1")
    outputs = next(iter(history.values()))["outputs"]
    text = next(out for out in outputs.values() if "qwen35_generate" in out)["text"][0]
    empty = {"answer": "", "stats": "", "streaming": False}
    assert b_after_run == empty and b_again == empty, "A's answer reached B's node of the same id"
    assert a_back["answer"] == text and not a_back["streaming"]
    assert "tok/s decode" in a_back["stats"], a_back["stats"]


def test_an_answer_finished_in_a_hidden_workflow_shows_inside_its_subgraph_on_return(browser_env):
    """As above for a Generate node inside a subgraph: the front end hands the outputs back when A is shown again
    keyed by the node's locator ("<subgraph id>:<node id>"), which the page finds inside the subgraph."""
    inner = ("[...app.rootGraph.subgraphs.values()].flatMap(s => s.nodes)"
             ".find(n => n.type === 'Qwen35Generate')?.qwen35")

    async def body(page):
        a = await _open_tab(page, max_new_tokens=64, seed=4949)
        await page.evaluate("""() => { app.rootGraph.convertToSubgraph(
            new Set([app.graph.nodes.find(n => n.type === 'Qwen35Generate')]));
            app.extensionManager.workflow.activeWorkflow.changeTracker?.checkState(); }""")
        b = await _open_tab(page, max_new_tokens=64, seed=5050)
        await _show(page, a)
        assert await page.evaluate(f"() => !!{inner}"), "tab A lost its subgraph"
        await _watch_runs(page)
        await page.get_by_test_id("queue-button").click()
        await page.wait_for_function("() => window.qwen35Seen.length > 0", timeout=180_000)
        await _show(page, b)
        await page.wait_for_function("() => window.qwen35Done", timeout=300_000)
        await _show(page, a)
        keys = await page.evaluate("() => Object.keys(app.nodeOutputs ?? {})")
        return keys, await page.evaluate(f"""() => ({{answer: {inner}.answer.textContent,
            stats: {inner}.stats.textContent, streaming: {inner}.answer.classList.contains('qwen35-streaming')}})""")

    keys, panel = _in_browser(browser_env, body)
    outputs = next(iter(browser_env.get("/history?max_items=1").values()))["outputs"]
    text = next(out for out in outputs.values() if "qwen35_generate" in out)["text"][0]
    assert panel["answer"] == text and not panel["streaming"], (keys, panel)
    assert "tok/s decode" in panel["stats"], panel["stats"]


def test_one_caption_per_image_shows_every_answer(browser_env):
    """A list of prefills comes to Generate in one run, answered image by image: while the second answer streams the first stays on the
    node ([1] ..., [2] ...); at the end the node shows every answer, numbered, and one stats line over them. The
    prefill's stats are one line per prefill, drawn whole (the panel as tall as its wrapped lines), the whole
    text in its tooltip."""
    async def body(page):
        await _load(page, load_workflow("qwen35_caption_each_image.json"), max_new_tokens=12)
        # a prompt of its own: the server tests run this workflow too and look for its prefill's output
        await _set_widget(page, "Qwen35MultimodalPrefill", "prompt", "v + ' (browser)'")
        await page.get_by_test_id("queue-button").click()
        await page.wait_for_function(
            "[...document.querySelectorAll('.qwen35-answer.qwen35-streaming')]"
            ".some(e => e.textContent.includes('\\n\\n[2] '))", timeout=300_000)
        streaming = await page.evaluate(
            "() => document.querySelector('.qwen35-answer.qwen35-streaming').textContent")
        await page.wait_for_function(
            "[...document.querySelectorAll('.qwen35-stats')].some(e => e.textContent.includes('answers'))",
            timeout=300_000)
        return await page.evaluate("""(streaming) => ({
            streaming,
            answer: document.querySelector('.qwen35-answer').textContent,
            stats: [...document.querySelectorAll('.qwen35-stats')].map(e => e.textContent),
            prefill: (() => { const e = app.graph.nodes.find(n => n.type === 'Qwen35MultimodalPrefill').qwen35.stats;
                return {text: e.textContent, title: e.title, hidden: e.scrollHeight - e.clientHeight}; })()})""",
            streaming)

    state = _in_browser(browser_env, body)
    history = browser_env.get("/history?max_items=1")
    outputs = next(iter(history.values()))["outputs"]
    texts = next(out for out in outputs.values() if "qwen35_generate" in out)["text"]
    assert len(texts) == 2
    assert state["streaming"].startswith(f"[1] {texts[0]}\n\n[2] "), state["streaming"]
    assert state["answer"] == "\n\n".join(f"[{i + 1}/2] {t}" for i, t in enumerate(texts))
    assert any(s.startswith("2 answers · ") for s in state["stats"]), state["stats"]
    prefill = state["prefill"]
    assert len(prefill["text"].split("\n")) == 2 and prefill["title"] == prefill["text"] and prefill["hidden"] <= 1


def test_an_empty_list_leaves_no_earlier_answer_or_stats(browser_env):
    """Generate given an empty list of prefills sends no text and no stats (nodes/text.py's ui for it): after an
    answer, the panel keeps neither that answer nor its stats, and says that no answers came."""
    async def body(page):
        await _load(page, _one_long_answer(), max_new_tokens=8)
        return await page.evaluate("""() => { const n = app.graph.nodes.find(n => n.type === 'Qwen35Generate');
            n.onExecuted({text: ['an answer'], thinking: [''], qwen35_generate: [{n_tokens: 3, first_token_ms: 12.5,
                          decode_tokens_per_s: 40.0, finish_reason: 'stop'}]});
            const before = n.qwen35.stats.textContent;
            n.onExecuted({text: [], thinking: [], qwen35_generate: []});
            return {before, answer: n.qwen35.answer.textContent, stats: n.qwen35.stats.textContent}; }""")

    state = _in_browser(browser_env, body)
    assert state["before"].startswith("first token "), state
    assert state["answer"] == "" and "first token" not in state["stats"], state
    assert state["stats"].startswith("no answers"), state


def test_a_list_of_answers_counts_the_ones_cut_short(browser_env):
    """The summary of a list of answers counts, from nodes/text.py's flags (not its wording), the answers that
    stopped while thinking and those cut where the model's positions ran out, with the fix for each."""
    async def body(page):
        await _load(page, _one_long_answer(), max_new_tokens=8)
        return await page.evaluate("""() => { const n = app.graph.nodes.find(n => n.type === 'Qwen35Generate');
            const one = (extra) => ({n_tokens: 4, first_token_ms: 10, decode_tokens_per_s: 50, finish_reason: 'length',
                                     no_answer: false, positions_ran_out: false, ...extra});
            const said = (list) => { n.onExecuted({text: list.map(() => ''), thinking: list.map(() => ''),
                                                   qwen35_generate: list}); return n.qwen35.stats.textContent; };
            return [said([one({}), one({no_answer: true, note: 'any wording'}), one({no_answer: true})]),
                    said([one({positions_ran_out: true}), one({no_answer: true, positions_ran_out: true})]),
                    said([one({note: 'stopped while thinking'}), one({})])]; }""")

    thinking, full, plain = _in_browser(browser_env, body)
    assert thinking.startswith("3 answers · ") and thinking.endswith(
        " · 12 tokens · 2 stopped while thinking, with no answer: raise max_new_tokens"), thinking
    assert full.endswith(" · 1 stopped while thinking, with no answer · 2 stopped where the prompt and the answer "
                         "filled the model's positions: shorten the prompt"), full
    assert plain.endswith(" · 8 tokens"), plain


def test_cached_outputs_show_on_the_loader_and_prefill_in_a_new_page(browser_env):
    """A run whose every node comes from ComfyUI's cache, queued from a page that never saw the first run: the
    loader's and the prefill's panels show their stats too (ComfyUI sends their ui again), not only Generate's."""
    workflow = _one_long_answer()

    async def run(page):
        await _load(page, workflow, max_new_tokens=6)
        await _set_widget(page, "Qwen35Generate", "seed", "777")
        await page.get_by_test_id("queue-button").click()
        # every panel filled: the cached nodes' ui messages come in no fixed order (on a busy machine the loader's
        # can follow Generate's); a panel that never fills fails on the timeout
        panels = """() => Object.fromEntries(app.graph.nodes.filter(n => n.qwen35)
            .map(n => [n.type, n.qwen35.stats.textContent]))"""
        await page.wait_for_function(
            f"Object.values(({panels})()).every(t => t) && "
            "[...document.querySelectorAll('.qwen35-stats')].some(e => e.textContent.startsWith('first token'))",
            timeout=300_000)
        return await page.evaluate(panels)

    _in_browser(browser_env, run)  # the first run, in one page
    panels = _in_browser(browser_env, run)  # the same prompt from a new page: every output cached
    assert panels["Qwen35ModelLoader"].startswith("torch on cpu"), panels
    assert " prompt tokens · " in panels["Qwen35TextPrefill"], panels


def test_workflow_templates_list_the_examples(comfy_server):
    templates = comfy_server.get("/workflow_templates")
    ours = next(v for k, v in templates.items() if k.startswith("Qwen3.5-Fast"))
    assert sorted(ours) == sorted(p.stem for p in WORKFLOWS.glob("*.json"))


// Chapter 8's page: the running sequences, the queue, each step's budget, the KV pool, and the lines.
// Every `step` event is the whole picture after a step, so drawing the latest one is always right.
import { connect, show, everyFrame, colourOf, Line, Rate, RecentMedian, wireBursts } from "./live.js";
import { noticeStep, turns, wireChat } from "./chat.js";

const state = { stats: null, step: null, offset: null, log: [], widest: 64, cached: new Set() };
const lines = {
  tokens: new Line("line-tokens", "tokens generated", "/s"),
  rps: new Line("line-rps", "requests finished", "/s"),
  ttft: new Line("line-ttft", "time to first token, median", "ms"),
  tpot: new Line("line-tpot", "time per output token, median", "ms"),
};
const tokenRate = new Rate(), finishRate = new Rate(), ttft = new RecentMedian(), tpot = new RecentMedian();
const toLocal = (t) => { if (state.offset === null) state.offset = performance.now() / 1e3 - t; return t + state.offset; };

function counters(stats) {
  state.stats = stats;
  for (const key of ["steps", "running", "waiting", "finished", "aborted", "preemptions", "tokens_generated",
                     "tokens_per_step", "blocks_used", "blocks_total"]) {
    show(`stat-${key}`, stats[key] ?? "–");
  }
  const hit = stats.prefix_cache && stats.prefix_cache.hit_rate;
  show("stat-prefix_hit_rate", stats.prefix_cache && stats.prefix_cache.enabled ? (hit === null ? "–" : `${(100 * hit).toFixed(1)} %`) : "off");
  for (const key of ["max_num_seqs", "max_num_batched_tokens", "kv_policy"]) show(`cfg-${key}`, stats[key]);
}

function say(text) {
  state.log.unshift(text);
  state.log.length = Math.min(state.log.length, 14);
}

const redraw = everyFrame(draw);

connect({
  hello(data) { toLocal(data.t); counters(data.stats); state.connected = true; redraw(); },
  step(data) {
    const t = toLocal(data.t);
    counters(data.stats);
    state.step = data;
    if (data.cached_blocks !== null) state.cached = new Set(data.cached_blocks);  // sent about once a second
    lines.tokens.add(t, tokenRate.add(t, data.stats.tokens_generated));
    lines.rps.add(t, finishRate.add(t, data.stats.finished));
    for (const l of data.latencies) { ttft.add(t, l.ttft_ms); if (l.tpot_ms !== null) tpot.add(t, l.tpot_ms); }
    lines.ttft.add(t, ttft.at(t));
    lines.tpot.add(t, tpot.at(t));
    if (state.connected) {  // the first step seen: who was running already, not who joined
      state.connected = false;
      say(`step ${data.stats.steps}: ${data.running.length} running when this page connected`);
    } else if (data.joined.length) say(`step ${data.stats.steps}: joined ${data.joined.map((id) => `#${id}`).join(" ")}`);
    for (const [id, why] of data.left) say(`step ${data.stats.steps}: #${id} left (${why})`);
    noticeStep(data);
    if (data.preempted.length) say(`step ${data.stats.steps}: PREEMPTED ${data.preempted.map((id) => `#${id}`).join(" ")} (blocks ran out; recomputed later)`);
    redraw();
  },
});
wireBursts();
wireChat();
setInterval(() => { const now = performance.now() / 1e3; for (const line of Object.values(lines)) line.draw(now); }, 500);

function draw() {
  const step = state.step;
  if (!step) return;
  drawBudget(step);
  drawRunning(step);
  drawWaiting(step);
  drawBlocks(step);
  const now = performance.now() / 1e3;
  for (const line of Object.values(lines)) line.draw(now);
  document.getElementById("log").textContent = state.log.join("\n");
}

function drawBudget(step) {
  const budget = state.stats.max_num_batched_tokens, bar = document.getElementById("budget");
  const parts = [[step.decode_rows, "#3b6fd4"], ...step.prefill.map(([id, , length]) => [length, colourOf(id)])];
  let left = 0;
  bar.replaceChildren(...parts.filter(([n]) => n > 0).map(([n, colour]) => {
    const part = document.createElement("div");
    Object.assign(part.style, { position: "absolute", top: 0, bottom: 0, left: `${(100 * left) / budget}%`,
                                width: `${(100 * n) / budget}%`, background: colour, borderRight: "1px solid #fff" });
    left += n;
    return part;
  }));
  const prefill = step.prefill.reduce((sum, [, , n]) => sum + n, 0);
  show("budget-text", `step ${step.stats.steps}: ${step.decode_rows} decodes + ${step.prefill.length} prompt chunks ` +
       `(${prefill} tokens) = ${left} of ${budget}; model ${(step.timings_ms.model ?? 0).toFixed(1)} ms`);
}

function drawRunning(step) {
  const box = document.getElementById("running");
  for (const [, prompt, , asked] of step.running) state.widest = Math.max(state.widest, prompt + asked);
  const scale = 100 / state.widest;
  const rows = new Map([...box.children].map((row) => [row.dataset.seq, row]));
  const keep = [];
  for (const [id, prompt, generated, asked, computed, preemptions] of step.running) {
    let row = rows.get(String(id));
    if (!row) {
      row = document.createElement("div"); row.className = "row"; row.dataset.seq = id;
      row.innerHTML = `<span class="label">#${id}</span><div class="bar"><div class="prompt"></div><div class="done"></div><div class="new"></div><div class="todo"></div></div>`;
    }
    const [done, fresh, todo] = [row.querySelector(".done"), row.querySelector(".new"), row.querySelector(".todo")];
    const computedPrompt = Math.min(computed, prompt);
    Object.assign(row.querySelector(".prompt").style, { left: 0, width: `${prompt * scale}%` });
    Object.assign(done.style, { left: 0, width: `${computedPrompt * scale}%`, background: "#7d879c" });
    Object.assign(fresh.style, { left: `${prompt * scale}%`, width: `${generated * scale}%`, background: colourOf(id) });
    Object.assign(todo.style, { left: `${(prompt + generated) * scale}%`, width: `${(asked - generated) * scale}%`, background: "#e6e8ee" });
    row.title = `#${id}: prompt ${prompt}, generated ${generated} of ${asked}` + (preemptions ? `, preempted ${preemptions}×` : "");
    row.classList.toggle("yours", turns.sequences.has(String(id)));  // a turn of this page's chat box
    keep.push(row);
  }
  box.replaceChildren(...keep);
}

function drawWaiting(step) {
  const box = document.getElementById("waiting");
  box.replaceChildren(...step.waiting.map(([id, prompt, , preemptions]) => {
    const chip = document.createElement("div"); chip.className = "chip"; chip.dataset.seq = id;
    chip.style.background = colourOf(id);
    if (preemptions) chip.style.outline = "2px solid #d33";
    chip.title = `#${id}: prompt ${prompt}` + (preemptions ? `, preempted ${preemptions}×` : "");
    return chip;
  }));
  const more = step.stats.waiting - step.waiting.length;
  if (more > 0) box.append(Object.assign(document.createElement("span"), { textContent: ` +${more} more` }));
}

function drawBlocks(step) {
  const c = document.getElementById("blocks"), g = c.getContext("2d");
  const total = state.stats.blocks_total, columns = 64, cell = c.width / columns;
  const rowsNeeded = Math.ceil(total / columns);
  if (c.height !== Math.ceil(rowsNeeded * cell)) c.height = Math.ceil(rowsNeeded * cell);
  const owners = new Map(), holders = new Map();
  for (const [id, table] of Object.entries(step.tables)) {
    for (const block of table) { owners.set(block, id); holders.set(block, (holders.get(block) || 0) + 1); }
  }
  const cached = state.cached;
  g.clearRect(0, 0, c.width, c.height);
  for (let block = 0; block < total; block++) {
    const x = (block % columns) * cell, y = Math.floor(block / columns) * cell;
    g.fillStyle = owners.has(block) ? colourOf(owners.get(block)) : cached.has(block) ? "#cfd8f0" : "#f0f1f4";
    g.fillRect(x + 0.5, y + 0.5, cell - 1, cell - 1);
    if ((holders.get(block) || 0) > 1) { g.strokeStyle = "#000"; g.lineWidth = 1.5; g.strokeRect(x + 1.5, y + 1.5, cell - 3, cell - 3); }
  }
  const shared = [...holders.values()].filter((n) => n > 1).length;
  c.dataset.used = owners.size;
  c.dataset.signature = signature(owners);  // the browser test sees the grid change through this
  show("blocks-text", `${owners.size} held by ${Object.keys(step.tables).length} sequences, ${shared} shared, ` +
       `${cached.size} with a cached prefix, ${total - owners.size} free`);
}

/** A short fingerprint of who holds which block. */
function signature(owners) {
  let hash = 2166136261;
  for (const [block, id] of [...owners.entries()].sort((a, b) => a[0] - b[0])) {
    hash = Math.imul(hash ^ (block * 65599 + Number(id)), 16777619) >>> 0;
  }
  return `${owners.size}-${hash.toString(16)}`;
}

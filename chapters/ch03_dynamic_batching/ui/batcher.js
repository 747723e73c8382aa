// Chapter 3's page: the queue, the window's timer, each batch as it leaves and why, and the lines.
import { connect, show, everyFrame, colourOf, Line, Rate, RecentMedian, wireBursts } from "./live.js";

const WHY_COLOURS = { full: "#3b6fd4", min_batch: "#4caf7a", window: "#e0a03b", device_busy: "#9b59b6", draining: "#999" };
const plural = (n, word) => `${n} ${word}${n === 1 ? "" : "s"}`;
const state = { config: null, queued: 0, oldestAt: null, windowMs: 0, batch: null, history: [], log: [], offset: null };
const lines = {
  rps: new Line("line-rps", "requests answered", "/s"),
  latency: new Line("line-latency", "time to the whole answer, median", "ms"),
  perToken: new Line("line-per-token", "batch time per step (÷ its longest answer)", "ms"),
};
const answered = new Rate(), latency = new RecentMedian();

// Event times are the server's clock; the page runs on its own, offset once at the first event.
const toLocal = (t) => { if (state.offset === null) state.offset = performance.now() / 1e3 - t; return t + state.offset; };
const nowS = () => performance.now() / 1e3;

function counters(data) {
  for (const key of ["batches", "requests", "failed_batches", "queued", "largest_batch", "mean_batch"]) {
    if (key in data) show(`stat-${key}`, data[key]);
  }
}

function say(text) {
  state.log.unshift(text);
  state.log.length = Math.min(state.log.length, 12);
}

const redraw = everyFrame(draw);

connect({
  hello(data) {
    state.config = data;
    toLocal(data.t);
    for (const key of ["max_batch", "min_batch", "window_ms"]) show(`cfg-${key}`, data[key]);
    counters(data);
    redraw();
  },
  queue(data) {
    state.queued = data.queued;
    state.windowMs = data.window_ms;
    state.oldestAt = data.queued ? toLocal(data.t) - data.oldest_waited_ms / 1e3 : null;
    show("stat-queued", data.queued);
    redraw();
  },
  batch(data) {
    state.batch = data;
    state.queued = data.queued;
    state.oldestAt = data.queued ? toLocal(data.t) - data.oldest_waited_ms / 1e3 : null;  // the new head's window
    const why = data.full ? "full" : data.why;
    state.history.push({ size: data.size, max: data.max_batch, why });
    state.history = state.history.slice(-120);
    const longest = Math.max(...data.rows.map(([p, n]) => p + n));
    show("batch-why", `#${data.batch}: ${plural(data.size, "row")}, longest ${longest} tokens, left because ${describeWhy(why, data)}`);
    say(`batch ${data.batch}: ${plural(data.size, "request")} (${why}) after ${data.waited_ms.toFixed(1)} ms`);
    show("stat-queued", data.queued);
    redraw();
  },
  done(data) {
    const t = toLocal(data.t);
    counters({ ...data, mean_batch: data.batches ? (data.requests / data.batches).toFixed(2) : 0 });
    lines.rps.add(t, answered.add(t, data.requests));
    for (const ms of data.latencies_ms) latency.add(t, ms);
    lines.latency.add(t, latency.at(t));
    const steps = state.batch && state.batch.batch === data.batch ? Math.max(...state.batch.rows.map(([, n]) => n)) : null;
    if (steps) lines.perToken.add(t, data.compute_ms / steps);
    if (data.failed) say(`batch ${data.batch} FAILED: its ${data.size} requests got 500`);
    redraw();
  },
});
wireBursts();
setInterval(redraw, 250);  // the timer and the lines move on even when nothing happens

function describeWhy(why, data) {
  return { full: `it reached max_batch (${data.max_batch})`, min_batch: "min_batch requests were waiting",
           window: `its window (${data.window_ms.toFixed(1)} ms) closed`,
           device_busy: "the device came free: it was ready while the batch ahead computed, and grew meanwhile",
           draining: "the server is draining" }[why];
}

function draw() {
  const now = nowS();
  const queue = document.getElementById("queue");
  if (queue.childElementCount !== state.queued) {
    queue.replaceChildren(...Array.from({ length: Math.min(state.queued, 200) }, () => {
      const chip = document.createElement("div"); chip.className = "chip"; chip.style.background = "#6b8fe0"; return chip;
    }));
  }
  const elapsedMs = state.oldestAt === null ? 0 : (now - state.oldestAt) * 1e3;
  document.getElementById("timer").style.width = `${Math.min(100, (100 * elapsedMs) / Math.max(state.windowMs, 1e-3))}%`;
  show("timer-text", state.oldestAt === null ? "the window opens at the next arrival"
    : elapsedMs <= state.windowMs ? `the oldest request has waited ${elapsedMs.toFixed(1)} of ${state.windowMs.toFixed(1)} ms`
    : `the window closed ${(elapsedMs - state.windowMs).toFixed(0)} ms ago: the batch waits for the device to finish the one ahead`);
  drawBatch();
  drawHistory();
  for (const line of Object.values(lines)) line.draw(now);
  document.getElementById("log").textContent = state.log.join("\n");
}

function drawBatch() {
  const rows = document.getElementById("batch-rows");
  if (!state.batch || rows.dataset.batch === String(state.batch.batch)) return;
  rows.dataset.batch = state.batch.batch;
  const longestNew = Math.max(...state.batch.rows.map(([, n]) => n));
  const longestPrompt = Math.max(...state.batch.rows.map(([p]) => p));
  const scale = 100 / (longestPrompt + longestNew);
  rows.replaceChildren(...state.batch.rows.map(([prompt, asked], i) => {
    const row = document.createElement("div"); row.className = "row";
    const label = document.createElement("span"); label.className = "label"; label.textContent = `${prompt}+${asked}`;
    const bar = document.createElement("div"); bar.className = "bar";
    const parts = [["prompt", 0, prompt], [null, prompt, asked], ["padding", prompt + asked, longestPrompt + longestNew - prompt - asked]];
    for (const [cls, start, length] of parts) {
      const part = document.createElement("div");
      if (cls) part.className = cls; else part.style.background = colourOf(state.batch.batch * 64 + i);
      part.style.left = `${start * scale}%`; part.style.width = `${length * scale}%`;
      bar.append(part);
    }
    row.append(label, bar);
    return row;
  }));
}

function drawHistory() {
  const c = document.getElementById("history"), g = c.getContext("2d");
  g.clearRect(0, 0, c.width, c.height);
  const width = c.width / 120;
  state.history.forEach((b, i) => {
    const h = (b.size / b.max) * (c.height - 4);
    g.fillStyle = WHY_COLOURS[b.why] || "#999";
    g.fillRect(c.width - (state.history.length - i) * width, c.height - h, width - 1, h);
  });
}

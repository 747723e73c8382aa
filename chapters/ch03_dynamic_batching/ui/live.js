// What every live page shares: the event stream, the counters, the burst buttons and the lines.
// No framework and no build step: the server serves these files as they are.

/** Subscribe to /ui/events; `handlers[kind](data)` runs for each event. The browser reconnects by itself. */
export function connect(handlers) {
  const status = document.getElementById("status");
  const dropped = document.getElementById("dropped");
  const source = new EventSource("events");
  source.onopen = () => { status.textContent = "live"; status.className = "ok"; };
  source.onerror = () => { status.textContent = "reconnecting…"; status.className = "bad"; };
  source.addEventListener("dropped", (e) => {
    const data = JSON.parse(e.data);
    // The server keeps a short queue per page; a page that falls behind loses its oldest events.
    dropped.textContent = `this page fell behind and missed ${data.dropped_total} events (the counters stay right: every event carries them)`;
    dropped.hidden = false;
  });
  for (const [kind, handle] of Object.entries(handlers)) {
    source.addEventListener(kind, (e) => handle(JSON.parse(e.data)));
  }
  return source;
}

/** Write `value` into the element with id `id` (the browser test reads these). */
export function show(id, value) {
  const element = document.getElementById(id);
  if (element && element.textContent !== String(value)) element.textContent = String(value);
}

/** Redraw at most once per frame, however many events arrive. */
export function everyFrame(draw) {
  let pending = false;
  return () => {
    if (pending) return;
    pending = true;
    requestAnimationFrame(() => { pending = false; draw(); });
  };
}

/** A stable colour per sequence or request id. */
export function colourOf(id) {
  return `hsl(${(Number(id) * 137.508) % 360}, 65%, 52%)`;
}

/** A rolling line of the last `spanS` seconds, drawn in a canvas. */
export class Line {
  constructor(canvasId, label, unit, spanS = 30) {
    this.canvas = document.getElementById(canvasId);
    this.label = label; this.unit = unit; this.spanS = spanS;
    this.points = [];
  }
  add(t, value) {
    if (value === null || value === undefined || Number.isNaN(value)) return;
    this.points.push([t, value]);
    while (this.points.length && this.points[0][0] < t - this.spanS) this.points.shift();
  }
  draw(now) {
    const c = this.canvas;
    if (c.clientWidth && c.width !== c.clientWidth) c.width = c.clientWidth;  // one canvas pixel per screen pixel: sharp text
    const g = c.getContext("2d"), w = c.width, h = c.height;
    g.clearRect(0, 0, w, h);
    const visible = this.points.filter(([t]) => t >= now - this.spanS);
    const top = Math.max(1e-9, ...visible.map(([, v]) => v)) * 1.15;
    g.strokeStyle = "#3b6fd4"; g.lineWidth = 1.5; g.beginPath();
    visible.forEach(([t, v], i) => {
      const x = w - ((now - t) / this.spanS) * w, y = h - 14 - (v / top) * (h - 28);
      if (i) g.lineTo(x, y); else g.moveTo(x, y);
    });
    g.stroke();
    const last = visible.length ? visible[visible.length - 1][1] : null;
    g.fillStyle = "#222"; g.font = "12px sans-serif";
    g.fillText(`${this.label}: ${last === null ? "–" : formatNumber(last)} ${this.unit}`, 4, 12);
    g.fillStyle = "#888"; g.fillText(`last ${this.spanS} s · top ${formatNumber(top / 1.15)}`, 4, h - 2);
  }
}

/** Requests or tokens per second from a running counter, over the last few seconds. */
export class Rate {
  constructor(windowS = 3) { this.windowS = windowS; this.samples = []; }
  add(t, count) {
    this.samples.push([t, count]);
    while (this.samples.length > 2 && this.samples[0][0] < t - this.windowS) this.samples.shift();
    const [t0, c0] = this.samples[0];
    return t > t0 ? (count - c0) / (t - t0) : null;
  }
}

/** The median of the values added in the last `windowS` seconds. */
export class RecentMedian {
  constructor(windowS = 5) { this.windowS = windowS; this.samples = []; }
  add(t, value) { this.samples.push([t, value]); }
  at(t) {
    while (this.samples.length && this.samples[0][0] < t - this.windowS) this.samples.shift();
    if (!this.samples.length) return null;
    const sorted = this.samples.map(([, v]) => v).sort((a, b) => a - b);
    return sorted[Math.floor(sorted.length / 2)];
  }
}

export function formatNumber(v) {
  return Math.abs(v) >= 100 ? v.toFixed(0) : Math.abs(v) >= 10 ? v.toFixed(1) : v.toFixed(2);
}

// The burst buttons: a few requests through the public API, exactly as any client sends them.
const STORY = "Once upon a time, in a small town by the sea, there lived an old clockmaker who ";
const SHARED = "You are a patient teacher. Answer in one short paragraph, plainly, without lists. " +
  "The reader is new to the subject and reads slowly. Keep every sentence short and concrete. Question: ";
const BURSTS = {
  short: ["16 short", () => Array.from({ length: 16 }, (_, i) => ({ prompt: `${i}: ${STORY.slice(0, 24)}`, max_new_tokens: 16 }))],
  long: ["8 long", () => Array.from({ length: 8 }, (_, i) => ({ prompt: `${i}: ${STORY}`, max_new_tokens: 240 }))],
  shared: ["12 with one shared prefix",
           () => Array.from({ length: 12 }, (_, i) => ({ prompt: `${SHARED}what is thing number ${i}?`, max_new_tokens: 32 }))],
  mixed: ["24 of mixed lengths",
          () => Array.from({ length: 24 }, (_, i) => ({ prompt: `${i} ${STORY.slice(0, 10 + (i * 7) % 60)}`, max_new_tokens: 8 + (i * 53) % 249 }))],
};

/** One button per burst, before `#burst-result`, which then says how the last burst went. */
export function wireBursts() {
  const said = document.getElementById("burst-result");
  for (const [name, [label, bodiesOf]] of Object.entries(BURSTS)) {
    const button = Object.assign(document.createElement("button"), { textContent: label });
    button.dataset.burst = name;
    said.before(button);
    button.addEventListener("click", async () => {
      const bodies = bodiesOf();
      said.textContent = `sent ${bodies.length} ${name} requests…`;
      const answers = await Promise.all(bodies.map((body) =>
        fetch("/v1/inference", { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) })
          .then((r) => r.status).catch(() => "network error")));
      const counts = {};
      for (const status of answers) counts[status] = (counts[status] || 0) + 1;
      said.textContent = `${name}: ` + Object.entries(counts).map(([s, n]) => `${n} × ${s}`).join(", ");
    });
  }
}

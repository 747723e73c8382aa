// The chat box: the conversation goes to /v1/chat/completions, the answer streams in, and the step view
// outlines the turn's sequence (the X-Sequence-Id header names it) from the step it joins to the step it leaves.
const MAX_TOKENS = 200;
export const turns = { sequences: new Set() };  // the ids of this page's turns, as strings (rows' data-seq)
const history = [];

function say(who, text) {
  const line = Object.assign(document.createElement("div"), { className: who, textContent: text });
  document.getElementById("chat-log").append(line);
  return line;
}

/** Parse a server-sent-events stream into the JSON of each `data:` line, until `[DONE]`. */
async function* events(response) {
  const reader = response.body.getReader(), decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const data = buffer.slice(0, end).split("\n").find((l) => l.startsWith("data: "));
      buffer = buffer.slice(end + 2);
      if (!data) continue;
      if (data === "data: [DONE]") return;
      yield JSON.parse(data.slice(6));
    }
  }
}

async function send(content) {
  const status = document.getElementById("chat-status"), chat = document.getElementById("chat");
  history.push({ role: "user", content });
  say("you", `you: ${content}`);
  const answer = say("model", "model: ");
  const model = (await (await fetch("/v1/models")).json()).data[0].id;
  const response = await fetch("/v1/chat/completions", {
    method: "POST", headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ model, messages: history, stream: true, max_tokens: MAX_TOKENS }),
  });
  if (!response.ok) {
    history.pop();
    answer.textContent = `(${response.status}) ${(await response.json()).error.message}`;
    status.textContent = "refused";
    return;
  }
  const seq = response.headers.get("X-Sequence-Id");
  if (seq) { turns.sequences.add(seq); chat.dataset.sequence = seq; }
  status.textContent = `sequence #${seq}: answering…`;
  let text = "";
  for await (const chunk of events(response)) {
    if (chunk.error) { status.textContent = chunk.error.message; break; }
    const choice = chunk.choices[0];
    text += choice.delta.content || "";
    answer.textContent = `model: ${text}`;
    if (choice.finish_reason) { status.textContent = `sequence #${seq}: ended (${choice.finish_reason})`; chat.dataset.finish = choice.finish_reason; }
  }
  history.push({ role: "assistant", content: text });
}

export function wireChat() {
  const form = document.getElementById("chat-form"), input = document.getElementById("chat-input");
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    const content = input.value.trim();
    if (!content) return;
    input.value = "";
    send(content).catch((error) => { document.getElementById("chat-status").textContent = String(error); });
  });
}

/** Called with every step: records on #chat what the step view showed of this page's turns (the browser test reads it). */
export function noticeStep(step) {
  const chat = document.getElementById("chat"), ours = (id) => turns.sequences.has(String(id));
  if (step.running.some(([id]) => ours(id))) chat.dataset.joined = "yes";
  if (step.running.some(([id, , generated]) => ours(id) && generated > 1)) chat.dataset.decoded = "yes";
  for (const [id, why] of step.left) if (ours(id)) chat.dataset.left = why;
}

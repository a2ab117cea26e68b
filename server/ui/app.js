// kvserve's built-in page: a streaming chat and a live view of the KV cache.
// Model output is only ever inserted as text (textContent), never as HTML.
"use strict";

const $ = (id) => document.getElementById(id);
const history = [];  // {role, content}
const pasted = [];  // images pasted for the next message, as data: URLs
let controller = null;

function apiKey() { return sessionStorage.getItem("kvserve-key") || ""; }

function headers() {
  const h = { "Content-Type": "application/json" };
  if (apiKey()) h["Authorization"] = "Bearer " + apiKey();
  return h;
}

function askKey() {
  const key = window.prompt("This server needs an API key:", apiKey());
  if (key !== null) sessionStorage.setItem("kvserve-key", key.trim());
}

function addMessage(role, text) {
  const el = document.createElement("div");
  el.className = "msg " + role;
  const body = document.createElement("span");
  body.className = "body";
  body.textContent = text;
  el.appendChild(body);
  $("messages").appendChild(el);
  $("messages").scrollTop = $("messages").scrollHeight;
  return el;
}

function appendText(el, text) {
  el.querySelector(".body").textContent += text;
  $("messages").scrollTop = $("messages").scrollHeight;
}

function setMeta(el, text) {
  let meta = el.querySelector(".meta");
  if (!meta) { meta = document.createElement("span"); meta.className = "meta"; el.appendChild(meta); }
  meta.textContent = text;
}

function showPasted() {
  $("attached").textContent = pasted.length ? `${pasted.length} image(s) attached` : "";
}

async function send(text) {
  const images = pasted.splice(0);
  showPasted();
  // with images, OpenAI's content parts: the pictures, then the text
  const asked = images.length
    ? [...images.map((url) => ({ type: "image_url", image_url: { url } })), { type: "text", text }]
    : text;
  const system = $("system").value.trim() ? [{ role: "system", content: $("system").value }] : [];
  const messages = [...system, ...history, { role: "user", content: asked }];
  history.push({ role: "user", content: asked });
  addMessage("user", images.length ? `[${images.length} image(s)] ${text}` : text);
  const reply = addMessage("assistant", "");
  controller = new AbortController();
  $("send").disabled = true; $("stop").disabled = false;
  const started = performance.now();
  let firstToken = null, tokens = 0, usage = null, content = "";
  try {
    const res = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), signal: controller.signal,
      body: JSON.stringify({
        messages, stream: true, stream_options: { include_usage: true },
        temperature: Number($("temperature").value), max_tokens: Number($("max-tokens").value),
      }),
    });
    if (res.status === 401) { askKey(); throw new Error("unauthorized: set the API key and retry"); }
    if (!res.ok) { const err = await res.json(); throw new Error(err.error ? err.error.message : res.statusText); }
    const reader = res.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      const events = buffer.split("\n\n");
      buffer = events.pop();
      for (const event of events) {
        if (!event.startsWith("data: ")) continue;
        const data = event.slice(6);
        if (data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        if (chunk.usage) usage = chunk.usage;
        const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta.content;
        if (delta) {
          if (firstToken === null) firstToken = performance.now();
          tokens += 1; content += delta;
          appendText(reply, delta);
        }
      }
    }
  } catch (e) {
    if (e.name === "AbortError") setMeta(reply, "stopped");
    else { reply.classList.add("error"); setMeta(reply, String(e.message || e)); }
  } finally {
    controller = null;
    $("send").disabled = false; $("stop").disabled = true;
  }
  history.push({ role: "assistant", content });
  if (firstToken !== null) {
    const ttft = (firstToken - started) / 1000;
    const elapsed = (performance.now() - firstToken) / 1000;
    const n = usage ? usage.completion_tokens : tokens;
    const tps = elapsed > 0 && n > 1 ? ((n - 1) / elapsed).toFixed(1) : "-";
    const cached = usage ? usage.prompt_tokens_details.cached_tokens : "?";
    const stats = `TTFT ${ttft.toFixed(2)} s · ${tps} tok/s · ${n} tokens · cached ${cached}`;
    if (!reply.querySelector(".meta")) setMeta(reply, stats);
    $("reply-stats").textContent = stats;
  }
}

$("composer").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = $("input").value.trim();
  if ((!text && !pasted.length) || controller) return;
  $("input").value = "";
  send(text);
});
$("input").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("composer").requestSubmit(); }
});
$("input").addEventListener("paste", (e) => {
  const files = [...(e.clipboardData ? e.clipboardData.files : [])]
    .filter((f) => f.type.startsWith("image/"));
  if (!files.length) return;  // text pastes as usual
  e.preventDefault();
  for (const file of files) {
    const reader = new FileReader();
    reader.onload = () => { pasted.push(reader.result); showPasted(); };
    reader.readAsDataURL(file);
  }
});
$("stop").addEventListener("click", () => { if (controller) controller.abort(); });
$("clear").addEventListener("click", () => {
  history.length = 0; pasted.length = 0; showPasted(); $("messages").textContent = "";
});
$("key-button").addEventListener("click", askKey);

// ---- live engine panel --------------------------------------------------------------------
let last = null;
const CLASSES = { "0": "free", "1": "cached", "2": "used" };

function renderBlocks(map) {
  const grid = $("blocks");
  if (grid.childElementCount !== map.length) {
    grid.textContent = "";
    for (let i = 0; i < map.length; i++) {
      const c = document.createElement("span");
      grid.appendChild(c);
    }
  }
  for (let i = 0; i < map.length; i++) grid.children[i].className = "cell " + CLASSES[map[i]];
}

function sparkline(values) {
  const w = 60, h = 14, n = Math.max(values.length - 1, 1);
  const pts = values.map((v, i) => `${(i * w / n).toFixed(1)},${(h - v * h).toFixed(1)}`).join(" ");
  return `<svg width="${w}" height="${h}" aria-hidden="true"><polyline fill="none" stroke="#2563eb" points="${pts}"/></svg>`;
}

function esc(text) {
  const d = document.createElement("span");
  d.textContent = text;
  return d.innerHTML;
}

function renderApps(apps) {
  const rows = Object.entries(apps || {}).map(([name, a]) =>
    `<tr><td>${esc(name)}</td><td>${(100 * a.hit_rate).toFixed(1)}%</td>` +
    `<td>${sparkline(a.recent_hit_rates)}</td>` +
    `<td>${a.missed_tokens.eviction} / ${a.missed_tokens.divergence}</td></tr>`);
  $("apps").tBodies[0].innerHTML = rows.join("");
  const breakers = Object.entries(apps || {}).flatMap(([name, a]) => a.breakers.map(b =>
    `<li>${esc(name)}: token ${b.position}: ${esc(b.new)} vs ${esc(b.previous)}, ` +
    `${b.lost_prefill_tokens} tokens of prefill lost (${b.count}x)</li>`));
  $("breakers").innerHTML = breakers.join("");
}

async function refresh() {
  try {
    const res = await fetch("/v1/stats", { headers: headers() });
    if (res.status === 401) { $("panel-error").textContent = "API key needed for stats"; return; }
    const s = await res.json();
    $("model").textContent = s.model;
    $("s-running").textContent = s.running;
    $("s-waiting").textContent = s.waiting;
    if (last) {
      const dt = (s.time - last.time);
      $("s-tps").textContent = dt > 0 ? ((s.generation_tokens - last.generation_tokens) / dt).toFixed(1) : "-";
    }
    $("s-hit").textContent = s.prefix_cache_queries ? (100 * s.prefix_cache_hits / s.prefix_cache_queries).toFixed(1) + "%" : "-";
    $("s-usage").textContent = `${s.blocks_in_use} / ${s.num_blocks} (${s.block_size} tok)`;
    $("s-host").textContent = s.host ? `${(s.host.used_bytes / 2 ** 20).toFixed(0)} / ${(s.host.capacity_bytes / 2 ** 20).toFixed(0)} MiB` : "off";
    renderBlocks(s.block_map);
    renderApps(s.apps);
    $("panel-error").textContent = "";
    last = s;
  } catch (e) {
    $("panel-error").textContent = "stats unavailable: " + (e.message || e);
  }
}
refresh();
setInterval(refresh, 1000);

// omnistage playground: a chat over the server's OpenAI-compatible streaming API
// (POST /v1/chat/completions, SSE). Text deltas are shown as they arrive; base64 pcm16 audio deltas are
// played while the answer streams, scheduled back to back with the Web Audio API.
// State is exposed as window.omnistagePlayground (the browser tests read it).
"use strict";

const $ = (id) => document.getElementById(id);

const state = {
  info: null,
  history: [],   // [{role, content}] sent with every request
  answers: [],   // one record per assistant answer (see newAnswer)
  current: null, // the answer streaming now
  player: null,
};
window.omnistagePlayground = state;

// ---- audio ---------------------------------------------------------------------------------------
function base64ToInt16(b64) {
  const bin = atob(b64);
  const out = new Int16Array(bin.length >> 1);
  for (let i = 0; i < out.length; i++) {
    const v = bin.charCodeAt(2 * i) | (bin.charCodeAt(2 * i + 1) << 8); // little-endian
    out[i] = v > 0x7fff ? v - 0x10000 : v;
  }
  return out;
}

function int16ToBase64(pcm) {
  const bytes = new Uint8Array(pcm.buffer, pcm.byteOffset, pcm.byteLength);
  let bin = "";
  for (let i = 0; i < bytes.length; i += 0x8000) {
    bin += String.fromCharCode.apply(null, bytes.subarray(i, i + 0x8000));
  }
  return btoa(bin);
}

function concatInt16(chunks) {
  const n = chunks.reduce((s, c) => s + c.length, 0);
  const out = new Int16Array(n);
  let at = 0;
  for (const c of chunks) { out.set(c, at); at += c.length; }
  return out;
}

function wavBlob(pcm, rate) {
  const header = new DataView(new ArrayBuffer(44));
  const text = (at, s) => { for (let i = 0; i < s.length; i++) header.setUint8(at + i, s.charCodeAt(i)); };
  text(0, "RIFF"); header.setUint32(4, 36 + pcm.byteLength, true); text(8, "WAVE");
  text(12, "fmt "); header.setUint32(16, 16, true); header.setUint16(20, 1, true); header.setUint16(22, 1, true);
  header.setUint32(24, rate, true); header.setUint32(28, rate * 2, true); header.setUint16(32, 2, true);
  header.setUint16(34, 16, true); text(36, "data"); header.setUint32(40, pcm.byteLength, true);
  return new Blob([header.buffer, pcm], { type: "audio/wav" });
}

// Plays pcm16 chunks back to back: each chunk starts exactly where the previous one ends, unless it
// arrived after that moment (an underrun; it then starts at once).
class Player {
  constructor(rate) {
    this.rate = rate;
    this.ctx = null;
    this.sources = new Set();
    this.nextStart = 0;
    this.chunks = 0;
    this.underruns = 0;
    try {
      this.ctx = new AudioContext();
    } catch (err) {
      this.error = String(err); // no audio device: answers are still kept for download
    }
  }

  resume() { if (this.ctx && this.ctx.state === "suspended") this.ctx.resume(); }

  play(pcm) {
    this.chunks += 1;
    if (!this.ctx || pcm.length === 0) return;
    const buf = this.ctx.createBuffer(1, pcm.length, this.rate);
    const ch = buf.getChannelData(0);
    for (let i = 0; i < pcm.length; i++) ch[i] = pcm[i] / 32768;
    const src = this.ctx.createBufferSource();
    src.buffer = buf;
    src.connect(this.ctx.destination);
    const now = this.ctx.currentTime;
    if (this.nextStart < now + 0.02) {
      if (this.nextStart > 0) this.underruns += 1;
      this.nextStart = now + 0.05;
    }
    src.start(this.nextStart);
    this.nextStart += buf.duration;
    this.sources.add(src);
    src.onended = () => this.sources.delete(src);
  }

  // A new answer (or a replay) starts from silence.
  reset() {
    for (const s of this.sources) { try { s.stop(); } catch (_) { /* already ended */ } }
    this.sources.clear();
    this.nextStart = 0;
  }
}

// ---- page ----------------------------------------------------------------------------------------
function addMessage(role, text) {
  const li = document.createElement("li");
  li.className = `msg ${role}`;
  const who = document.createElement("p");
  who.className = "role";
  who.textContent = role === "user" ? "You" : "Assistant";
  const body = document.createElement("p");
  body.className = "text";
  body.textContent = text;
  li.append(who, body);
  $("log").append(li);
  li.scrollIntoView({ block: "end" });
  return li;
}

function newAnswer(body) {
  const el = $("answer-template").content.firstElementChild.cloneNode(true);
  $("log").append(el);
  const answer = {
    index: state.answers.length,
    request: body,
    el,
    text: "",
    textUpdates: [],     // [{t, length}]: when the shown text grew, and to what length
    audioChunks: [],     // [{t, samples}]
    pcmChunks: [],
    pcm: null,           // Int16Array once finished
    finishReason: null,
    finishedAt: null,
    usage: null,
    state: "streaming",  // streaming | done | stopped | error
    error: null,
    start: performance.now(),
    figures: {},
    pcmBase64() { return int16ToBase64(this.pcm || concatInt16(this.pcmChunks)); },
  };
  state.answers.push(answer);
  return answer;
}

function showError(answer, message) {
  answer.state = "error";
  answer.error = message;
  const p = answer.el.querySelector(".error");
  p.textContent = `Error: ${message}`;
  p.hidden = false;
}

function seconds(ms) { return `${(ms / 1000).toFixed(2)} s`; }

function finishFigures(answer) {
  const f = answer.figures;
  const rate = state.info.sample_rate || 24000;
  const samples = answer.pcm ? answer.pcm.length : 0;
  const parts = [];
  if (f.ttft != null) parts.push(`first token ${seconds(f.ttft)}`);
  if (f.ttfa != null) parts.push(`first audio ${seconds(f.ttfa)}`);
  if (samples) {
    f.audioSeconds = samples / rate;
    f.rtf = (f.lastAudio / 1000) / f.audioSeconds;
    parts.push(`audio ${f.audioSeconds.toFixed(2)} s`, `real-time factor ${f.rtf.toFixed(2)}`);
  }
  if (answer.usage) parts.push(`${answer.usage.completion_tokens} tokens`);
  parts.push(answer.state === "done" ? `finish: ${answer.finishReason}` : answer.state);
  answer.el.querySelector(".figures").textContent = parts.join(" · ");
}

function attachAudioTools(answer) {
  if (!answer.pcm || answer.pcm.length === 0) return;
  const rate = state.info.sample_rate;
  const tools = answer.el.querySelector(".audio-tools");
  const link = tools.querySelector(".download");
  link.href = URL.createObjectURL(wavBlob(answer.pcm, rate));
  link.download = `answer-${answer.index + 1}.wav`;
  tools.querySelector(".replay").addEventListener("click", () => {
    state.player.resume();
    state.player.reset();
    state.player.play(answer.pcm);
  });
  tools.hidden = false;
}

function onDelta(answer, obj) {
  if (obj.error) { showError(answer, obj.error.message || JSON.stringify(obj.error)); return; }
  if (obj.usage) answer.usage = obj.usage;
  const choice = (obj.choices || [])[0];
  if (!choice) return;
  const now = performance.now() - answer.start;
  const delta = choice.delta || {};
  if (delta.content) {
    if (answer.figures.ttft == null) answer.figures.ttft = now;
    answer.text += delta.content;
    answer.el.querySelector(".text").textContent = answer.text;
    answer.textUpdates.push({ t: now, length: answer.text.length });
  }
  if (delta.audio && delta.audio.data) {
    const pcm = base64ToInt16(delta.audio.data);
    if (answer.figures.ttfa == null) answer.figures.ttfa = now;
    answer.figures.lastAudio = now;
    answer.pcmChunks.push(pcm);
    answer.audioChunks.push({ t: now, samples: pcm.length });
    state.player.play(pcm);
  }
  if (choice.finish_reason) {
    answer.finishReason = choice.finish_reason;
    answer.finishedAt = now;
  }
}

async function readStream(answer, resp) {
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const event = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
      if (!data || data === "[DONE]") continue;
      onDelta(answer, JSON.parse(data));
    }
  }
}

async function errorMessage(resp) {
  const text = await resp.text();
  try {
    const body = JSON.parse(text);
    if (body.error && body.error.message) return `${body.error.message} (HTTP ${resp.status})`;
  } catch (_) { /* not JSON */ }
  return `HTTP ${resp.status}: ${text.slice(0, 500)}`;
}

function requestBody() {
  const info = state.info;
  const body = {
    model: info.model,
    messages: state.history.slice(),
    stream: true,
    stream_options: { include_usage: true },
  };
  const t = parseFloat($("temperature").value);
  if (!Number.isNaN(t)) body.temperature = t;
  const n = parseInt($("max-tokens").value, 10);
  if (!Number.isNaN(n)) body.max_tokens = n;
  if ($("speech").checked && !$("speech").disabled) {
    body.modalities = ["text", "audio"];
    body.audio = { voice: $("voice").value, format: "pcm16" };
  } else {
    body.modalities = ["text"];
  }
  return body;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  $("new-chat").disabled = busy;
}

async function send() {
  const prompt = $("prompt").value;
  if (!prompt.trim() || state.current || !state.info) return;
  if (!state.player) state.player = new Player(state.info.sample_rate || 24000);
  state.player.resume(); // inside the click / key press: allowed to start audio
  state.player.reset();
  $("prompt").value = "";
  addMessage("user", prompt);
  state.history.push({ role: "user", content: prompt });
  const body = requestBody();
  const answer = newAnswer(body);
  const controller = new AbortController();
  state.current = { answer, controller };
  setBusy(true);
  try {
    const resp = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
      signal: controller.signal,
    });
    if (!resp.ok) {
      showError(answer, await errorMessage(resp));
    } else {
      await readStream(answer, resp);
      if (answer.state === "streaming") {
        answer.state = answer.finishReason ? "done" : "error";
        if (!answer.finishReason) showError(answer, "the stream ended without a finish reason");
      }
    }
  } catch (err) {
    if (err.name === "AbortError") answer.state = "stopped";
    else showError(answer, String(err));
  } finally {
    if (answer.state === "stopped") state.player.reset();
    answer.pcm = concatInt16(answer.pcmChunks);
    if (answer.state === "error") {
      state.history.pop(); // the failed turn is not part of the conversation
    } else {
      state.history.push({ role: "assistant", content: answer.text });
    }
    finishFigures(answer);
    attachAudioTools(answer);
    state.current = null;
    setBusy(false);
    $("prompt").focus();
  }
}

function stop() {
  if (state.current) state.current.controller.abort();
}

function newChat() {
  if (state.current) return;
  state.history = [];
  $("log").replaceChildren();
  $("prompt").focus();
}

function showMediaControls(inputs) {
  const audio = inputs.includes("audio");
  const image = inputs.includes("image");
  $("record").hidden = !audio;
  $("audio-file-label").hidden = !audio;
  $("image-file-label").hidden = !image;
  $("media-controls").hidden = !(audio || image);
}

async function init() {
  const resp = await fetch("/playground/info");
  if (!resp.ok) {
    const li = addMessage("assistant", "");
    li.querySelector(".text").textContent = `Could not load the model description: ${await errorMessage(resp)}`;
    return;
  }
  const info = await resp.json();
  state.info = info;
  $("model-name").textContent = info.model;
  if (info.built_in) {
    const notice = $("notice");
    const flag = document.createElement("code");
    flag.textContent = "--model";
    notice.append("This is the built-in test model: its weights are random, so its words and sounds mean "
      + "nothing. It exists to exercise the engine; serve a real checkpoint with ", flag, ".");
    notice.hidden = false;
  }
  const voice = $("voice");
  for (const v of info.voices) {
    const opt = document.createElement("option");
    opt.value = v;
    opt.textContent = v;
    opt.selected = v === info.default_voice;
    voice.append(opt);
  }
  const speaks = info.output_modalities.includes("audio") && info.voices.length > 0;
  $("speech").checked = speaks;
  $("speech").disabled = !speaks;
  voice.disabled = !speaks;
  $("temperature").value = info.sampling.temperature;
  $("max-tokens").value = info.sampling.max_tokens;
  $("max-tokens").max = info.max_model_len - 1;
  showMediaControls(info.input_modalities);
  document.body.dataset.ready = "true";
}

document.addEventListener("DOMContentLoaded", () => {
  $("composer").addEventListener("submit", (e) => { e.preventDefault(); send(); });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); send(); }
  });
  $("stop").addEventListener("click", stop);
  document.addEventListener("keydown", (e) => { if (e.key === "Escape") stop(); });
  $("new-chat").addEventListener("click", newChat);
  $("speech").addEventListener("change", () => { $("voice").disabled = !$("speech").checked; });
  init();
  $("prompt").focus();
});

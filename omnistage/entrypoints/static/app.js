// omnistage playground: a chat over the server's OpenAI-compatible streaming API
// (POST /v1/chat/completions, SSE). Text deltas are shown as they arrive; base64 pcm16 audio deltas are
// played while the answer streams, scheduled back to back with the Web Audio API.
// State is exposed as window.omnistagePlayground (the browser tests read it).
"use strict";

const $ = (id) => document.getElementById(id);

const state = {
  info: null,
  history: [],   // [{role, content}] sent with every request (content: a string, or parts with media)
  attachments: [], // [{kind, name, part}]: media going with the next message
  recorder: null,  // the MediaRecorder while recording
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

// ---- media input ---------------------------------------------------------------------------------
// Container formats the server's input_audio takes (it decodes by content; the name must be one of these).
const AUDIO_FORMATS = ["wav", "mp3", "flac", "ogg", "opus", "webm", "m4a", "aac", "mp4"];

function readBase64(blob) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result.slice(reader.result.indexOf(",") + 1));
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(blob);
  });
}

function audioFormat(name, type) {
  const ext = (name.includes(".") ? name.split(".").pop() : "").toLowerCase();
  if (AUDIO_FORMATS.includes(ext)) return ext;
  const sub = (type.split("/")[1] || "").split(";")[0].replace(/^x-/, "").replace(/^mpeg$/, "mp3");
  return AUDIO_FORMATS.includes(sub) ? sub : "wav";
}

function mediaStatus(text) {
  $("media-status").textContent = text;
  $("media-status").hidden = !text;
}

async function attach(kind, blob, name) {
  const data = await readBase64(blob);
  const part = kind === "image"
    ? { type: "image_url",
        image_url: { url: `data:${blob.type.startsWith("image/") ? blob.type : "image/png"};base64,${data}` } }
    : { type: "input_audio", input_audio: { data, format: audioFormat(name, blob.type) } };
  state.attachments.push({ kind, name, part });
  showAttachments();
}

function showAttachments() {
  const list = $("attachments");
  list.replaceChildren();
  state.attachments.forEach((a, i) => {
    const li = document.createElement("li");
    const remove = document.createElement("button");
    remove.type = "button";
    remove.textContent = "×";
    remove.setAttribute("aria-label", `Remove ${a.name}`);
    remove.addEventListener("click", () => { state.attachments.splice(i, 1); showAttachments(); });
    li.append(`${a.kind}: ${a.name}`, remove);
    list.append(li);
  });
  list.hidden = state.attachments.length === 0;
}

async function onFile(kind, input) {
  for (const file of input.files) await attach(kind, file, file.name);
  input.value = ""; // the same file can be chosen again
}

async function toggleRecording() {
  const button = $("record");
  if (state.recorder) { state.recorder.stop(); return; }
  let stream;
  try {
    stream = await navigator.mediaDevices.getUserMedia({ audio: true });
  } catch (err) {
    mediaStatus(`Cannot record: ${err.message || err}`);
    return;
  }
  const chunks = [];
  const recorder = new MediaRecorder(stream);
  recorder.ondataavailable = (e) => { if (e.data.size) chunks.push(e.data); };
  recorder.onstop = async () => {
    stream.getTracks().forEach((t) => t.stop());
    const type = recorder.mimeType || "audio/webm";
    const ext = type.includes("ogg") ? "ogg" : type.includes("mp4") ? "mp4" : "webm";
    try { // sending waits until the recording is attached
      await attach("audio", new Blob(chunks, { type }), `recording-${state.attachments.length + 1}.${ext}`);
      mediaStatus("");
    } catch (err) {
      mediaStatus(`Cannot read the recording: ${err.message || err}`);
    } finally {
      state.recorder = null;
      button.textContent = "Record";
      button.setAttribute("aria-pressed", "false");
    }
  };
  state.recorder = recorder;
  recorder.start();
  button.textContent = "Stop recording";
  button.setAttribute("aria-pressed", "true");
  mediaStatus("Recording…");
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
  if ((!prompt.trim() && !state.attachments.length) || state.current || !state.info || state.recorder) return;
  if (!state.player) state.player = new Player(state.info.sample_rate || 24000);
  state.player.resume(); // inside the click / key press: allowed to start audio
  state.player.reset();
  $("prompt").value = "";
  const media = state.attachments.splice(0);
  showAttachments();
  const shown = media.map((a) => `[${a.kind}: ${a.name}]`).join(" ");
  addMessage("user", shown ? `${shown}${prompt ? "\n" + prompt : ""}` : prompt);
  const content = media.length ? [...media.map((a) => a.part), { type: "text", text: prompt }] : prompt;
  state.history.push({ role: "user", content });
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
  state.attachments = [];
  showAttachments();
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
  $("audio-file").addEventListener("change", (e) => onFile("audio", e.target));
  $("image-file").addEventListener("change", (e) => onFile("image", e.target));
  $("record").addEventListener("click", toggleRecording);
  init();
  $("prompt").focus();
});

"""The browser playground in a real headless Chromium (Debian's chromium + chromium-driver, via selenium)
against a real ``omnistage serve`` subprocess on the built-in model.

A screenshot of the page after a spoken answer is written to ``test-artifacts/`` (gitignored).
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from omnistage.checkpoints.default_model import DEFAULT_PRESET, DEFAULT_SEED, builder_fingerprint

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
INSTALL_HINT = ("needs Chromium and its driver: apt-get install -y chromium chromium-driver (Debian), "
                "pip install selenium (in the test extras)")
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
MODEL = "omnistage-tiny"
MAX_INT16_DIFF = 2
# Greedy, this prompt runs to any token limit on the built-in model (checked against the API in the test).
ENDLESS_PROMPT = "What is the capital of France?"
ENDLESS_TOKENS = 400
# Requests whose id matches fail in Code2Wav (pipeline/faults.py), after their text has streamed; the Thinker
# takes each step of a "page-slow-*" request 50 ms longer, so the stop button is pressed mid-answer however
# fast the tiny model runs. The tests give one page request such an id, the others are untouched.
FAULTS = "code2wav:page-fault-*,thinker:page-slow-*:slow"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tiny_ckpt, tmp_path_factory):
    """``omnistage serve`` with no --model: the built-in model. Its cache is seeded with the session's tiny
    checkpoint, which is the built-in model byte for byte (tiny preset, seed 0), so nothing is rebuilt."""
    cache = tmp_path_factory.mktemp("browser-cache")
    shutil.copytree(tiny_ckpt, cache / f"{DEFAULT_PRESET}-seed{DEFAULT_SEED}-{builder_fingerprint()}")
    port = _free_port()
    env = {**os.environ, "OMNISTAGE_CACHE": str(cache), "OMP_NUM_THREADS": "1", "OMNISTAGE_FAULTS": FAULTS}
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen([sys.executable, "-m", "omnistage.entrypoints.cli", "serve", "--port", str(port)],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        if proc.poll() is not None:
            log.seek(0)
            pytest.fail(f"omnistage serve exited: {log.read().decode()[-3000:]}")
        try:
            return httpx.get(url + "/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    try:
        _wait(healthy, 120, 0.2, "omnistage serve to come up")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def _no_browser() -> None:
    # CI installs Chromium (.ci/run): there a missing browser is a failure, not a skip.
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI must run the browser tests: {INSTALL_HINT}")
    pytest.skip(INSTALL_HINT)


@pytest.fixture(scope="module")
def browser():
    if not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)):
        _no_browser()
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        _no_browser()
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    profile = tempfile.mkdtemp(prefix="omnistage-chromium-")
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--autoplay-policy=no-user-gesture-required", "--window-size=1200,900",
                 # The microphone: granted without asking, fed by Chromium's test signal.
                 "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
                 f"--user-data-dir={profile}"):
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def _wait(predicate, timeout=120.0, poll=0.05, what="condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(poll)


def _open(browser, url):
    browser.set_window_size(1200, 900)
    browser.get(url + "/")
    _wait(lambda: browser.execute_script("return document.body.dataset.ready === 'true'"), 30, what="page ready")


def _set(browser, element_id, value):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    box = browser.find_element(By.ID, element_id)
    box.send_keys(Keys.CONTROL, "a")
    box.send_keys(Keys.DELETE, str(value))


def _ask(browser, prompt):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    browser.find_element(By.ID, "prompt").send_keys(prompt, Keys.ENTER)


def _answer(browser, i=0):
    return browser.execute_script(
        """const a = window.omnistagePlayground.answers[arguments[0]];
        if (!a) return null;
        return {state: a.state, text: a.text, error: a.error, finishReason: a.finishReason, finishedAt: a.finishedAt,
                textUpdates: a.textUpdates, audioChunks: a.audioChunks, figures: a.figures, request: a.request,
                shown: a.el.querySelector('.text').textContent,
                errorShown: a.el.querySelector('.error').hidden ? null : a.el.querySelector('.error').textContent,
                figuresShown: a.el.querySelector('.figures').textContent};""", i)


def _request_id(browser, req_id):
    """The page's requests from now on carry this id (see FAULTS)."""
    browser.execute_script(
        """const fetch0 = window.fetch, id = arguments[0];
        window.fetch = (url, init) => fetch0(url, {...init, headers: {...init.headers, 'X-Request-Id': id}});""",
        req_id)


def _finished(browser, i=0, timeout=120.0):
    return _wait(lambda: (a := _answer(browser, i)) and a["state"] != "streaming" and a, timeout,
                 what="the answer to finish")


def test_info_describes_the_served_model(server):
    info = httpx.get(server + "/playground/info").json()
    assert info["model"] == MODEL and info["family"] == "qwen3_omni" and info["built_in"] is True
    assert info["output_modalities"] == ["text", "audio"]
    assert info["input_modalities"] == ["text", "audio", "image", "video"]  # the built-in model has towers
    assert info["voices"] == ["aiden", "chelsie", "ethan"] and info["default_voice"] == "ethan"
    assert info["sample_rate"] == 24000 and info["max_model_len"] == 4096
    assert info["sampling"] == {"temperature": 0.0, "top_p": 1.0, "max_tokens": 256}  # the packaged preset
    page = httpx.get(server + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    for name in re.findall(r'(?:src|href)="/playground/static/([^"]+)"', page.text):
        assert httpx.get(f"{server}/playground/static/{name}").status_code == 200, name
    missing = httpx.get(server + "/playground/static/secret.py")
    assert missing.status_code == 404 and "error" in missing.json()


def test_spoken_answer_streams_plays_and_equals_the_api(server, browser):
    _open(browser, server)
    assert browser.execute_script("return document.activeElement.id") == "prompt"  # type right away
    # Every control has a label (keyboard and screen-reader use); media input is shown (the model has towers).
    unlabeled = browser.execute_script(
        """return [...document.querySelectorAll('input, select, textarea')]
            .filter(e => e.labels.length === 0).map(e => e.id);""")
    assert unlabeled == []
    assert browser.execute_script("return document.getElementById('media-controls').offsetParent") is not None
    notice = browser.execute_script("return document.getElementById('notice').textContent")
    assert "random" in notice
    _set(browser, "temperature", 0)
    _set(browser, "max-tokens", 64)
    assert browser.execute_script("return document.getElementById('speech').checked")
    assert browser.execute_script("return document.getElementById('voice').value") == "ethan"
    _ask(browser, "Tell me about the sea.")
    a = _finished(browser)
    assert a["state"] == "done" and a["error"] is None, a
    assert a["finishReason"] in ("stop", "length")
    assert a["shown"] == a["text"] and a["text"].strip()

    # Streamed: the text grew in several steps and the player got several chunks, all before the end.
    updates, chunks = a["textUpdates"], a["audioChunks"]
    assert len(updates) >= 2 and all(u["t"] <= a["finishedAt"] for u in updates)
    assert [u["length"] for u in updates] == sorted({u["length"] for u in updates})
    assert len(chunks) >= 2 and all(c["t"] <= a["finishedAt"] for c in chunks)
    assert browser.execute_script("return window.omnistagePlayground.player.chunks") == len(chunks)
    assert browser.execute_script("return window.omnistagePlayground.player.error") is None
    assert "first token" in a["figuresShown"] and "real-time factor" in a["figuresShown"]
    assert a["figures"]["ttft"] <= a["figures"]["ttfa"] and a["figures"]["audioSeconds"] > 0

    # The audio the page assembled equals the API's answer to the same greedy request.
    page_pcm = np.frombuffer(base64.b64decode(browser.execute_script(
        "return window.omnistagePlayground.answers[0].pcmBase64()")), dtype="<i2")
    body = {**a["request"], "stream": False, "audio": {"voice": "ethan", "format": "pcm16"}}
    body.pop("stream_options")
    reply = httpx.post(server + "/v1/chat/completions", json=body, timeout=120).json()
    assert reply["choices"][0]["message"]["content"] == a["text"]
    api_pcm = np.frombuffer(base64.b64decode(reply["choices"][0]["message"]["audio"]["data"]), dtype="<i2")
    assert page_pcm.shape == api_pcm.shape and page_pcm.size == sum(c["samples"] for c in chunks)
    assert np.abs(page_pcm.astype(np.int32) - api_pcm.astype(np.int32)).max() <= MAX_INT16_DIFF

    # The download link is a WAV of exactly that audio.
    wav = base64.b64decode(browser.execute_async_script(
        """const done = arguments[arguments.length - 1];
        const link = document.querySelector('.msg.assistant .download');
        fetch(link.href).then(r => r.arrayBuffer()).then(b => {
            const bytes = new Uint8Array(b); let s = '';
            for (let i = 0; i < bytes.length; i++) s += String.fromCharCode(bytes[i]);
            done(btoa(s)); });"""))
    assert wav[:4] == b"RIFF" and wav[8:16] == b"WAVEfmt " and int.from_bytes(wav[24:28], "little") == 24000
    assert np.array_equal(np.frombuffer(wav[44:], dtype="<i2"), page_pcm)

    ARTIFACTS.mkdir(exist_ok=True)
    browser.save_screenshot(str(ARTIFACTS / "playground-answer.png"))
    browser.set_window_size(390, 844)  # a phone: one column, nothing wider than the screen
    assert browser.execute_script("return document.documentElement.scrollWidth <= window.innerWidth")
    browser.save_screenshot(str(ARTIFACTS / "playground-answer-narrow.png"))


def _metrics(server):
    return httpx.get(server + "/metrics").text


def _stage_gauges(text):
    names = ("omnistage_num_requests_running", "omnistage_num_requests_waiting", "omnistage_kv_cache_usage_ratio",
             "omnistage_request_records", "omnistage_bridge_entries", "omnistage_pending_payloads")
    out = {}
    for name in names:
        for stage, value in re.findall(rf'^{name}\{{stage="([^"]+)"\}} (\S+)$', text, re.M):
            out[(name, stage)] = float(value)
    out[("omnistage_requests_in_flight", "")] = float(re.search(r"^omnistage_requests_in_flight (\S+)$", text, re.M)[1])
    return out


def _aborts(text):
    m = re.search(r'^omnistage_requests_total\{finish_reason="abort"\} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def test_stop_mid_answer_frees_every_stage(server, browser):
    # Proof that the answer is long: greedy, the same prompt runs to the token limit.
    probe = {"model": MODEL, "messages": [{"role": "user", "content": ENDLESS_PROMPT}], "temperature": 0,
             "max_tokens": ENDLESS_TOKENS}
    reply = httpx.post(server + "/v1/chat/completions", json=probe, timeout=120).json()
    assert reply["choices"][0]["finish_reason"] == "length"
    aborts = _aborts(_metrics(server))

    _open(browser, server)
    _request_id(browser, "page-slow-1")  # 400 steps of at least 50 ms: the stop lands mid-answer
    _set(browser, "temperature", 0)
    _set(browser, "max-tokens", ENDLESS_TOKENS)
    _ask(browser, ENDLESS_PROMPT)
    _wait(lambda: (a := _answer(browser)) and a["audioChunks"], 120, what="the first audio chunk")
    from selenium.webdriver.common.by import By

    browser.find_element(By.ID, "stop").click()
    a = _finished(browser, timeout=30)
    assert a["state"] == "stopped" and a["finishReason"] is None and a["error"] is None, a
    assert "stopped" in a["figuresShown"]
    assert browser.execute_script("return window.omnistagePlayground.player.sources.size") == 0  # silence
    # The server saw the disconnect and freed the request in every stage.
    gauges = _wait(lambda: (g := _stage_gauges(_metrics(server))) and not any(g.values()) and g, 20, 0.1,
                   "every stage to be empty")
    assert {stage for _, stage in gauges} >= {"thinker", "talker", "code2wav"}
    assert _aborts(_metrics(server)) == aborts + 1
    # The page is usable again right away.
    assert browser.execute_script("return document.getElementById('send').disabled") is False


def test_api_error_is_shown_on_the_page(server, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    _open(browser, server)
    # Beyond the 4096-token context: typed by script (typing 5000 words key by key takes too long).
    browser.execute_script("document.getElementById('prompt').value = 'the cat '.repeat(2500);")
    browser.find_element(By.ID, "prompt").send_keys(Keys.END, Keys.ENTER)
    a = _finished(browser, timeout=60)
    assert a["state"] == "error"
    assert "maximum context length" in a["errorShown"] and "HTTP 400" in a["errorShown"], a["errorShown"]
    assert browser.execute_script("return document.querySelector('.msg.assistant .error').getAttribute('role')") \
        == "alert"
    # The failed turn is not kept in the conversation.
    assert browser.execute_script("return window.omnistagePlayground.history.length") == 0
    # Keyboard only: the focus is back in the message box, Tab walks the controls in reading order.
    from selenium.webdriver.common.action_chains import ActionChains

    order = [browser.execute_script("return document.activeElement.id")]
    for _ in range(9):  # key presses to the page: sent to a file input, keys would be taken for a file name
        ActionChains(browser).send_keys(Keys.TAB).perform()
        order.append(browser.execute_script("return document.activeElement.id"))
    assert order == ["prompt", "record", "audio-file", "image-file", "send", "new-chat", "speech", "voice",
                     "temperature", "max-tokens"], order


def test_error_inside_the_stream_is_shown_on_the_page(server, browser):
    from selenium.webdriver.common.by import By

    _open(browser, server)
    # The next request carries an id the server fails in its last stage (see FAULTS).
    _request_id(browser, "page-fault-1")
    _set(browser, "temperature", 0)
    browser.find_element(By.ID, "prompt").send_keys("Tell me about the sea.")
    browser.find_element(By.ID, "send").click()
    a = _finished(browser)
    assert a["state"] == "error" and a["text"], a  # the text streamed, then the stream reported the failure
    assert "injected fault in stage 'code2wav'" in a["errorShown"], a["errorShown"]
    assert "HTTP" not in a["errorShown"]  # reported in the event stream, not by a status line
    assert httpx.get(server + "/health").status_code == 200


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def test_media_from_files_and_the_microphone_go_with_the_next_message(server, browser, tmp_path):
    import soundfile
    from PIL import Image
    from selenium.webdriver.common.by import By

    rng = np.random.default_rng(5)
    wav, png = tmp_path / "question.wav", tmp_path / "photo.png"
    soundfile.write(str(wav), (rng.standard_normal(16000) * 0.1).astype(np.float32), 16000)
    Image.fromarray(rng.integers(0, 256, (64, 96, 3), dtype=np.uint8)).save(png)
    _open(browser, server)
    browser.find_element(By.ID, "audio-file").send_keys(str(wav))
    browser.find_element(By.ID, "image-file").send_keys(str(png))
    _wait(lambda: browser.execute_script("return window.omnistagePlayground.attachments.length") == 2,
          30, what="the files to be attached")
    record = browser.find_element(By.ID, "record")  # Chromium's fake microphone: a beep
    record.click()
    _wait(lambda: record.get_attribute("aria-pressed") == "true", 30, what="recording to start")
    time.sleep(1.0)
    record.click()
    _wait(lambda: browser.execute_script("return window.omnistagePlayground.attachments.length") == 3,
          30, what="the recording to be attached")
    shown = browser.execute_script("""return [...document.querySelectorAll('#attachments li')]
        .map(li => [li.firstChild.textContent, li.querySelector('button').getAttribute('aria-label')]);""")
    assert shown[:2] == [["audio: question.wav", "Remove question.wav"], ["image: photo.png", "Remove photo.png"]]
    assert re.fullmatch(r"audio: recording-3\.(webm|ogg)", shown[2][0]), shown
    _set(browser, "temperature", 0)
    _set(browser, "max-tokens", 8)
    _ask(browser, "What is in these?")
    a = _finished(browser)
    assert a["state"] == "done" and a["error"] is None and a["text"], a
    parts = a["request"]["messages"][-1]["content"]
    assert [p["type"] for p in parts] == ["input_audio", "image_url", "input_audio", "text"]
    assert parts[0]["input_audio"] == {"data": _b64(wav.read_bytes()), "format": "wav"}
    assert parts[1]["image_url"] == {"url": "data:image/png;base64," + _b64(png.read_bytes())}
    assert parts[2]["input_audio"]["format"] in ("webm", "ogg") and len(parts[2]["input_audio"]["data"]) > 1000
    assert parts[3] == {"type": "text", "text": "What is in these?"}
    user = browser.find_element(By.CSS_SELECTOR, ".msg.user .text").text
    assert user.startswith("[audio: question.wav] [image: photo.png] [audio: recording-3.") and "What is in" in user
    assert browser.execute_script("return document.getElementById('attachments').hidden")  # sent, cleared
    # The API gives the same answer to the same request, spoken and all.
    body = {**a["request"], "stream": False, "audio": {"voice": "ethan", "format": "pcm16"}}
    body.pop("stream_options")
    reply = httpx.post(server + "/v1/chat/completions", json=body, timeout=120).json()
    assert reply["choices"][0]["message"]["content"] == a["text"]
    page_pcm = np.frombuffer(base64.b64decode(browser.execute_script(
        "return window.omnistagePlayground.answers[0].pcmBase64()")), dtype="<i2")
    api_pcm = np.frombuffer(base64.b64decode(reply["choices"][0]["message"]["audio"]["data"]), dtype="<i2")
    assert page_pcm.shape == api_pcm.shape and page_pcm.size > 0
    assert np.abs(page_pcm.astype(np.int32) - api_pcm.astype(np.int32)).max() <= MAX_INT16_DIFF

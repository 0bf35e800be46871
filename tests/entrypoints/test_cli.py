"""The README's commands as a user runs them: `omnistage serve` on the built-in model, `omnistage generate`."""

import os
import socket
import subprocess
import sys
import time
import wave

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli_env(tmp_path):
    # A private cache: the built-in model is built on first use, as on a fresh machine.
    return {**os.environ, "OMNISTAGE_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}


def test_serve_without_a_model_serves_the_built_in_checkpoint(tmp_path):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "omnistage.entrypoints.cli", "serve", "--port", str(port)],
        env=cli_env(tmp_path), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.2)
        assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]] == ["omnistage-tiny"]
        body = {"model": "omnistage-tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                "temperature": 0}
        reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=60).json()
        assert reply["usage"]["completion_tokens"] == 4 and reply["choices"][0]["finish_reason"] == "length"
        assert list((tmp_path / "cache").iterdir())  # built into the cache dir
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_generate_writes_the_answer_audio(tmp_path, tiny_ckpt):
    out = tmp_path / "answer.wav"
    done = subprocess.run(
        [sys.executable, "-m", "omnistage.entrypoints.cli", "generate", "Tell me about the sea.", "--model",
         str(tiny_ckpt), "--audio", str(out), "--max-tokens", "8", "--seed", "0"],
        env=cli_env(tmp_path), capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip()  # the answer text
    with wave.open(str(out)) as w:
        assert w.getframerate() == 24000 and w.getnchannels() == 1 and w.getsampwidth() == 2
        assert w.getnframes() > 0

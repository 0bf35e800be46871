"""The Qwen2.5-Omni stage models under today's AR scheduler + runner, wired by the two bridges.

Two requests (different prompts, voices, seeds) run batched through Thinker -> Talker -> Token2Wav with chunked
prefill (a 16-token step budget), the Talker paused whenever its next text row is not there yet, and
streaming Token2Wav windows. Each request must get exactly what transformers gives it alone: Thinker tokens,
Talker codes; and the audio of its codes streamed alone. The driver here stands in for the stage runtime.
"""

from __future__ import annotations

import torch
from q25_reference import TALKER_NEW_TOKENS, THINKER_NEW_TOKENS, loaded, prompt_ids, reference

from omnistage.core.request import Request
from omnistage.core.sampling_params import SamplingParams
from omnistage.core.scheduler import ARScheduler, SchedulerConfig
from omnistage.models.qwen2_5_omni.bridges import Talker2Token2WavBridge, TalkerUpdate, Thinker2TalkerBridge
from omnistage.models.qwen2_5_omni.stage_models import (
    SPEECH_KEY,
    TalkerStageModel,
    ThinkerStageModel,
    Token2WavStageModel,
)
from omnistage.models.qwen2_5_omni.streaming import ChunkPlan, Token2WavStream
from omnistage.models.qwen2_5_omni.token2wav import NoiseStream
from omnistage.models.qwen2_5_omni.voices import load_speakers
from omnistage.runner.ar_runner import ARModelRunner

REQUESTS = (("a", 0, "Ethan", 11), ("b", 1, "Chelsie", 12))  # req_id, prompt, voice, seed
PLAN = ChunkPlan(chunk_blocks=2, past_blocks=1, future_blocks=1)


class _ARStage:
    def __init__(self, model) -> None:
        cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16, max_model_len=256, block_size=4, num_blocks=128)
        self.sched = ARScheduler(cfg)
        self.runner = ARModelRunner(model, num_blocks=cfg.num_blocks, block_size=cfg.block_size)

    def step(self):
        so = self.sched.schedule()
        if so.is_empty:
            return None, []
        self.runner.execute_model(so)
        result = self.runner.sample_tokens()
        updates = self.sched.update_from_output(so, result.sampled)
        for u in updates:
            if u.finished:
                self.runner.free(u.req_id)
        return result, updates


def _run():
    ld = loaded()
    im_end = ld.tokenizer.convert_tokens_to_ids("<|im_end|>")
    talker_model = TalkerStageModel.for_speakers(ld.talker, ld.thinker.model.embed_tokens, load_speakers(
        ld.config._name_or_path))
    thinker, talker = _ARStage(ThinkerStageModel(ld.thinker)), _ARStage(talker_model)
    token2wav = Token2WavStageModel(ld.token2wav)
    dit = ld.token2wav.code2wav_dit_model
    to_talker = Thinker2TalkerBridge(ld.talker.ids)
    to_wav = Talker2Token2WavBridge(PLAN, dit.block_size, dit.repeats, dit.mel_dim, talker_model.eos_ids)
    for req_id, prompt, voice, seed in REQUESTS:
        ids = prompt_ids(prompt)[0].tolist()
        greedy = SamplingParams(temperature=0.0, max_tokens=THINKER_NEW_TOKENS, min_tokens=THINKER_NEW_TOKENS)
        thinker.sched.add_request(Request(req_id, ids, greedy, eos_token_ids=(im_end,), extra={SPEECH_KEY: True}))
        codes = SamplingParams(temperature=0.0, max_tokens=TALKER_NEW_TOKENS, seed=seed)
        talker.sched.add_request(Request(req_id, [], codes, eos_token_ids=talker_model.eos_ids), wait_for_input=True)
        to_talker.add_request(req_id, len(ids), voice)
        to_wav.add_request(req_id, voice, seed)

    def deliver(req_id: str, update: TalkerUpdate | None) -> None:
        if update is None:
            return
        talker.runner.buffer.merge(req_id, update.state)
        if update.prompt_ids is not None:
            talker.sched.add_input(req_id, update.prompt_ids, finished=True)
        talker.sched.resume(req_id)

    tokens = {r: [] for r, *_ in REQUESTS}
    codes = {r: [] for r, *_ in REQUESTS}
    audio = {r: [] for r, *_ in REQUESTS}
    pauses = 0
    for _ in range(500):
        if not (thinker.sched.has_unfinished() or talker.sched.has_unfinished()):
            break
        result, updates = thinker.step()
        for req_id, payload in (result.stage_outputs if result else {}).items():
            deliver(req_id, to_talker.on_thinker_rows(req_id, payload["positions"], payload["rows"]))
        for u in updates:
            tokens[u.req_id] += u.new_token_ids
            if u.finished:
                deliver(u.req_id, to_talker.on_thinker_finished(u.req_id))
        for _ in range(2):  # the Talker steps twice as often: it catches up with the Thinker and waits
            result, updates = talker.step()
            windows = []
            for u in updates:
                codes[u.req_id] += u.new_token_ids
                windows += [(u.req_id, w) for w in to_wav.on_talker_tokens(u.req_id, u.new_token_ids)]
                if u.finished:
                    windows += [(u.req_id, w) for w in to_wav.on_talker_finished(u.req_id)]
                req = talker.sched.get_request(u.req_id)
                if not req.is_finished and not talker_model.text_ready(talker.runner.state_of(u.req_id), req.num_output_tokens):
                    talker.sched.pause_for_input(u.req_id)
                    pauses += 1
            if windows:
                out = token2wav.forward_batch([w for _, w in windows]).multimodal_outputs
                for (req_id, _), row, n in zip(windows, out["audio"], out["audio_lengths"].tolist()):
                    audio[req_id].append(row[:n])
    else:
        raise AssertionError("pipeline did not finish")
    assert pauses > 0  # the Talker did catch up with the Thinker and waited for its text
    return tokens, codes, {r: torch.cat(parts) for r, parts in audio.items()}, (thinker, talker, to_talker, to_wav)


@torch.no_grad()
def test_batched_stages_match_solo_reference_and_free_everything():
    tokens, codes, audio, (thinker, talker, to_talker, to_wav) = _run()
    t2w = loaded().token2wav
    for req_id, prompt, voice, seed in REQUESTS:
        ref = reference("length", 1.0, prompt, voice)
        assert tokens[req_id] == ref.generated.tolist(), req_id
        assert codes[req_id] == ref.codes, req_id  # no EOS within the limit: every sampled token is a code
        dit = t2w.code2wav_dit_model
        solo = Token2WavStream(PLAN, dit.block_size, dit.repeats, voice,
                               NoiseStream(torch.Generator().manual_seed(seed), dit.mel_dim))
        with torch.inference_mode():
            expect = torch.cat(t2w.decode_windows(solo.push(ref.codes) + solo.finish()))
        assert audio[req_id].shape == (len(ref.codes) * dit.repeats * t2w.hop,)
        assert (audio[req_id] - expect).abs().max().item() <= 1e-4, req_id
    for stage in (thinker, talker):
        assert len(stage.runner.buffer) == 0 and stage.sched.kv_stats().num_free_blocks == stage.sched.config.num_blocks
    assert to_talker.num_pending == 0 and to_wav.num_pending == 0

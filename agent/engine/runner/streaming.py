"""StreamingRunner: Qwen3-Omni replies, one codec frame (80 ms of audio) per engine tick, for
many sessions at once (continuous batching).

Per session: the system prompt goes into the cache first, a chunk per tick from the open on
(agent/engine/stages/system_prefill.py); the user's audio is encoded and
prefilled as it becomes final (AudioStream); at end of turn only the tail of the audio, the
frames and the assistant header are left. Then, per tick, every reply the scheduler picks
advances one frame, each stage one batched call over those sessions (agent/engine/stages/frame_batch.py):
the thinker stays exactly one token ahead of the talker, the talker makes codebook 0, the code
predictor the 15 residual codes, and code2wav renders that frame's samples, which go out at
once. Sessions keep their state in rows (slots) of static caches, so sessions at any point of
their replies share a call, and a session joins or leaves the batch between any two ticks.

Scheduling, each tick: the policy is agent/engine/runner/scheduler.py's (first-audio deadlines,
then playout buffers, then microphone audio and speculations), on the estimates `playout()`
reports; `step()` carries out its Plan. A first-audio reply's prefill is chunked and batched
with other sessions' (agent/engine/stages/bucketed_prefill.py) and renders its first frame in
the tick it completes; an idle engine prefills microphone audio at once, in append_audio;
speculative replies (agent/engine/runner/speculation.py) are parked once their first frame is
made, until their commit.

The runner composes peer components, each given only what it uses (none holds the runner):
sessions.py (states, slots, priorities), replies.py (the reply lifecycle, the only code that
moves a reply's phase), intake.py (frames, audio, held or discarded turns, switches),
estimates.py (what the scheduler sees), first_audio.py (a tick's end-of-turn prefills), speculation.py, edits.py (user and
system items, truncate, instructions, voice), tools.py (tool sets; each reply's grammar: agent/engine/stages/tool_grammar.py),
transcription.py beside transcriber.py, and the stages TurnPrefill (turns) and FrameBatcher
(frames). Every command is a runner method (agent/engine/commands.py) delegating to its
component; `step()` is the tick.

A reply's phase (agent/engine/state/phase.py) is moved only by Replies (replies.py); what each stage has made is in agent/engine/state/reply.py (PrefillStage,
TextStage, VoiceStage), each advanced by its own stage.

The result equals transformers' generate() on the same prompt (same text ids, same codec
codes, same waveform up to float rounding), greedy (tests/unit/test_streaming_exact.py) and
sampled from the same seed (tests/unit/test_sampling_exact.py);
and a batched tick equals the same sessions stepped alone: tests/unit/test_batching.py.

GPU path: the MoE experts fused, the slot caches reserved at their limit, the per-frame steps
compiled and captured as CUDA graphs per batch bucket here in the constructor, on the engine
thread that replays them (agent/engine/compile/wiring.py, docs/running.md). Tests run the same
wiring on CPU with agent/engine/instruments/fake_graphs.py's `fake_graph_config()`.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from agent.decoding import Decoding
from agent.engine.api import Output, StageTime, Voices
from agent.engine.checkpoints.model import LoadedModel
from agent.engine.codecs.output_audio import talker_tokens_for
from agent.engine.compile.cache import compiled_shapes
from agent.engine.compile.wiring import GraphConfig, Graphing, GraphMode
from agent.engine.ops.fusion import fuse_decoder
from agent.engine.ops.moe import fuse_moe
from agent.engine.runner.edits import ConversationEdits
from agent.engine.runner.estimates import Estimates
from agent.engine.runner.first_audio import FirstAudio
from agent.engine.runner.intake import Intake
from agent.engine.runner.replies import Replies
from agent.engine.runner.scheduler import PlayoutEstimate, SchedulerConfig, idle_s, plan_tick
from agent.engine.runner.sessions import SessionTable
from agent.engine.runner.speculation import Speculation
from agent.engine.runner.tools import ToolCommands
from agent.engine.runner.transcriber import Transcriber
from agent.engine.runner.transcription import TranscriptionCommands
from agent.engine.stages.frame_batch import FrameBatcher
from agent.engine.stages.talker import TalkerOps
from agent.engine.stages.thinker import ThinkerOps
from agent.engine.stages.tool_grammar import ToolGrammars
from agent.engine.stages.turn_parts import TurnParts
from agent.engine.stages.turn_prefill import TurnPrefill
from agent.engine.stages.video_clock import VideoPolicy
from agent.engine.state.kv import KVState
from agent.engine.state.phase import ReplyPhase
from agent.engine.state.session import SessionState
from agent.tools.spec import ToolSet


class StreamingRunner:
    @torch.inference_mode()
    def __init__(
        self,
        loaded: LoadedModel,
        system_prompt: str,
        max_reply_tokens: int = 48,
        max_reply_seconds: float = 4.0,
        context_limit: int = 32768,
        audio_window_s: float | None = None,
        record: bool = False,
        max_sessions: int = 8,
        schedule: SchedulerConfig | None = None,
        clock: Callable[[], float] = time.perf_counter,
        graphs: GraphConfig | GraphMode = "auto",
        video: VideoPolicy | None = VideoPolicy(),
        decoding: Decoding = Decoding.greedy(),
    ) -> None:
        """audio_window_s: the audio encoder's attention window (n_window_infer) for the
        incremental prefill; None keeps the checkpoint's (8 s), which is what generate() uses.
        record: keep each session's last reply (codes, float waveform) in `records`.
        max_sessions: slots in the static caches (open sessions at most).
        clock: the scheduler's time source (seconds), injectable for tests.
        graphs: CUDA graph mode or settings ("auto": graphs on a CUDA device, eager elsewhere;
        "off"; "cuda"; a GraphConfig, e.g. fake_graphs.fake_graph_config(): the graph wiring on
        CPU). video: the camera as video on the audio clock (agent/engine/stages/video_clock.py); None:
        frames are not looked at. decoding: each stage's token choice (agent/decoding.py;
        default greedy, what generate(do_sample=False) does); a reply draws from its own seed,
        taken from `decoding.seed` when given. With graphs on, this fuses the MoE
        experts of `loaded.model` in place and captures here."""
        if max_reply_tokens < 2:
            raise ValueError("max_reply_tokens must be >= 2 (a reply is one text token plus its end)")
        self.loaded = loaded
        self.max_reply_tokens = max_reply_tokens
        self.talker_max_tokens = talker_tokens_for(max_reply_seconds, loaded.output_rate)
        self.schedule = schedule or SchedulerConfig()
        self.clock = clock
        self.eos = set(loaded.thinker_eos_ids)
        self.decoding = decoding
        # Reply seeds: reproducible from decoding.seed, else fresh from the OS.
        seeds = random.Random(decoding.seed) if decoding.seed is not None else random.SystemRandom()
        self.record = record
        n_window_infer = None if audio_window_s is None else int(round(audio_window_s * 100))
        config = graphs if isinstance(graphs, GraphConfig) else GraphConfig(mode=graphs)
        self.graphing = Graphing(config, loaded.device, max_sessions)
        if self.graphing.enabled:
            # transformers picks the experts' implementation at run time and may pick a loop
            # with host syncs; the fused block is graph-safe, the same function (bit for bit on
            # CPU, to bf16 rounding on CUDA: tests/unit/test_moe.py).
            fuse_moe(loaded.model)
        # q/k/v as one matmul in every thinker and talker layer (views: no second copy).
        fuse_decoder(loaded.model.thinker.model.language_model)
        fuse_decoder(loaded.model.talker.model)
        self.thinker = ThinkerOps(
            loaded, max_sessions, context_limit, self.graphing, track_ids=decoding.thinker.repetition_penalty != 1.0
        )
        # The talker holds every user turn plus the reply's frames (one per codec frame).
        talker_limit = context_limit + self.talker_max_tokens + 16
        self.talker = TalkerOps(loaded, max_sessions, talker_limit, sampling=decoding.talker, graphing=self.graphing)
        self.turns = TurnPrefill(
            TurnParts(
                loaded,
                self.thinker,
                self.talker,
                system_prompt,
                max_reply_tokens,
                context_limit,
                n_window_infer,
                video,
                self.schedule.prefill_chunk_tokens,
            )
        )
        self.frames = FrameBatcher(
            loaded, self.thinker, self.talker, max_sessions, max_reply_tokens, record, self.graphing, decoding
        )
        # Every cache is in place (reserved): capture now, on the thread that will replay, every
        # graph a call can need (nothing is compiled or captured once the engine is ready); the
        # compiles first look for an earlier start's artifacts.
        caches = {"thinker": self.thinker.kv, "talker": self.talker.kv}
        self.graphing.load_compile_cache(compiled_shapes(loaded.model.config, loaded.dtype, max_sessions, caches))
        self.thinker.capture_graphs()
        self.talker.capture_graphs()
        self.frames.capture_graphs()
        self.graphing.finish_start_up()
        self.transcriber = Transcriber(loaded, self.thinker)  # live input transcription
        # The components, side by side: each is given only what it uses.
        self.sessions = SessionTable(max_sessions, self.transcriber)
        # Tool calls in Qwen's format, constrained by a grammar per tool set (compiled once, cached).
        grammars = ToolGrammars(loaded.tokenizer, self.thinker.vocab, loaded.thinker_eos_ids)
        self.replies = Replies(
            self.sessions,
            loaded,
            self.turns,
            self.frames,
            self.talker,
            clock,
            self.talker_max_tokens,
            seeds,
            record,
            grammars,
        )
        self.records = self.replies.records  # each session's last reply (record=True)
        self.speculation = Speculation(self.sessions, self.replies)
        self.tools = ToolCommands(self.sessions, grammars, self.speculation)
        self.intake = Intake(self.sessions, self.turns, self.transcriber, self.replies, self.speculation, clock)
        self.estimates = Estimates(self.sessions, clock)
        self.first_audio = FirstAudio(self.turns, self.replies, self.frames, self.intake.discard_turn)
        self.edits = ConversationEdits(self.sessions, loaded, self.turns, self.talker, self.speculation)
        self.transcription = TranscriptionCommands(self.sessions, self.transcriber, self.turns)

    @classmethod
    def from_config(cls, loaded: LoadedModel, config, graphs: GraphConfig | None = None) -> "StreamingRunner":
        """From agent.config.Config (system_prompt, max_reply_tokens, max_reply_seconds,
        audio_window_s, engine_slots, context_limit, cuda_graphs, compile, compile_regions,
        compile_per_bucket, attention, cache_dir). `graphs`: graph
        settings (default "auto": graphs on a CUDA device); `config.cuda_graphs=False`
        (--no-cuda-graphs) turns them off whatever they say; `config.compile` decides compilation."""
        graphs = graphs or GraphConfig()
        if graphs.mode == "auto" and loaded.device.type == "cpu" and config.cpu_graphs:
            # On CPU the per-frame steps replay as TorchScript traces, off the GIL (agent/engine/compile/cpu_traces.py).
            graphs = replace(graphs, mode="cpu")
        if not config.cuda_graphs:
            graphs = replace(graphs, mode="off")
        # --compile, its cache beside the tiny model's (a restart does not recompile from scratch).
        graphs = replace(
            graphs,
            compile=config.compile,
            compile_cache=graphs.compile_cache or Path(config.cache_dir) / "compile",
            compile_regions=graphs.compile_regions if config.compile_regions is None else config.compile_regions,
            compile_dynamic_batch=False if config.compile_per_bucket else graphs.compile_dynamic_batch,
            attention=graphs.attention if config.attention == "auto" else config.attention,
            compile_budget_s=config.compile_budget_s or graphs.compile_budget_s,
        )
        return cls(
            loaded,
            system_prompt=config.system_prompt,
            max_reply_tokens=config.max_reply_tokens,
            max_reply_seconds=config.max_reply_seconds,
            audio_window_s=config.audio_window_s,
            max_sessions=config.engine_slots,  # transcription sessions' slots included
            context_limit=config.context_limit,
            graphs=graphs,
            video=VideoPolicy(config.video_fps, config.video_window_s, config.video_turn_tokens)
            if config.video
            else None,
            decoding=config.sampling,
        )

    # ---- sessions and replies --------------------------------------------------------------

    @torch.inference_mode()
    def open_session(self, session_id: str) -> None:
        slot = self.sessions.take_session_slot()
        state = SessionState(slot=slot, thinker=KVState(slot), talker=KVState(slot), turn=self.turns.new_turn())
        self.sessions.add(session_id, state)
        self.turns.system.start(state)  # (in chunks, from the next tick: SystemPrefill)

    def close_session(self, session_id: str) -> None:
        self.sessions.remove(session_id)  # (its slots go back, its transcription's too)
        self.records.pop(session_id, None)

    @torch.inference_mode()
    def begin_reply(self, session_id: str, images: list[np.ndarray], text_only: bool = False) -> None:
        state = self.sessions[session_id]
        if state.choices.captions_only:
            raise RuntimeError("a transcription-only session has no replies")
        held = bool(state.held_turns)
        self.replies.begin(state, images, text_only)
        if not held:  # (a held turn's transcript ended when it was held)
            # The turn is answered: its transcript ends once the reply's prefill has its audio tail.
            self.transcriber.ended(session_id, state.reply.turn)

    def cancel_reply(self, session_id: str) -> None:
        state = self.sessions.get(session_id)
        if state is not None and state.reply is not None:
            self.replies.cancel(session_id, state)

    def take_ready(self) -> list[Output]:
        """Output ready outside a step (a committed speculation's held frame): the engine loop
        emits it right after the command that released it."""
        return self.replies.take_ready()

    # ---- delegated commands (the loop's handlers for agent/engine/commands.py) -----------------------------------

    def speculate(self, session_id: str, images: list[np.ndarray], text_only: bool = False) -> bool:
        return self.speculation.speculate(session_id, images, text_only)

    def drop_speculation(self, session_id: str) -> bool:
        return self.speculation.drop_speculation(session_id)

    def append_video(self, session_id: str, image: np.ndarray, at: float) -> None:
        self.intake.append_video(session_id, image, at)

    def append_audio(self, session_id: str, pcm: np.ndarray) -> None:
        self.intake.append_audio(session_id, pcm)

    def discard_turn(self, session_id: str) -> None:
        self.intake.discard_turn(session_id)

    def hold_turn(self, session_id: str) -> int:
        return self.intake.hold_turn(session_id)

    def set_video(self, session_id: str, on: bool) -> bool:
        return self.intake.set_video(session_id, on)

    def set_priority(self, session_id: str, priority: int) -> int:
        return self.intake.set_priority(session_id, priority)

    def add_user_text(self, session_id: str, text: str) -> int:
        return self.edits.add_user_text(session_id, text)

    def add_user_image(self, session_id: str, image: np.ndarray) -> int:
        return self.edits.add_user_image(session_id, image)

    def add_system_text(self, session_id: str, text: str) -> int:
        return self.edits.add_system_text(session_id, text)

    def add_assistant_text(self, session_id: str, text: str, joins: bool = False) -> int:
        return self.edits.add_assistant_text(session_id, text, joins)

    def drop_turn_items(self, session_id: str) -> None:
        # The fallback answered the turn: the audio of its committed items goes too, and the
        # latest reply is the fallback's, not one this model holds (nothing of it to truncate).
        self.intake.discard_turn(session_id, keep_items=False)
        self.sessions[session_id].last_reply = None
        self.edits.drop_turn_items(session_id)

    def voices(self) -> Voices:
        return Voices(tuple(sorted(self.talker.voices)), self.talker.default_voice)

    def set_voice(self, session_id: str, voice: str) -> str:
        return self.edits.set_voice(session_id, voice)

    def set_instructions(self, session_id: str, text: str) -> str:
        return self.edits.set_instructions(session_id, text)

    def set_context_turns(self, session_id: str, turns: int) -> int:
        return self.edits.set_context_turns(session_id, turns)

    def set_reply_instructions(self, session_id: str, text: str) -> int:
        return self.edits.set_reply_instructions(session_id, text)

    def truncate_reply(self, session_id: str, audio_frames: int, missing_ok: bool = False) -> dict:
        return self.edits.truncate_reply(session_id, audio_frames, missing_ok)

    def set_tools(self, session_id: str, tools: ToolSet | None) -> int:
        return self.tools.set_tools(session_id, tools)

    def set_reply_tools(self, session_id: str, tools: ToolSet | None) -> int:
        return self.tools.set_reply_tools(session_id, tools)

    def context(self, session_id: str) -> dict:
        return self.edits.context(session_id)

    def set_transcription(self, session_id: str, mode: str) -> str:
        return self.transcription.set_transcription(session_id, mode)

    def set_transcript_item(self, session_id: str, item_id: str) -> None:
        self.transcription.set_transcript_item(session_id, item_id)

    def end_turn(self, session_id: str) -> None:
        self.transcription.end_turn(session_id)

    def end_user_item(self, session_id: str, transcript: bool = True) -> None:
        self.speculation.drop_speculation(session_id)  # it forked the audio stream that ends here
        self.transcription.end_user_item(session_id, transcript)

    def playout(self) -> list[PlayoutEstimate]:
        return self.estimates.playout()

    # ---- the tick ------------------------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self.replies.ready) or self.replies.busy() or self._other_work()

    def idle_s(self) -> float:
        """Seconds until a step is of use (0: now). Replies far enough ahead of real time are
        not stepped before they need to be (agent/engine/runner/scheduler.py); other work is due now."""
        if self.replies.ready:
            return 0.0
        if self._other_work():
            return 0.0
        now = self.clock()
        return idle_s(self.estimates.views(self.estimates.scheduled(), now), self.schedule)

    @torch.inference_mode()
    def step(self) -> list[Output]:
        """One tick: the scheduler's pick of replies advances by one codec frame (text-only
        replies: one token); first-audio replies get their prefill (chunk) and first frame;
        speculative ones too, when nothing else needs the tick, their output held."""
        outputs: list[Output] = self.take_ready()
        now = self.clock()
        replies = self.estimates.scheduled()
        plan = plan_tick(self.estimates.views(replies, now), self.schedule, other_work=self._other_work())

        # First-audio replies (speculative ones last, in ticks with nothing more urgent): their
        # prefill chunks, and the first tokens of those whose prefill finished.
        budget = self.schedule.prefill_chunk_tokens
        first, started = self.first_audio.advance(plan.first + plan.speculate, replies, budget)
        outputs += first
        decoding = [(sid, replies[sid]) for sid in plan.decode]
        outputs += self.frames.decode(decoding)
        # Row order puts the new replies' first frames first.
        outputs += self.frames.render(started + decoding, self.clock())
        for _, state in started:
            self.replies.first_frame(state)
        for session_id, state in started + decoding:
            # A held reply cannot be finished: its first token is never the end and it stops at one frame.
            if state.reply.phase is ReplyPhase.STREAMING and state.reply.finished:
                outputs += self.replies.finish(session_id, state, "")
        if plan.audio_prefill:
            self.intake.prefill_speaking(self.schedule.prefill_chunk_tokens)
            # Transcription last of all: under load the partials are what slows down first.
            outputs += self.transcriber.step(self.sessions)
        # Stage times first: callers (and tests) read a reply's ReplyDone as the last output.
        return self._stage_times() + self.replies.hold(outputs)

    # ---- internals ---------------------------------------------------------------------------

    def _other_work(self) -> bool:
        """Work besides the replies: system prompts and microphone audio to prefill, transcription."""
        waiting = self.turns.system.waiting
        return any(waiting(s) or self.turns.pcm_queued(s) for s in self.sessions.values()) or self.transcriber.has_work(
            self.sessions
        )

    def _stage_times(self) -> list[Output]:
        outputs: list[Output] = []
        for session_id, state in self.sessions.items():
            outputs += [StageTime(name, s, session_id, batch=n) for name, s, n in state.pending_stages]
            state.pending_stages.clear()
        outputs += self.frames.stage_times
        self.frames.stage_times = []
        return outputs

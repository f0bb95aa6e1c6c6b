"""What the test modules share (imported, never collected): tests/ is on sys.path through
tests/conftest.py's folder, so a test imports `from support.engine_drive import …`.

- engine_drive: microphone audio for the engine tests, feeding it to a runner, stepping it idle,
  generate() as the reference;
- engine_hold: an engine whose thread a test can stall;
- loopback: a free loopback port;
- realtime_helpers: a running agent on loopback, its metrics, offers and refusals;
- speech: espeak-ng speech, WAV files read, resampled and written;
- realtime_ws: the `openai` SDK's realtime WebSocket as the tests drive it (paced appends, events);
- echo: a speakerphone for the echo guard (a real track fed back into a real InputBuffer).
"""

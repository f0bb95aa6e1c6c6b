"""The model work of a turn (prefill) and of a frame (thinker, talker, code predictor), batched over sessions."""

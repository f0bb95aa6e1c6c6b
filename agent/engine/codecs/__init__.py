"""From codes to output: code2wav over slots, incremental detokenization, PCM."""

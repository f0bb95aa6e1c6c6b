"""Media: microphone audio onto the session clock, voice detection, camera sampling, paced playout."""

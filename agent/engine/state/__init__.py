"""Engine-side state per session and per reply, owned by the streaming runner's sessions table."""

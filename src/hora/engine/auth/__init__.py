"""The engine's authentication: both ends of a control connection prove the job's secret and their rank before
it carries a frame (the handshake, the listener), and every frame carries its sender's tag (the seal)."""

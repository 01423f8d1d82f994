"""The engine's scheduling: who runs the next round and when (the negotiator), what a round decides (the table),
what this rank has pending, launching what was decided in the agreed order, and the handles users wait on."""

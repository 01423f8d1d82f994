"""The engine's transport: the control planes that carry a round's frames (the TCP mesh, the Gloo plane, the
local plane), who exchanges with whom in a round, the Gloo plane's watch of its peers, and how a connection
fails."""

"""Reaching hosts: the per-host agent, the driver's handle on it, the transports (local or ssh), preflight
checks, and the out-of-memory probe the agent runs.
"""

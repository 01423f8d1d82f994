"""Contracts between the launcher and the workers, imported by both sides (standard library only): the agent's
messages and the board's keys, the elastic store keys and records, the job's secret, the signed store values,
the code fingerprint, addresses and interfaces, and how ranks are placed on hosts.
"""
